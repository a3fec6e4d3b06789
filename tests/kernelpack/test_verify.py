"""Verification refuses every kind of tampering with a specific error, before anything is imported."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kernelpack.archive import Limits, read_archive, write_archive
from kernelpack.build import BuildResult
from kernelpack.errors import (
    ArchiveFormatError,
    BundleNotFoundError,
    DigestMismatchError,
    ExtraMemberError,
    ManifestError,
    MissingMemberError,
    SignatureError,
    SizeLimitError,
    UnsafeMemberError,
    UntrustedKeyError,
    VerificationError,
)
from kernelpack.manifest import MANIFEST_NAME, SIGNATURE_NAME, canonical_json
from kernelpack.signing import load_private_key, sign
from kernelpack.verify import sha256_hex, verify_path
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import Keys, build_bundle, write_tiny_src


def members_of(b: BuildResult) -> dict[str, bytes]:
    return read_archive(b.path.read_bytes())


def resign(members: dict[str, bytes], keys: Keys, manifest: dict | bytes) -> None:
    data = manifest if isinstance(manifest, bytes) else canonical_json(manifest)
    members[MANIFEST_NAME] = data
    members[SIGNATURE_NAME] = sign(data, load_private_key(keys.pair.private_path)).to_bytes()


def raw_tar(path: Path, members: dict[str, bytes], extra: Callable[[tarfile.TarFile], None]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        extra(tar)
    return path


def test_untouched_bundle_verifies(tiny_bundle: BuildResult, keys: Keys) -> None:
    vb = verify_path(tiny_bundle.path, keys.trusted)
    assert vb.key_id == keys.pair.key_id
    assert vb.digest == sha256_hex(tiny_bundle.path.read_bytes()) == tiny_bundle.digest
    assert vb.manifest == tiny_bundle.manifest
    assert set(vb.members) == set(vb.manifest.files) | {MANIFEST_NAME, SIGNATURE_NAME}
    with pytest.raises(DigestMismatchError, match="expected"):
        verify_path(tiny_bundle.path, keys.trusted, digest="0" * 64)


def test_flipped_byte_in_a_kernel_names_the_file(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    data = bytearray(m["kernels/bias_gelu.py"])
    data[len(data) // 2] ^= 0x01
    m["kernels/bias_gelu.py"] = bytes(data)
    with pytest.raises(DigestMismatchError, match=r"file kernels/bias_gelu.py does not match"):
        verify_path(write_archive(tmp_path / "t.kpack", m) and tmp_path / "t.kpack", keys.trusted)


def test_flipped_byte_in_the_container(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    blob = bytearray(tiny_bundle.path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (tmp_path / "t.kpack").write_bytes(bytes(blob))
    with pytest.raises(VerificationError):
        verify_path(tmp_path / "t.kpack", keys.trusted)


def test_swapped_files(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    art = tiny_bundle.manifest.artifacts[0]
    m[art.cubin], m[art.ptx] = m[art.ptx], m[art.cubin]
    write_archive(tmp_path / "t.kpack", m)
    with pytest.raises(DigestMismatchError, match=f"file {art.cubin} does not match"):
        verify_path(tmp_path / "t.kpack", keys.trusted)


def test_missing_and_wrong_signature(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    del m[SIGNATURE_NAME]
    write_archive(tmp_path / "a.kpack", m)
    with pytest.raises(SignatureError, match="not signed"):
        verify_path(tmp_path / "a.kpack", keys.trusted)
    m[SIGNATURE_NAME] = sign(b"something else", load_private_key(keys.pair.private_path)).to_bytes()
    write_archive(tmp_path / "b.kpack", m)
    with pytest.raises(SignatureError, match="does not match the manifest"):
        verify_path(tmp_path / "b.kpack", keys.trusted)
    m[SIGNATURE_NAME] = b'{"algorithm": "ed25519"}'
    write_archive(tmp_path / "c.kpack", m)
    with pytest.raises(SignatureError, match="malformed"):
        verify_path(tmp_path / "c.kpack", keys.trusted)


def test_unknown_key_is_refused_by_id(tiny_bundle: BuildResult, keys: Keys, other_keys: Keys,
                                      tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    resign(m, other_keys, m[MANIFEST_NAME])
    write_archive(tmp_path / "t.kpack", m)
    with pytest.raises(UntrustedKeyError, match=other_keys.pair.key_id):
        verify_path(tmp_path / "t.kpack", keys.trusted)
    assert verify_path(tmp_path / "t.kpack", other_keys.trusted).key_id == other_keys.pair.key_id


def test_old_signature_replayed_on_new_content(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path,
                                               aot_cache: Path) -> None:
    newer = build_bundle(write_tiny_src(tmp_path / "src", version="0.2.0"), tmp_path / "new.kpack",
                         keys.pair.private_path, cache_dir=aot_cache)
    m = members_of(newer)
    m[SIGNATURE_NAME] = members_of(tiny_bundle)[SIGNATURE_NAME]
    write_archive(tmp_path / "t.kpack", m)
    with pytest.raises(SignatureError, match="does not match the manifest"):
        verify_path(tmp_path / "t.kpack", keys.trusted)
    # edited manifest (a launch config) with the original signature
    m = members_of(tiny_bundle)
    doc = json.loads(m[MANIFEST_NAME])
    doc["kernels"][0]["configs"]["sm_90"]["BLOCK_N"] = 4096
    m[MANIFEST_NAME] = canonical_json(doc)
    write_archive(tmp_path / "u.kpack", m)
    with pytest.raises(SignatureError, match="does not match the manifest"):
        verify_path(tmp_path / "u.kpack", keys.trusted)


@pytest.mark.parametrize("name", ["../evil.py", "/etc/evil.py", "kernels/../../evil.py", "kernels//x.py",
                                  "./kernels/x.py", "C:\\evil.py"])
def test_path_traversal_is_refused(name: str, tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)

    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))

    raw_tar(tmp_path / "t.kpack", m, add)
    with pytest.raises(UnsafeMemberError, match="archive member"):
        verify_path(tmp_path / "t.kpack", keys.trusted)


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE,
                                  tarfile.DIRTYPE])
def test_links_devices_and_directories_are_refused(kind: bytes, tiny_bundle: BuildResult, keys: Keys,
                                                   tmp_path: Path) -> None:
    m = members_of(tiny_bundle)

    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("kernels/extra.py")
        info.type = kind
        info.linkname = "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        tar.addfile(info)

    raw_tar(tmp_path / "t.kpack", m, add)
    with pytest.raises(UnsafeMemberError, match=r"kernels/extra.py"):
        verify_path(tmp_path / "t.kpack", keys.trusted)


def test_size_limits(tiny_bundle: BuildResult, keys: Keys) -> None:
    biggest = max(tiny_bundle.manifest.files.items(), key=lambda kv: kv[1].size)
    with pytest.raises(SizeLimitError, match=f"archive member '{biggest[0]}'"):
        verify_path(tiny_bundle.path, keys.trusted, limits=Limits(max_member_bytes=biggest[1].size - 1))
    total = sum(f.size for f in tiny_bundle.manifest.files.values())
    with pytest.raises(SizeLimitError, match="total limit"):
        verify_path(tiny_bundle.path, keys.trusted, limits=Limits(max_total_bytes=total // 2))
    with pytest.raises(SizeLimitError, match="over the limit"):
        verify_path(tiny_bundle.path, keys.trusted, limits=Limits(max_archive_bytes=100))
    assert verify_path(tiny_bundle.path, keys.trusted, limits=Limits(max_member_bytes=biggest[1].size))


def test_extra_and_missing_members(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    m["kernels/sneaky.py"] = b"import os\n"
    write_archive(tmp_path / "a.kpack", m)
    with pytest.raises(ExtraMemberError, match=r"kernels/sneaky.py"):
        verify_path(tmp_path / "a.kpack", keys.trusted)
    m = members_of(tiny_bundle)
    gone = tiny_bundle.manifest.artifacts[-1].ptx
    del m[gone]
    write_archive(tmp_path / "b.kpack", m)
    with pytest.raises(MissingMemberError, match=gone):
        verify_path(tmp_path / "b.kpack", keys.trusted)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version="banana"), "not a semantic version"),
        (lambda d: d.update(unexpected=True), "Extra inputs"),
        (lambda d: d["files"].update({"../x": d["files"][next(iter(d["files"]))]}), "safe bundle member"),
        (lambda d: d["artifacts"][0].update(cubin="artifacts/not-listed.cubin"), "not listed in files"),
    ],
)
def test_signed_manifest_failing_schema(mutate, message: str, tiny_bundle: BuildResult, keys: Keys,
                                        tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    doc = json.loads(m[MANIFEST_NAME])
    mutate(doc)
    resign(m, keys, doc)
    write_archive(tmp_path / "t.kpack", m)
    with pytest.raises(ManifestError, match=message):
        verify_path(tmp_path / "t.kpack", keys.trusted)


def test_non_canonical_manifest_is_refused(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    m = members_of(tiny_bundle)
    resign(m, keys, json.dumps(json.loads(m[MANIFEST_NAME]), indent=2).encode())
    write_archive(tmp_path / "t.kpack", m)
    with pytest.raises(ManifestError, match="canonical"):
        verify_path(tmp_path / "t.kpack", keys.trusted)


def test_not_an_archive(keys: Keys, tmp_path: Path) -> None:
    (tmp_path / "t.kpack").write_bytes(b"PK\x03\x04 not a tarball")
    with pytest.raises(ArchiveFormatError, match=r"not a valid .kpack"):
        verify_path(tmp_path / "t.kpack", keys.trusted)
    with pytest.raises(BundleNotFoundError, match="cannot read bundle"):
        verify_path(tmp_path / "missing.kpack", keys.trusted)


def test_extracted_directory(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path) -> None:
    root = tmp_path / "x"
    for name, data in members_of(tiny_bundle).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    assert verify_path(root, keys.trusted, digest=tiny_bundle.digest).digest == tiny_bundle.digest
    (root / "kernels" / "link.py").symlink_to(root / "kernels" / "bias_gelu.py")
    with pytest.raises(UnsafeMemberError, match="symlink"):
        verify_path(root, keys.trusted)
    (root / "kernels" / "link.py").unlink()
    (root / "kernels" / "__pycache__").mkdir()
    (root / "kernels" / "__pycache__" / "bias_gelu.cpython-311.pyc").write_bytes(b"\x00evil")
    with pytest.raises(ExtraMemberError, match="__pycache__"):
        verify_path(root, keys.trusted)


def test_decompression_stops_at_the_stream_cap() -> None:
    """A header tarfile reads whole (a pax extended header) cannot make the reader inflate past the cap."""
    import gzip

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.pax_headers = {"comment": "x" * (8 * 1024 * 1024)}  # 8 MiB of header, a few KB compressed
        tar.addfile(info, io.BytesIO(b""))
    blob = gzip.compress(raw.getvalue(), compresslevel=9)
    assert len(blob) < 64 * 1024
    limits = Limits(max_total_bytes=1024 * 1024, max_members=10)  # stream cap: 2 MiB and a little
    with pytest.raises(SizeLimitError, match="decompresses to more than"):
        read_archive(blob, limits)
    assert read_archive(blob)  # the default limits let that header through (it is under their cap)

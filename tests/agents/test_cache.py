"""The bundle cache: verified before staging, tampered or untrusted bundles refused and deleted, publish."""

from __future__ import annotations

import hashlib
import shutil
import stat
from pathlib import Path

import pytest

from agents.cache import BundleCache, BundleRefused
from kernelctl.wire import BundleRef
from kernelpack.archive import read_archive, write_archive
from kernelpack.runtime import read_active
from kernelpack.signing import generate_keypair
from tests.agents.bundles import BuiltBundles


def ref_of(b: BuiltBundles, v: str, digest: str | None = None) -> BundleRef:
    return BundleRef(name="llm-fused", version=v, digest=digest or b.digests[v])


def download(b: BuiltBundles, v: str, cache: BundleCache, data: bytes | None = None) -> Path:
    p = cache.downloads / f".dl-{v}"
    p.write_bytes(b.paths[v].read_bytes() if data is None else data)
    return p


def test_install_verified_bundle(bundles: BuiltBundles, tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    path = cache.install(download(bundles, "1.0.0", cache), ref_of(bundles, "1.0.0"))
    assert path == cache.path_of(bundles.digests["1.0.0"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == bundles.digests["1.0.0"]
    assert not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    assert cache.has(ref_of(bundles, "1.0.0"))
    assert cache.reverify(ref_of(bundles, "1.0.0")) == path


def test_flipped_byte_is_refused_and_deleted(bundles: BuiltBundles, tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    data = bytearray(bundles.paths["1.1.0"].read_bytes())
    data[len(data) // 2] ^= 0xFF
    dl = download(bundles, "1.1.0", cache, bytes(data))
    with pytest.raises(BundleRefused, match="refused"):
        cache.install(dl, ref_of(bundles, "1.1.0"))
    assert not dl.exists()
    assert cache.digests() == set()


def test_modified_kernel_with_matching_outer_digest_is_refused(bundles: BuiltBundles, tmp_path: Path) -> None:
    """An attacker who also controls the advertised digest still cannot change a signed member."""
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    members = read_archive(bundles.paths["1.1.0"].read_bytes())
    members["kernels/add_rmsnorm.py"] += b"\nimport os  # injected\n"
    evil = tmp_path / "evil.kpack"
    blob = write_archive(evil, members)
    digest = hashlib.sha256(blob).hexdigest()
    dl = download(bundles, "1.1.0", cache, blob)
    with pytest.raises(BundleRefused, match=r"kernels/add_rmsnorm\.py does not match its manifest digest"):
        cache.install(dl, ref_of(bundles, "1.1.0", digest))
    assert not dl.exists() and cache.digests() == set()


def test_untrusted_signer_is_refused(bundles: BuiltBundles, tmp_path: Path) -> None:
    other = tmp_path / "other"
    kp = generate_keypair(tmp_path / "otherkeys")
    other.mkdir()
    shutil.copy(kp.public_path, other / kp.public_path.name)
    cache = BundleCache(tmp_path / "c", other)
    dl = download(bundles, "1.0.0", cache)
    with pytest.raises(BundleRefused, match="not in the trusted keys"):
        cache.install(dl, ref_of(bundles, "1.0.0"))
    assert not dl.exists()


def test_wrong_name_or_version_is_refused(bundles: BuiltBundles, tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    dl = download(bundles, "1.0.0", cache)
    with pytest.raises(BundleRefused, match=r"holds llm-fused@1\.0\.0, not llm-fused@1\.1\.0"):
        cache.install(dl, BundleRef(name="llm-fused", version="1.1.0", digest=bundles.digests["1.0.0"]))


def test_cached_copy_changed_on_disk_is_refused(bundles: BuiltBundles, tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    ref = ref_of(bundles, "1.0.0")
    path = cache.install(download(bundles, "1.0.0", cache), ref)
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BundleRefused, match="no longer verifies"):
        cache.reverify(ref)
    assert not path.exists()


def test_publish_switch_and_gc(bundles: BuiltBundles, tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "c", bundles.trusted_dir)
    stable, cand = ref_of(bundles, "1.0.0"), ref_of(bundles, "1.1.0")
    for v, r in (("1.0.0", stable), ("1.1.0", cand)):
        cache.install(download(bundles, v, cache), r)
    rt = tmp_path / "runtime"
    cache.publish(rt, {"llm-fused": cand}, {"llm-fused": stable})
    doc = read_active(rt)["llm-fused"]
    assert (doc.version, doc.digest, doc.path) == ("1.1.0", cand.digest, str(cache.path_of(cand.digest)))
    assert doc.stable is not None and doc.stable.version == "1.0.0"
    cache.publish(rt, {"llm-fused": stable}, {"llm-fused": stable})  # rollback: a switch, no download
    assert read_active(rt)["llm-fused"].version == "1.0.0"
    from kernelpack.loader import load_bundle

    for r in (stable, cand):  # what a trial leaves behind: read-only extractions per digest
        load_bundle(cache.path_of(r.digest), bundles.trusted_dir, arch="sm_90", cache_dir=cache.loader_dir)
    assert (cache.loader_dir / "bundles" / cand.digest).is_dir()
    assert cache.gc({stable.digest}) == [cand.digest]
    assert cache.digests() == {stable.digest}
    assert not (cache.loader_dir / "bundles" / cand.digest).exists()
    assert (cache.loader_dir / "bundles" / stable.digest).is_dir()

"""Bundle verification: everything that must hold before any code from a bundle is imported.

Order: the container is read with header checks (paths, links, devices, sizes: ``kernelpack.archive``);
``signature.json`` must sign the exact ``manifest.json`` bytes with a trusted key; the manifest must pass the
schema; the archive must hold exactly the files the manifest lists, each with the listed size and sha256.
The bundle digest is sha256 of the .kpack bytes (what the controller stores).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kernelpack.archive import DEFAULT_LIMITS, Limits, read_archive, read_directory
from kernelpack.errors import (
    BundleNotFoundError,
    DigestMismatchError,
    ExtraMemberError,
    MissingMemberError,
    SignatureError,
    SizeLimitError,
)
from kernelpack.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest
from kernelpack.signing import load_trusted_keys, parse_signature, verify_signature

TrustedKeys = Path | dict[str, Ed25519PublicKey]


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose every byte has been checked; ``members`` are the verified contents."""

    manifest: Manifest
    manifest_bytes: bytes
    key_id: str
    digest: str
    members: dict[str, bytes]

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _trusted(keys: TrustedKeys) -> dict[str, Ed25519PublicKey]:
    return keys if isinstance(keys, dict) else load_trusted_keys(Path(keys))


def verify_members(members: dict[str, bytes], trusted_keys: TrustedKeys, digest: str) -> VerifiedBundle:
    """Verify already-read archive members (signature, schema, file list, digests)."""
    if MANIFEST_NAME not in members:
        raise MissingMemberError(f"bundle has no {MANIFEST_NAME}")
    if SIGNATURE_NAME not in members:
        raise SignatureError(f"bundle is not signed: {SIGNATURE_NAME} is missing")
    manifest_bytes = members[MANIFEST_NAME]
    doc = parse_signature(members[SIGNATURE_NAME])
    key_id = verify_signature(manifest_bytes, doc, _trusted(trusted_keys))
    manifest = parse_manifest(manifest_bytes)
    listed = set(manifest.files)
    present = set(members) - {MANIFEST_NAME, SIGNATURE_NAME}
    for name in sorted(listed - present):
        raise MissingMemberError(f"file {name} listed in the manifest is missing from the bundle")
    for name in sorted(present - listed):
        raise ExtraMemberError(f"file {name} is in the bundle but not listed in the manifest")
    for name in sorted(listed):
        entry, data = manifest.files[name], members[name]
        if len(data) != entry.size or sha256_hex(data) != entry.sha256:
            raise DigestMismatchError(
                f"file {name} does not match its manifest digest (tampered or corrupted): "
                f"expected sha256 {entry.sha256[:16]}…, got {sha256_hex(data)[:16]}…"
            )
    return VerifiedBundle(manifest, manifest_bytes, key_id, digest, members)


def verify_bytes(blob: bytes, trusted_keys: TrustedKeys, limits: Limits = DEFAULT_LIMITS) -> VerifiedBundle:
    return verify_members(read_archive(blob, limits), trusted_keys, sha256_hex(blob))


def verify_path(
    path: Path,
    trusted_keys: TrustedKeys,
    *,
    limits: Limits = DEFAULT_LIMITS,
    digest: str | None = None,
) -> VerifiedBundle:
    """Verify a .kpack file or an extracted bundle directory.

    For a file the digest is computed (and must equal ``digest`` when given). For a directory the digest is
    ``digest`` if given, else the directory name when it is a sha256 (content-addressed extraction), else the
    sha256 of manifest.json.
    """
    path = Path(path)
    trusted_keys = _trusted(trusted_keys)  # a missing trusted-keys dir is reported before the bundle
    if path.is_dir():
        members = read_directory(path, limits)
        if digest is None:
            name = path.name
            is_hex = len(name) == 64 and all(c in "0123456789abcdef" for c in name)
            digest = name if is_hex else sha256_hex(members.get(MANIFEST_NAME, b""))
        return verify_members(members, trusted_keys, digest)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise BundleNotFoundError(f"cannot read bundle {path}: {exc.strerror}") from exc
    if size > limits.max_archive_bytes:
        raise SizeLimitError(f"{path} is {size} bytes, over the limit of {limits.max_archive_bytes}")
    blob = path.read_bytes()
    bundle = verify_bytes(blob, trusted_keys, limits)
    if digest is not None and digest != bundle.digest:
        raise DigestMismatchError(f"{path} has digest {bundle.digest}, expected {digest}")
    return bundle

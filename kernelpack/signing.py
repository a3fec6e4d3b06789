"""Ed25519 keys and signatures for bundle manifests.

A key id is the first 16 hex digits of sha256(raw 32-byte public key). ``generate_keypair`` writes
``<key_id>.key`` (PKCS8 PEM, mode 0600) and ``<key_id>.pub`` (SubjectPublicKeyInfo PEM). A trusted-keys
directory is a directory of ``*.pub`` files; each is trusted under the key id computed from its content (the
file name is not trusted). A signature document (``signature.json`` in the archive) names the key id and holds
the base64 signature over the canonical manifest bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelpack.errors import KeyFileError, SignatureError, UntrustedKeyError

ALGORITHM = "ed25519"


class SignatureDoc(BaseModel):
    """The content of signature.json."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    algorithm: str = Field(pattern="^ed25519$")
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    signature: str = Field(min_length=1, max_length=200)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class KeyPair:
    key_id: str
    private_path: Path
    public_path: Path


def key_id_of(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(directory: Path) -> KeyPair:
    """Create a new ed25519 key pair in ``directory`` (created if missing); never overwrites a file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    kid = key_id_of(private.public_key())
    priv_path, pub_path = directory / f"{kid}.key", directory / f"{kid}.pub"
    priv_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise KeyFileError(f"{priv_path} already exists; refusing to overwrite a key") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(priv_pem)
    os.chmod(priv_path, 0o600)
    pub_path.write_bytes(pub_pem)
    return KeyPair(kid, priv_path, pub_path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read private key {path}: {exc.strerror}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} is not an ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise KeyFileError(f"cannot read public key {path}: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not a PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} is not an ed25519 public key")
    return key


def load_trusted_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """All ``*.pub`` keys in ``directory`` by key id (computed from the key, not the file name)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"trusted-keys directory {directory} does not exist")
    keys: dict[str, Ed25519PublicKey] = {}
    for p in sorted(directory.glob("*.pub")):
        key = load_public_key(p)
        keys[key_id_of(key)] = key
    return keys


def sign(data: bytes, private_key: Ed25519PrivateKey) -> SignatureDoc:
    sig = private_key.sign(data)
    return SignatureDoc(
        algorithm=ALGORITHM,
        key_id=key_id_of(private_key.public_key()),
        signature=base64.b64encode(sig).decode("ascii"),
    )


def parse_signature(data: bytes) -> SignatureDoc:
    try:
        return SignatureDoc.model_validate_json(data)
    except ValidationError as exc:
        raise SignatureError(f"signature.json is malformed: {exc.errors()[0]['msg']}") from exc


def verify_signature(data: bytes, doc: SignatureDoc, trusted: dict[str, Ed25519PublicKey]) -> str:
    """Check ``doc`` signs ``data`` with a trusted key; return the key id. Raises SignatureError."""
    key = trusted.get(doc.key_id)
    if key is None:
        raise UntrustedKeyError(f"bundle is signed by key {doc.key_id}, which is not in the trusted keys")
    try:
        raw = base64.b64decode(doc.signature, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureError("signature is not valid base64") from exc
    try:
        key.verify(raw, data)
    except InvalidSignature as exc:
        raise SignatureError(
            f"signature by key {doc.key_id} does not match the manifest (content changed after signing)"
        ) from exc
    return doc.key_id

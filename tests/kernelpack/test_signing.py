"""Ed25519 key generation, signing and verification against a trusted-keys directory."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key

from kernelpack.errors import KeyFileError, SignatureError, UntrustedKeyError
from kernelpack.signing import (
    SignatureDoc,
    generate_keypair,
    key_id_of,
    load_private_key,
    load_trusted_keys,
    parse_signature,
    sign,
    verify_signature,
)


def test_generate_writes_private_0600_and_public_named_by_key_id(tmp_path: Path) -> None:
    kp = generate_keypair(tmp_path / "k")
    assert stat.S_IMODE(kp.private_path.stat().st_mode) == 0o600
    assert kp.private_path.name == f"{kp.key_id}.key" and kp.public_path.name == f"{kp.key_id}.pub"
    priv = load_private_key(kp.private_path)
    raw = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert kp.key_id == hashlib.sha256(raw).hexdigest()[:16]
    assert b"PRIVATE KEY" in kp.private_path.read_bytes() and b"PUBLIC KEY" in kp.public_path.read_bytes()


def test_sign_and_verify(tmp_path: Path) -> None:
    kp = generate_keypair(tmp_path)
    trusted = load_trusted_keys(tmp_path)
    doc = sign(b"manifest bytes", load_private_key(kp.private_path))
    assert parse_signature(doc.to_bytes()) == doc
    assert verify_signature(b"manifest bytes", doc, trusted) == kp.key_id
    with pytest.raises(SignatureError, match="does not match the manifest"):
        verify_signature(b"manifest bytes!", doc, trusted)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    kp = generate_keypair(tmp_path / "a")
    generate_keypair(tmp_path / "b")
    doc = sign(b"x", load_private_key(kp.private_path))
    with pytest.raises(UntrustedKeyError, match=kp.key_id):
        verify_signature(b"x", doc, load_trusted_keys(tmp_path / "b"))


def test_trust_follows_key_content_not_file_name(tmp_path: Path) -> None:
    a = generate_keypair(tmp_path / "a")
    b = generate_keypair(tmp_path / "b")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    # b's public key saved under a's id: a's signatures must still not verify
    (trusted / f"{a.key_id}.pub").write_bytes(b.public_path.read_bytes())
    doc = sign(b"x", load_private_key(a.private_path))
    with pytest.raises(UntrustedKeyError):
        verify_signature(b"x", doc, load_trusted_keys(trusted))
    assert set(load_trusted_keys(trusted)) == {b.key_id}


def test_forged_key_id_in_signature_fails(tmp_path: Path) -> None:
    a = generate_keypair(tmp_path / "a")
    mallory = Ed25519PrivateKey.generate()
    real = sign(b"x", mallory)
    forged = SignatureDoc(algorithm="ed25519", key_id=a.key_id, signature=real.signature)
    with pytest.raises(SignatureError, match="does not match"):
        verify_signature(b"x", forged, load_trusted_keys(tmp_path / "a"))
    assert key_id_of(mallory.public_key()) != a.key_id


def test_malformed_signature_documents(tmp_path: Path) -> None:
    with pytest.raises(SignatureError, match="malformed"):
        parse_signature(b"not json")
    with pytest.raises(SignatureError, match="malformed"):
        parse_signature(b'{"algorithm":"rsa","key_id":"0123456789abcdef","signature":"AA=="}')
    kp = generate_keypair(tmp_path)
    doc = SignatureDoc(algorithm="ed25519", key_id=kp.key_id, signature="***")
    with pytest.raises(SignatureError, match="base64"):
        verify_signature(b"x", doc, load_trusted_keys(tmp_path))


def test_key_file_errors(tmp_path: Path) -> None:
    kp = generate_keypair(tmp_path)
    with pytest.raises(KeyFileError, match="does not exist"):
        load_trusted_keys(tmp_path / "missing")
    with pytest.raises(KeyFileError, match="cannot read private key"):
        load_private_key(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_text("hello")
    with pytest.raises(KeyFileError, match="not an unencrypted PEM private key"):
        load_private_key(tmp_path / "junk.key")
    rsa = generate_private_key(public_exponent=65537, key_size=1024)
    (tmp_path / "rsa.pub").write_bytes(rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(KeyFileError, match="not an ed25519 public key"):
        load_trusted_keys(tmp_path)
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        (tmp_path / "rsa.pub").write_text("garbage")
        load_trusted_keys(tmp_path)
    assert kp.private_path.exists()

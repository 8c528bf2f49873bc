"""Ed25519 signatures over an artifacts directory, for trusting artifacts built on another host.

The manifest records the sha256 of every other file (graphs, weights, tokenizer), so one
signature over the manifest's bytes covers the whole directory. `graphc compile --sign-key K`
writes it to `manifest.sig`; `graphc run --trusted-key P` verifies it against the public key
before it parses the manifest or opens any other file, and refuses unsigned or forged
directories. Import-light (no torch): the runtime uses it.
"""

from __future__ import annotations

import os
from pathlib import Path

from graphc.errors import GraphcError

SIGNATURE = "manifest.sig"


class SignatureError(GraphcError):
    """A key that cannot be used, or artifacts whose signature does not verify."""


def generate_key(private_path: Path) -> Path:
    """Write a new Ed25519 private key (PEM, mode 0600) to `private_path` and its public key to
    `private_path` + '.pub'; returns the public key's path. Never overwrites either."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise SignatureError(f"{path} already exists; keys are never overwritten")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as f:
            f.write(private)
        public_path.write_bytes(public)
    except OSError as e:
        private_path.unlink(missing_ok=True)  # never half a pair
        raise SignatureError(f"{e.filename}: cannot write the key ({e.strerror})") from None
    return public_path


def private_key(path: Path):
    """The Ed25519 private key in the PEM file at `path` (checked before a compile starts)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(_read_key(path, "--sign-key"), password=None)
    except (ValueError, TypeError):  # not PEM, another algorithm's encoding, or encrypted
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"--sign-key {path}: not an unencrypted Ed25519 private key in PEM "
                             "(make one with `graphc keygen`)")
    # As OpenSSH refuses an unprotected key: whoever can read it can sign artifacts that every
    # serving host trusts, so a key others can read is no longer this host's alone.
    mode = Path(path).stat().st_mode & 0o777
    if mode & 0o077:
        raise SignatureError(f"--sign-key {path}: mode {mode:04o} lets others read the private key; make it the "
                             f"owner's alone (chmod 600 {path})")
    return key


def sign(manifest_bytes: bytes, key_path: Path) -> bytes:
    """The Ed25519 signature of the manifest's bytes."""
    return private_key(key_path).sign(manifest_bytes)


def verify(artifacts: Path, manifest_bytes: bytes, public_key: Path) -> None:
    """Raise SignatureError unless `artifacts`' signature is the trusted key's over these bytes."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    raw = _read_key(public_key, "--trusted-key")
    try:
        key = serialization.load_pem_public_key(raw)
    except ValueError:
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"--trusted-key {public_key}: not an Ed25519 public key in PEM "
                             "(the .pub file `graphc keygen` writes)")
    signature_path = artifacts / SIGNATURE
    if not signature_path.is_file():
        raise SignatureError(f"{artifacts}: not signed (no {SIGNATURE}), and --trusted-key requires a signature; "
                             "compile with --sign-key")
    try:
        key.verify(signature_path.read_bytes(), manifest_bytes)
    except InvalidSignature:
        raise SignatureError(f"{artifacts}: the signature does not match the manifest under the trusted key "
                             f"{public_key}: signed with another key, or modified since") from None


def _read_key(path: Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SignatureError(f"{option} {path}: cannot read it ({e.strerror})") from None


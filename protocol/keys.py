"""Ed25519 signing keys, key files and signatures over domain-separated canonical bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InternalError, InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from patchswarm.protocol.errors import FormatError, SignatureError, UntrustedKeyError
from patchswarm.protocol.files import read_file

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
MAX_KEY_FILE_BYTES = 1 << 16  # an Ed25519 PEM is ~120 bytes; anything this large is not a key file


@dataclass(frozen=True, slots=True)
class SigningKey:
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def key_id(self) -> bytes:
        """A key is named by its raw 32-byte public key."""
        return self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, domain: bytes, body: bytes) -> bytes:
        return self.private.sign(domain + body)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write KEY (PKCS#8 PEM, mode 0600) and KEY.pub (SubjectPublicKeyInfo PEM)."""
        path = Path(path)
        pem = self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
        pub = self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        Path(f"{path}.pub").write_bytes(pub)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        try:
            key = serialization.load_pem_private_key(read_file(path, MAX_KEY_FILE_BYTES), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # UnsupportedAlgorithm: an unknown OID
            raise FormatError(f"{path}: not an unencrypted PEM private key ({e})") from None
        except InternalError:  # a known OID with a key of the wrong size (X448's with 32 bytes)
            raise FormatError(f"{path}: not a valid private key (key setup failed)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise FormatError(f"{path}: not an Ed25519 private key")
        return cls(key)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """Raw 32-byte Ed25519 public key from a PEM file."""
    try:
        key = serialization.load_pem_public_key(read_file(path, MAX_KEY_FILE_BYTES))
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise FormatError(f"{path}: not a PEM public key ({e})") from None
    except InternalError:
        raise FormatError(f"{path}: not a valid public key (key setup failed)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise FormatError(f"{path}: not an Ed25519 public key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify_signature(key_id: bytes, domain: bytes, body: bytes, signature: bytes) -> None:
    if len(key_id) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        raise SignatureError("malformed key id or signature")
    try:
        Ed25519PublicKey.from_public_bytes(key_id).verify(signature, domain + body)
    except (InvalidSignature, ValueError):
        raise SignatureError("signature does not verify") from None


class KeyPolicy(Protocol):
    """Decides whether a key may sign for a run at a time; raises UntrustedKeyError if not."""

    def check(self, key_id: bytes, *, run_id: str, now_ms: int | None) -> None: ...


@dataclass(frozen=True, slots=True)
class TrustedKeys:
    """The simplest trust policy: a fixed set of public keys (the board adds certified keys)."""

    keys: frozenset[bytes]

    def check(self, key_id: bytes, *, run_id: str, now_ms: int | None) -> None:
        if key_id not in self.keys:
            raise UntrustedKeyError(f"signed by unknown key {key_id.hex()[:16]}…")

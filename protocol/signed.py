"""Signed envelopes: canonical body bytes, the signer's key and an Ed25519 signature.

Every signed document (manifests, heads, certificates, root documents) travels as the msgpack
array ``[tag, body, key_id, signature]``; the signature covers ``tag + "/v1\\0" + body``, so a
signature made for one kind of document can never be replayed as another kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from patchswarm.protocol.errors import FormatError, LimitExceededError, SignatureError
from patchswarm.protocol.keys import SigningKey, verify_signature

MAX_ENVELOPE_BYTES = (64 << 20) + 256


def domain(tag: str) -> bytes:
    return tag.encode() + b"/v1\x00"


@dataclass(frozen=True, slots=True)
class Envelope:
    tag: str
    body: bytes
    key_id: bytes
    signature: bytes

    @classmethod
    def sign(cls, tag: str, body: bytes, key: SigningKey | None) -> Envelope:
        if key is None:
            return cls(tag, body, b"", b"")
        return cls(tag, body, key.key_id, key.sign(domain(tag), body))

    @property
    def signed(self) -> bool:
        return bool(self.signature)

    def to_bytes(self) -> bytes:
        packed: bytes = msgpack.packb([self.tag, self.body, self.key_id, self.signature], use_bin_type=True)
        return packed

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, tag: str) -> Envelope:
        if len(data) > MAX_ENVELOPE_BYTES:
            raise LimitExceededError(f"{tag} envelope larger than allowed")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, use_list=True)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise FormatError(f"{tag} envelope is malformed ({type(e).__name__})") from None
        if not (isinstance(obj, list) and len(obj) == 4 and obj[0] == tag):
            raise FormatError(f"not a {tag} envelope")
        _, body, key_id, sig = obj
        if not all(isinstance(x, bytes) for x in (body, key_id, sig)):
            raise FormatError(f"{tag} envelope fields must be bytes")
        return cls(tag, body, key_id, sig)

    def check_signature(self) -> None:
        """The signature is valid for key_id (whether key_id is trusted is the caller's question)."""
        if not self.signed:
            raise SignatureError(f"{self.tag} is not signed")
        verify_signature(self.key_id, domain(self.tag), self.body, self.signature)

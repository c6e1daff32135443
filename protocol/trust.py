"""The trust root: an offline root key certifies trainer keys per run; revocation and root
rotation are versioned root documents (after TUF's root role).

- Root document ``patchswarm/root`` version N lists the root keys and the revoked trainer keys.
  Version 1 is signed by the pinned root key a host was installed with; version N+1 must be
  signed by a root key of version N, so a host walks the chain one version at a time and can
  never be rolled back (a lower or equal version is refused, a different document for the same
  version is equivocation).
- Certificate ``patchswarm/cert``: a root key says "this trainer key may sign for run R from
  T0 until T1".
- :class:`TrustState` is the resulting key policy: a key is trusted for a run iff a current
  root key certified it for that run, it is inside its validity window (give or take a bounded
  clock skew) and it is not revoked.

Pure: callers pass bytes and the time in; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from patchswarm.protocol.board_names import CERT_TAG, ROOT_TAG
from patchswarm.protocol.docfields import as_digest, as_list, as_map, as_str, as_uint
from patchswarm.protocol.docfields import field as get
from patchswarm.protocol.errors import (
    EquivocationError,
    ExpiredError,
    FormatError,
    RollbackError,
    UnsupportedFormatError,
    UntrustedKeyError,
)
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.signed import Envelope

FORMAT = 1
DEFAULT_SKEW_MS = 5 * 60 * 1000


def _pack(obj: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(dict(sorted(obj.items())), use_bin_type=True)
    return packed


def _unpack(body: bytes, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise FormatError(f"{what} is malformed ({type(e).__name__})") from None
    d = as_map(obj, what)
    if get(d, "format", what) != FORMAT:
        raise UnsupportedFormatError(f"{what} format {d['format']!r} (this build reads {FORMAT})")
    return d


@dataclass(frozen=True, slots=True)
class RootDocument:
    version: int
    keys: tuple[bytes, ...]
    revoked: tuple[bytes, ...] = ()

    def to_bytes(self) -> bytes:
        return _pack(
            {"format": FORMAT, "keys": list(self.keys), "revoked": list(self.revoked), "version": self.version}
        )

    @classmethod
    def from_bytes(cls, body: bytes) -> RootDocument:
        d = _unpack(body, "root document")
        doc = cls(
            version=as_uint(get(d, "version", "root"), "root version"),
            keys=tuple(as_digest(k, "root key") for k in as_list(get(d, "keys", "root"), "root keys")),
            revoked=tuple(as_digest(k, "revoked key") for k in as_list(get(d, "revoked", "root"), "revoked")),
        )
        if doc.to_bytes() != body:
            raise FormatError("root document is not canonical")
        if doc.version < 1 or not doc.keys:
            raise FormatError("root document needs version >= 1 and at least one key")
        return doc

    def sign(self, key: SigningKey) -> Envelope:
        return Envelope.sign(ROOT_TAG, self.to_bytes(), key)


@dataclass(frozen=True, slots=True)
class Certificate:
    key: bytes
    run_id: str
    not_before_ms: int
    not_after_ms: int

    def to_bytes(self) -> bytes:
        return _pack(
            {
                "format": FORMAT,
                "key": self.key,
                "not_after_ms": self.not_after_ms,
                "not_before_ms": self.not_before_ms,
                "run": self.run_id,
            }
        )

    @classmethod
    def from_bytes(cls, body: bytes) -> Certificate:
        d = _unpack(body, "certificate")
        cert = cls(
            key=as_digest(get(d, "key", "certificate"), "certified key"),
            run_id=as_str(get(d, "run", "certificate"), "certificate run"),
            not_before_ms=as_uint(get(d, "not_before_ms", "certificate"), "not_before_ms"),
            not_after_ms=as_uint(get(d, "not_after_ms", "certificate"), "not_after_ms"),
        )
        if cert.to_bytes() != body:
            raise FormatError("certificate is not canonical")
        if cert.not_after_ms < cert.not_before_ms:
            raise FormatError("certificate expires before it starts")
        return cert

    def sign(self, root_key: SigningKey) -> Envelope:
        return Envelope.sign(CERT_TAG, self.to_bytes(), root_key)


@dataclass(slots=True)
class TrustState:
    """What a host trusts now; also the KeyPolicy manifests and heads are checked against."""

    pinned_root: bytes
    root: RootDocument | None = None
    root_bodies: dict[int, bytes] = field(default_factory=dict)
    certificates: dict[bytes, list[tuple[Certificate, bytes]]] = field(default_factory=dict)  # key -> (cert, signer)
    skew_ms: int = DEFAULT_SKEW_MS

    @property
    def root_version(self) -> int:
        return self.root.version if self.root else 0

    @property
    def root_keys(self) -> tuple[bytes, ...]:
        return self.root.keys if self.root else (self.pinned_root,)

    def update_root(self, data: bytes) -> RootDocument:
        """Accept the next root document (version current+1) signed by a current root key."""
        env = Envelope.from_bytes(data, ROOT_TAG)
        env.check_signature()
        if env.key_id not in self.root_keys:
            raise UntrustedKeyError(f"root document signed by {env.key_id.hex()[:16]}…, not a current root key")
        doc = RootDocument.from_bytes(env.body)
        seen = self.root_bodies.get(doc.version)
        if seen is not None and seen != env.body:
            raise EquivocationError(f"root version {doc.version}", seen, env.body)
        if doc.version <= self.root_version:
            raise RollbackError(f"root version {doc.version} is not newer than trusted {self.root_version}")
        if doc.version != self.root_version + 1:
            raise FormatError(f"root version {doc.version} skips {self.root_version + 1}")
        self.root = doc
        self.root_bodies[doc.version] = env.body
        return doc

    def read_certificate(self, data: bytes) -> tuple[Certificate, bytes]:
        """A certificate and its signer, checked (signature, signed by a current root key), not added."""
        env = Envelope.from_bytes(data, CERT_TAG)
        env.check_signature()
        if env.key_id not in self.root_keys:
            raise UntrustedKeyError(f"certificate signed by {env.key_id.hex()[:16]}…, not a root key")
        return Certificate.from_bytes(env.body), env.key_id

    def add_certificate(self, data: bytes) -> Certificate:
        cert, signer = self.read_certificate(data)
        certs = self.certificates.setdefault(cert.key, [])
        if (cert, signer) not in certs:
            certs.append((cert, signer))
        return cert

    def check(self, key_id: bytes, *, run_id: str, now_ms: int | None) -> None:
        """KeyPolicy: raise unless key_id is certified for run_id, unexpired and unrevoked."""
        if self.root and key_id in self.root.revoked:
            raise UntrustedKeyError(f"key {key_id.hex()[:16]}… is revoked (root version {self.root.version})")
        # A certificate counts only while its signer is a current root key (rotation retires old ones).
        certs = [
            c for c, signer in self.certificates.get(key_id, []) if c.run_id == run_id and signer in self.root_keys
        ]
        if not certs:
            raise UntrustedKeyError(f"key {key_id.hex()[:16]}… is not certified for run {run_id!r}")
        if now_ms is None:
            return
        if not any(c.not_before_ms - self.skew_ms <= now_ms <= c.not_after_ms + self.skew_ms for c in certs):
            raise ExpiredError(f"certificate of key {key_id.hex()[:16]}… for run {run_id!r} is not valid now")

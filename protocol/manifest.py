"""Version manifests: canonical msgpack bytes, Ed25519-signed, verified before any field is trusted.

A manifest describes one published version exactly: which run and version it is, whether it
is a patch (with its base) or a full anchor, what a host must be able to do to take it (``needs``:
its payload format), the target's layout and per-tensor digests, and the size and hash of every
chunk of its payload.  See docs/format.md for the byte layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import blake3
import msgpack

from patchswarm.protocol.board_names import MANIFEST_TAG
from patchswarm.protocol.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, ChunkRef
from patchswarm.protocol.docfields import as_digest, as_list, as_map, as_str, as_uint, is_uint
from patchswarm.protocol.dtypes import BY_NAME
from patchswarm.protocol.errors import (
    ExpiredError,
    FormatError,
    LimitExceededError,
    UnsupportedFormatError,
)
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.served import TensorSpec, layout_hash, state_root
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.streams import MAX_EXPANSION

# Manifest format 2 is format 1 plus ``needs``, written exactly when ``needs`` is not empty: builds
# before it refuse such a manifest with one line ("manifest format 2 (this build reads 1)"), having
# fetched nothing of the version, and every manifest that needs nothing stays byte-identical to format 1.
FORMAT_VERSION = 2  # the newest this build reads
MANIFEST_FORMATS = (1, 2)
MAX_MANIFEST_BYTES = 64 << 20
MAX_NUMEL = 1 << 48
MAX_NAME = 1024
MAX_RANK = 16
# ``needs``: what a host must bring to take a version.  Each entry is absent at its default (a
# format-1 manifest has no ``needs``: payload format 1, nothing else), so there is one spelling per
# manifest.  A key this build does not know is kept (it is signed) and makes the version unreadable
# here (``unmet_need``): a later need, say a history of earlier patches, sends a host of this build
# around the version instead of failing its manifest.
NEED_PAYLOAD_FORMAT = "payload_format"
MAX_NEEDS = 16
MAX_NEED_NAME = 64


class Kind(StrEnum):
    PATCH = "patch"
    ANCHOR = "anchor"


@dataclass(frozen=True, slots=True)
class Manifest:
    run_id: str
    version: int
    kind: Kind
    base_version: int | None
    base_root: bytes | None
    specs: tuple[TensorSpec, ...]
    digests: tuple[bytes, ...]
    target_root: bytes
    layout_hash: bytes
    payload_size: int
    raw_size: int
    chunk_size: int
    chunks: tuple[ChunkRef, ...]
    created_ms: int
    expires_ms: int
    prev_manifest: bytes | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    needs: dict[str, int] = field(default_factory=dict)

    @property
    def payload_format(self) -> int:
        """The payload format the payload declares (docs/format.md section 2a); 1 when ``needs`` omits it."""
        return self.needs.get(NEED_PAYLOAD_FORMAT, 1)

    def unmet_need(self, payload_formats: tuple[int, ...]) -> str | None:
        """Why a host reading ``payload_formats`` cannot take this version (one line), or None if it can."""
        unknown = sorted(k for k in self.needs if k != NEED_PAYLOAD_FORMAT)
        if unknown:
            return f"version {self.version} needs {unknown[0]!r}, which this build does not know"
        if self.payload_format not in payload_formats:
            have = ", ".join(map(str, payload_formats))
            return f"version {self.version}: patch payload format {self.payload_format} (this build reads {have})"
        return None

    # ------------------------------------------------------------ canonical bytes

    def to_bytes(self) -> bytes:
        base = None if self.base_version is None else {"root": self.base_root, "version": self.base_version}
        body: dict[str, Any] = {
            "base": base,
            "created_ms": self.created_ms,
            "expires_ms": self.expires_ms,
            "format": 2 if self.needs else 1,
            "kind": str(self.kind),
            "payload": {
                "chunk_size": self.chunk_size,
                "chunks": [c.to_wire() for c in self.chunks],
                "raw_size": self.raw_size,
                "size": self.payload_size,
            },
            "prev": self.prev_manifest,
            "run": self.run_id,
            "target": {
                "layout": self.layout_hash,
                "metadata": dict(sorted(self.metadata.items())),
                "root": self.target_root,
                "tensors": [[*s.to_wire(), d] for s, d in zip(self.specs, self.digests, strict=True)],
            },
            "version": self.version,
        }
        if self.needs:  # (absent when empty: a manifest that needs nothing is format 1, as before needs)
            body["needs"] = dict(sorted(self.needs.items()))
            body = dict(sorted(body.items()))
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    @property
    def manifest_id(self) -> bytes:
        """BLAKE3 of the canonical body: what a head or a next manifest points at."""
        return blake3.blake3(self.to_bytes()).digest()

    @classmethod
    def from_bytes(cls, body: bytes) -> Manifest:
        if len(body) > MAX_MANIFEST_BYTES:
            raise LimitExceededError("manifest larger than allowed")
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
            m = cls._from_obj(obj)
        except FormatError:
            raise
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise FormatError(f"manifest is malformed ({type(e).__name__}: {e})") from None
        if m.to_bytes() != body:
            raise FormatError("manifest bytes are not canonical")
        m.check()
        return m

    @classmethod
    def _from_obj(cls, obj: Any) -> Manifest:
        d = as_map(obj, "manifest")
        fmt = d["format"]
        if fmt not in MANIFEST_FORMATS or type(fmt) is not int:
            have = ", ".join(map(str, MANIFEST_FORMATS))
            raise UnsupportedFormatError(f"manifest format {fmt!r} (this build reads {have})")
        base = d["base"]
        if base is not None:
            base = as_map(base, "base")
        target = as_map(d["target"], "target")
        payload = as_map(d["payload"], "payload")
        specs: list[TensorSpec] = []
        digests: list[bytes] = []
        for t in as_list(target["tensors"], "tensors"):
            if not (isinstance(t, list) and len(t) == 4):
                raise FormatError("tensor entry must be [name, dtype, shape, digest]")
            name, dt, shape, digest = t
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
                raise FormatError("tensor name must be a non-empty string")
            if dt not in BY_NAME:
                raise FormatError(f"{name}: unknown dtype {dt!r}")
            shape_l = as_list(shape, f"{name} shape")
            if len(shape_l) > MAX_RANK or not all(is_uint(x) for x in shape_l):
                raise FormatError(f"{name}: shape must be at most {MAX_RANK} non-negative ints")
            specs.append(TensorSpec(name, dt, tuple(shape_l)))
            digests.append(as_digest(digest, f"{name} digest"))
        metadata = as_map(target["metadata"], "metadata")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise FormatError("metadata must map strings to strings")
        needs = as_map(d["needs"], "needs") if fmt >= 2 else {}
        if fmt >= 2 and not needs:
            raise FormatError("manifest format 2 lists no needs (a manifest that needs nothing is format 1)")
        if len(needs) > MAX_NEEDS:
            raise LimitExceededError(f"manifest lists {len(needs)} needs (at most {MAX_NEEDS})")
        for k, v in needs.items():
            if not (isinstance(k, str) and 0 < len(k) <= MAX_NEED_NAME and is_uint(v)):
                raise FormatError(f"needs must map names of 1 to {MAX_NEED_NAME} characters to non-negative ints")
        chunks = []
        for c in as_list(payload["chunks"], "chunks"):
            if not (isinstance(c, list) and len(c) == 2 and is_uint(c[0])):
                raise FormatError("chunk entry must be [size, hash]")
            chunks.append(ChunkRef(c[0], as_digest(c[1], "chunk hash")))
        return cls(
            run_id=as_str(d["run"], "run"),
            version=as_uint(d["version"], "version"),
            kind=Kind(d["kind"]),
            base_version=None if base is None else as_uint(base["version"], "base version"),
            base_root=None if base is None else as_digest(base["root"], "base root"),
            specs=tuple(specs),
            digests=tuple(digests),
            target_root=as_digest(target["root"], "target root"),
            layout_hash=as_digest(target["layout"], "layout hash"),
            payload_size=as_uint(payload["size"], "payload size"),
            raw_size=as_uint(payload["raw_size"], "raw size"),
            chunk_size=as_uint(payload["chunk_size"], "chunk size"),
            chunks=tuple(chunks),
            created_ms=as_uint(d["created_ms"], "created_ms"),
            expires_ms=as_uint(d["expires_ms"], "expires_ms"),
            prev_manifest=None if d["prev"] is None else as_digest(d["prev"], "prev"),
            metadata=dict(metadata),
            needs=dict(needs),
        )

    # ------------------------------------------------------------ consistency

    def check(self) -> None:
        """Internal consistency of every field; raises FormatError naming the first problem."""
        names = [s.name for s in self.specs]
        if names != sorted(names) or len(set(names)) != len(names):
            raise FormatError("tensors must be unique and sorted by name")
        if any(s.numel > MAX_NUMEL for s in self.specs):
            raise LimitExceededError("a tensor is larger than allowed")
        if layout_hash(list(self.specs)) != self.layout_hash:
            raise FormatError("layout hash does not match the tensor list")
        if state_root(list(self.specs), list(self.digests)) != self.target_root:
            raise FormatError("target root does not match the tensor digests")
        if self.kind == Kind.ANCHOR and self.base_version is not None:
            raise FormatError("an anchor has no base")
        if self.kind == Kind.PATCH and (self.base_version is None or self.base_version >= self.version):
            raise FormatError("a patch needs a base version older than its own version")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise FormatError(f"chunk size {self.chunk_size} out of range")
        if sum(c.size for c in self.chunks) != self.payload_size:
            raise FormatError("chunk sizes do not add up to the payload size")
        for i, c in enumerate(self.chunks):
            last = i == len(self.chunks) - 1
            if c.size == 0 or c.size > self.chunk_size or (not last and c.size != self.chunk_size):
                raise FormatError(f"chunk {i} has size {c.size}; every chunk but the last must be {self.chunk_size}")
        if self.raw_size > self.raw_bound():
            raise LimitExceededError(f"raw size {self.raw_size} exceeds what the layout allows")
        if self.kind == Kind.ANCHOR and self.nbytes > MAX_EXPANSION * self.payload_size:
            # An anchor's payload holds every byte of its tensors, compressed: a layout this much
            # larger than its payload is a lie that would make a reader allocate it for nothing.
            raise LimitExceededError(f"an anchor of {self.nbytes} bytes cannot fit a {self.payload_size}-byte payload")
        if self.expires_ms < self.created_ms:
            raise FormatError("manifest expires before it was created")
        if NEED_PAYLOAD_FORMAT in self.needs and self.payload_format < 2:
            # (1 is the default, spelled by leaving it out: one manifest, one byte string)
            raise FormatError(f"needs payload_format {self.payload_format}: only formats above 1 are written")

    def raw_bound(self) -> int:
        """Upper bound of decoded stream bytes for this layout (see patch_format.raw_bound)."""
        if self.kind == Kind.ANCHOR:
            return sum(s.nbytes for s in self.specs)
        return sum(s.numel * max(s.dt.width, 11 + s.dt.width) for s in self.specs)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


# ---------------------------------------------------------------- signed envelope


@dataclass(frozen=True, slots=True)
class SignedManifest:
    """Canonical manifest bytes with the signer's public key and signature (both empty if unsigned)."""

    envelope: Envelope

    @property
    def body(self) -> bytes:
        return self.envelope.body

    @property
    def key_id(self) -> bytes:
        return self.envelope.key_id

    @property
    def signed(self) -> bool:
        return self.envelope.signed

    @classmethod
    def sign(cls, manifest: Manifest, key: SigningKey | None) -> SignedManifest:
        return cls(Envelope.sign(MANIFEST_TAG, manifest.to_bytes(), key))

    def to_bytes(self) -> bytes:
        return self.envelope.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> SignedManifest:
        return cls(Envelope.from_bytes(data, MANIFEST_TAG))

    def verify(self, policy: KeyPolicy | None, *, now_ms: int | None = None, skew_ms: int = 0) -> Manifest:
        """Signature (when a policy is given) -> parse -> field checks -> key policy -> expiry.

        Nothing in the body is looked at before the signature checks out.
        """
        if policy is not None:
            self.envelope.check_signature()
        manifest = Manifest.from_bytes(self.body)
        if policy is not None:
            policy.check(self.key_id, run_id=manifest.run_id, now_ms=now_ms)
        if now_ms is not None and now_ms - skew_ms > manifest.expires_ms:
            raise ExpiredError(f"manifest of version {manifest.version} expired")
        return manifest

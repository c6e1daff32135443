"""The names of a board's objects and of the signed documents' kinds: one place builds and parses them.

A board is a directory (or any static HTTP server) laid out as

    runs/<run>/head          the run's signed head (the only file that changes)
    manifests/<id hex>       manifest envelopes, named by BLAKE3 of the manifest body
    chunks/<hash hex>        payload chunks, named by their BLAKE3 hash
    certs/<key id hex>       certificates of trainer keys (signed by a root key)
    trust/root.<N>           root documents, version N

These relative paths are also the URL paths and the names peers ask each other for.  The
``*_rel`` functions build them; ``parse_rel`` turns a name (possibly from a peer) back into what it
names, or None for anything the layout has no place for.  ``TOP_LEVEL`` and ``board_limit`` are the
path rules every reader of a board (a server, a seed node, a local source) applies.

The signing tags say which kind of document an envelope holds: a signature covers its tag
(protocol/signed.py ``domain``), so one made for one kind can never pass as another.
"""

from __future__ import annotations

from dataclasses import dataclass

from patchswarm.protocol.chunks import MAX_CHUNK_SIZE
from patchswarm.protocol.signed import MAX_ENVELOPE_BYTES

HEAD_TAG = "patchswarm/head"
MANIFEST_TAG = "patchswarm/manifest"
CERT_TAG = "patchswarm/cert"
ROOT_TAG = "patchswarm/root"

TOP_LEVEL = frozenset({"runs", "manifests", "chunks", "certs", "trust"})
MAX_HEAD_BYTES = 16 << 20  # a signed head (a catalog of up to 100,000 versions); what a host fetches at most
MAX_DOC_BYTES = 1 << 16  # a certificate or a root document
_LIMITS = {"manifests": MAX_ENVELOPE_BYTES, "chunks": MAX_CHUNK_SIZE, "certs": MAX_DOC_BYTES, "trust": MAX_DOC_BYTES}
_HASH_HEX = 64  # BLAKE3 digests and Ed25519 key ids are 32 bytes
_ROOT_PREFIX = "trust/root."


def board_limit(rel: str) -> int | None:
    """The size bound of the board file at ``rel``, or None if the layout has no such file.

    ``runs/<run>/head`` and ``<folder>/<name>`` only: nothing deeper, nothing else under runs/.
    """
    parts = rel.split("/")
    if parts[0] == "runs":
        return MAX_HEAD_BYTES if len(parts) == 3 and parts[2] == "head" else None
    return _LIMITS.get(parts[0]) if len(parts) == 2 else None


# ---------------------------------------------------------------- building


def head_rel(run_id: str) -> str:
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise ValueError(f"run id {run_id!r} cannot name a directory")
    return f"runs/{run_id}/head"


def manifest_rel(manifest_id: bytes) -> str:
    return f"manifests/{manifest_id.hex()}"


def chunk_rel(chunk_hash: bytes) -> str:
    return f"chunks/{chunk_hash.hex()}"


def cert_rel(key_id: bytes) -> str:
    return f"certs/{key_id.hex()}"


def root_rel(version: int) -> str:
    return f"{_ROOT_PREFIX}{version}"


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class HeadName:
    run_id: str

    @property
    def rel(self) -> str:
        return head_rel(self.run_id)


@dataclass(frozen=True, slots=True)
class ManifestName:
    manifest_id: bytes

    @property
    def rel(self) -> str:
        return manifest_rel(self.manifest_id)


@dataclass(frozen=True, slots=True)
class ChunkName:
    chunk_hash: bytes

    @property
    def rel(self) -> str:
        return chunk_rel(self.chunk_hash)


@dataclass(frozen=True, slots=True)
class CertName:
    key_id: bytes

    @property
    def rel(self) -> str:
        return cert_rel(self.key_id)


@dataclass(frozen=True, slots=True)
class RootName:
    version: int

    @property
    def rel(self) -> str:
        return root_rel(self.version)


BoardName = HeadName | ManifestName | ChunkName | CertName | RootName


def _hash(name: str) -> bytes | None:
    """The 32 bytes a name of 64 lowercase hex digits spells (the form ``bytes.hex`` writes), or None."""
    if len(name) != _HASH_HEX or name.strip("0123456789abcdef"):
        return None
    return bytes.fromhex(name)


def parse_rel(rel: str) -> BoardName | None:
    """What the board path ``rel`` names, or None if the layout has no place for it.

    Only the exact form the builders write parses (lowercase hex of 32 bytes, a version in plain
    decimal without leading zeros), so ``parse_rel(x.rel) == x`` and ``parse_rel(r).rel == r``.
    """
    folder, sep, name = rel.partition("/")
    if not sep:
        return None
    if folder == "runs":
        run_id, sep, last = name.partition("/")
        if sep and last == "head" and run_id and not run_id.startswith("."):
            return HeadName(run_id)
        return None
    if "/" in name:
        return None
    if folder in ("manifests", "chunks", "certs"):
        digest = _hash(name)
        if digest is None:
            return None
        return (
            ManifestName(digest)
            if folder == "manifests"
            else ChunkName(digest)
            if folder == "chunks"
            else CertName(digest)
        )
    if folder == "trust" and name.startswith("root."):
        digits = name.removeprefix("root.")
        if digits.isascii() and digits.isdigit() and (digits == "0" or not digits.startswith("0")):
            return RootName(int(digits))
    return None

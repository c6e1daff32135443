"""Cutting an encoded payload into content-hashed chunks, and checking chunks received.

Chunk hashes are BLAKE3-256: as strong as SHA-256 for our purpose and measured here at
several times its speed (see docs/benchmarks.md), which matters because every host hashes
every chunk it receives or serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import blake3

from patchswarm.protocol.errors import ChunkError

DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 1 << 10
MAX_CHUNK_SIZE = 1 << 26
HASH_SIZE = 32


def chunk_hash(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest()


@dataclass(frozen=True, slots=True)
class ChunkRef:
    size: int
    hash: bytes

    def to_wire(self) -> list[object]:
        return [self.size, self.hash]


def split(payload: bytes | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[ChunkRef]:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be within [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    mv = memoryview(payload)
    return [
        ChunkRef(len(mv[o : o + chunk_size]), chunk_hash(mv[o : o + chunk_size])) for o in range(0, len(mv), chunk_size)
    ]


def verify_chunk(index: int, data: bytes | memoryview, ref: ChunkRef) -> None:
    """Size first (cheap, and a truncated chunk never reaches the hash), then BLAKE3."""
    if len(data) != ref.size:
        raise ChunkError(index, f"{len(data)} bytes, manifest says {ref.size}")
    if chunk_hash(data) != ref.hash:
        raise ChunkError(index, "hash does not match the manifest")


def chunk_views(payload: bytes | memoryview, refs: Iterable[ChunkRef]) -> Iterator[tuple[ChunkRef, memoryview]]:
    """Each chunk of the list with its bytes in ``payload`` (a view, short or empty past the payload's end)."""
    mv = memoryview(payload)
    offset = 0
    for ref in refs:
        yield ref, mv[offset : offset + ref.size]
        offset += ref.size


def verify_payload(payload: bytes | memoryview, refs: Iterable[ChunkRef]) -> None:
    """Check a whole payload against its chunk list (exact length included)."""
    covered = 0
    for i, (ref, data) in enumerate(chunk_views(payload, refs)):
        verify_chunk(i, data, ref)
        covered += ref.size
    if covered != len(payload):
        raise ChunkError(-1, f"payload has {len(payload) - covered} bytes past its last chunk")

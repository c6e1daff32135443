"""Sized placeholders: chunks that are only their size, for studies with patches too big to hold.

Manifests stay real (signed, verified); only the chunk payloads are stand-ins.  Every chunk of a
given size is one shared zero-filled ``bytes`` (``placeholder_bytes``), so a node that "holds" a
500 MB version holds ~120 references to a few objects, not 500 MB.  The node's two injection
points take ``verify_size`` (the size half of ``protocol.chunks.verify_chunk``: the hash of a
placeholder cannot match a real manifest hash) and ``apply_nothing`` (no decode: the held model
stays what it was, only the version number moves).
"""

from __future__ import annotations

from collections.abc import Mapping

from patchswarm.protocol.chunks import ChunkRef
from patchswarm.protocol.errors import ChunkError
from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.served import ServedModel
from patchswarm.simulations.transport import placeholder_bytes


def empty_model() -> ServedModel:
    """A model with no tensors: what a placeholder node "holds"."""
    return ServedModel([], [])


def placeholder_held(version: int) -> Held:
    """What a placeholder node holds after reaching ``version``."""
    return Held(version, empty_model(), [])


def verify_size(index: int, data: bytes, ref: ChunkRef) -> None:
    """Size-only chunk check (``SwarmNode(verify_chunk=...)``): a placeholder's hash cannot match."""
    if len(data) != ref.size:
        raise ChunkError(index, f"{len(data)} bytes, manifest says {ref.size}")


def apply_nothing(held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
    """No-op apply (``SwarmNode(apply=...)``): the node now holds ``manifest.version`` of nothing."""
    if len(parts) != len(manifest.chunks):
        raise ChunkError(-1, f"{len(parts)} chunks for a manifest of {len(manifest.chunks)}")
    return Held(manifest.version, held.model if held is not None else empty_model(), [])


class PlaceholderChunkStore:
    """The seed's ChunkStore in placeholder mode: every known chunk hash answers a sized placeholder."""

    def __init__(self, sizes: Mapping[bytes, int]) -> None:
        self.sizes = dict(sizes)

    def get(self, chunk_hash: bytes) -> bytes | None:
        size = self.sizes.get(chunk_hash)
        return None if size is None else placeholder_bytes(size)

    def put(self, chunk_hash: bytes, data: bytes) -> None:
        raise PermissionError("the seed's chunks come from its synthetic board only")

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self.sizes

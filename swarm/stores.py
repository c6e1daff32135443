"""Where a node keeps what it serves to peers: verified chunks (by hash) and verified board objects.

Everything put here has already been verified by the caller (chunk hash, signatures), so a
node only ever re-serves bytes it checked.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Protocol

from patchswarm.protocol.board_names import chunk_rel
from patchswarm.protocol.files import FileTooLargeError
from patchswarm.swarm.board_files import BoardReader


class ChunkStore(Protocol):
    def get(self, chunk_hash: bytes) -> bytes | None: ...

    def put(self, chunk_hash: bytes, data: bytes) -> None: ...

    def __contains__(self, chunk_hash: object) -> bool: ...


class MemoryChunkStore:
    """An LRU cache of chunks bounded in bytes; pinned chunks (a download in progress) are never evicted."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self.pinned: set[bytes] = set()

    def get(self, chunk_hash: bytes) -> bytes | None:
        data = self._data.get(chunk_hash)
        if data is not None:
            self._data.move_to_end(chunk_hash)
        return data

    def put(self, chunk_hash: bytes, data: bytes) -> None:
        if chunk_hash in self._data:
            return
        self._data[chunk_hash] = data
        self._bytes += len(data)
        self.trim(keep=chunk_hash)

    def trim(self, keep: bytes | None = None) -> None:
        """Evict down to ``max_bytes``: least recently used first, never a pinned chunk or ``keep``
        (the chunk just put).  Also after the bound shrinks, or a download's pins are released."""
        if self._bytes <= self.max_bytes:
            return  # room to spare: no walk over the cache
        excess = self._bytes - self.max_bytes
        evict = []
        for old, held in self._data.items():
            if excess <= 0:
                break
            if old not in self.pinned and old != keep:
                evict.append(old)
                excess -= len(held)
        for old in evict:
            self._bytes -= len(self._data.pop(old))

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._data

    @property
    def nbytes(self) -> int:
        return self._bytes


class BoardChunkStore:
    """The seed's chunks: the board's own files (verified when they were published), read through
    the board's confinement (swarm/board_files.py): a regular file within the chunk size bound, or nothing."""

    def __init__(self, board: BoardReader) -> None:
        self.board = board

    def get(self, chunk_hash: bytes) -> bytes | None:
        return self.board.read_served(chunk_rel(chunk_hash))

    def put(self, chunk_hash: bytes, data: bytes) -> None:
        raise PermissionError("the seed's chunks come from its board only")

    def __contains__(self, chunk_hash: object) -> bool:
        if not isinstance(chunk_hash, bytes):
            return False
        try:
            fd = self.board.open(chunk_rel(chunk_hash))
        except FileTooLargeError:
            return False
        if fd is None:
            return False
        os.close(fd)
        return True

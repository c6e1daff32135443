"""A chunk store that keeps the download in progress in a file, not in the process's heap.

A rollout daemon's first version is an anchor: its payload is about 0.7x the served model (bf16),
and a ``MemoryChunkStore`` holds all of it, pinned, until the version is decoded, on top of the
store the anchor is decoded into (1.94x the model at the peak; docs/weightstore.md, "Where every
copy lives").  ``SpoolChunkStore`` writes each verified chunk of the download in progress at its
offset in the payload, in a file under the daemon's data.dir that has no name (``O_TMPFILE``:
nothing to find, trust or clean up after a crash; the kernel frees it with the last descriptor).
The finished download is handed to the decoder as one read-only mapping of that file, every chunk
hashed again over the mapping first: page cache the kernel can reclaim or write back, never
anonymous memory.

The spool's chunks are servable to peers (read back and hashed again per request) until its
version is decoded (the owner calls ``release``, or ``release_off_loop`` on the event loop) or the
next download begins; then the most recent of them, up to the cache's bound, move into the memory
LRU, as a ``MemoryChunkStore`` would have kept them, and the file goes (it takes the disk space of
one payload only while it is needed: the journal shares data.dir).  A write error (a full disk)
sends the rest of that download to memory: it costs RAM, never correctness.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from patchswarm.protocol.chunks import chunk_hash, verify_payload
from patchswarm.protocol.errors import ChunkError
from patchswarm.protocol.manifest import Manifest
from patchswarm.swarm.stores import MemoryChunkStore

log = logging.getLogger("patchswarm.swarm")


@dataclass
class _Spool:
    """One download's payload file: where each chunk goes, and which are written (arrival order)."""

    manifest_id: bytes
    size: int
    file: IO[bytes]
    where: dict[bytes, list[int]]  # chunk hash -> its offsets in the payload (a chunk may repeat)
    sizes: dict[bytes, int]
    written: dict[bytes, None] = field(default_factory=dict)  # (a dict: ordered by arrival)
    failed: bool = False  # a write failed (a full disk): the rest of the download goes to memory

    def write(self, h: bytes, data: bytes | memoryview) -> None:
        fd = self.file.fileno()
        for at in self.where[h]:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        self.written[h] = None

    def read(self, h: bytes) -> bytes | None:
        """The chunk as written, hashed again (None if the file no longer holds it)."""
        if h not in self.written:
            return None
        try:
            data = os.pread(self.file.fileno(), self.sizes[h], self.where[h][0])
        except (OSError, ValueError):  # (ValueError: closed meanwhile by ``payload``'s thread)
            return None
        if chunk_hash(data) != h:
            log.error("a spooled chunk changed on disk: dropped")
            self.written.pop(h, None)  # (``pop``: a reader on another thread may have dropped it)
            return None
        return data

    def close(self) -> None:
        self.file.close()  # (a mapping handed out keeps the file's pages until it is dropped)


class SpoolChunkStore(MemoryChunkStore):
    """A ``MemoryChunkStore`` whose download in progress lives in an unnamed file under ``folder``.

    The download loop (swarm/download.py) calls ``begin(manifest)`` before it starts and
    ``payload(manifest)`` when every chunk is verified and stored.
    """

    def __init__(self, folder: Path | str, max_bytes: int = 1 << 30) -> None:
        super().__init__(max_bytes)
        self.folder = Path(folder)
        self._spool: _Spool | None = None

    def begin(self, manifest: Manifest) -> None:
        """Spool ``manifest``'s chunks from now on (the chunks held already are copied in).  A retry of
        the same download keeps its spool; another download's spool is released first."""
        old = self._spool
        if old is not None and old.manifest_id == manifest.manifest_id:
            return
        spool = self._open(manifest)
        if spool is not None:
            try:
                for h in spool.where:
                    data = super().get(h) or (old.read(h) if old is not None else None)
                    if data is not None:
                        spool.write(h, data)
            except OSError as e:
                log.warning("cannot spool to %s (%s): the download is kept in memory", self.folder, e)
                spool.close()
                spool = None
        self.release()
        self._spool = spool

    def release(self) -> None:
        """Let the spool go (its version is decoded, or another download begins): its newest chunks
        stay servable from memory, up to the cache's bound, and its disk space is freed once the
        mapping handed out is dropped too.  Blocking: those chunks are read back and hashed (up to
        the cache's bound: an eighth of the model in a daemon); ``release_off_loop`` on the loop."""
        old, self._spool = self._spool, None
        if old is not None:
            self._keep(self._newest(old))
            old.close()

    async def release_off_loop(self) -> None:
        """``release`` with the newest chunks read back and hashed on a thread: the spool serves
        meanwhile, and the event loop (the API, the sidecar, peers' requests) is not held."""
        old = self._spool
        if old is None:
            return
        kept = await asyncio.to_thread(self._newest, old)
        if self._spool is old:  # (else another download began meanwhile: ``begin`` released it)
            self._spool = None
            self._keep(kept)
            old.close()

    def _open(self, manifest: Manifest) -> _Spool | None:
        where: dict[bytes, list[int]] = {}
        sizes: dict[bytes, int] = {}
        at = 0
        for ref in manifest.chunks:
            where.setdefault(ref.hash, []).append(at)
            sizes[ref.hash] = ref.size
            at += ref.size
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            file = tempfile.TemporaryFile(dir=self.folder)  # noqa: SIM115 (held across calls; O_TMPFILE)
        except OSError as e:
            log.warning("cannot spool to %s (%s): the download is kept in memory", self.folder, e)
            return None
        return _Spool(manifest.manifest_id, at, file, where, sizes)

    def _newest(self, old: _Spool) -> list[tuple[bytes, bytes]]:
        """The spool's most recently written chunks that fit the cache's bound, oldest first (the
        LRU's order), read back and hashed again (reads only: safe on a thread)."""
        budget = self.max_bytes
        keep: list[bytes] = []
        for h in reversed(list(old.written)):  # (a copy: the loop's ``read`` may drop one meanwhile)
            if old.sizes[h] > budget:
                break
            budget -= old.sizes[h]
            keep.append(h)
        out = []
        for h in reversed(keep):
            data = old.read(h)
            if data is not None:
                out.append((h, data))
        return out

    def _keep(self, chunks: list[tuple[bytes, bytes]]) -> None:
        for h, data in chunks:
            super().put(h, data)

    def payload(self, manifest: Manifest) -> memoryview | None:
        """The finished download as one read-only mapping of its spool, every chunk hashed again over
        it; None if the spool does not hold it all (then the chunks come from ``get``).  Blocking:
        one pass of BLAKE3 over the payload (call it off the event loop)."""
        spool = self._spool
        if spool is None or spool.manifest_id != manifest.manifest_id or len(spool.written) != len(spool.where):
            return None
        if spool.size == 0:
            return memoryview(b"")
        try:
            view = memoryview(mmap.mmap(spool.file.fileno(), spool.size, prot=mmap.PROT_READ))
        except (OSError, ValueError) as e:
            log.warning("cannot map the spooled download (%s): it is read back into memory", e)
            return None
        try:
            verify_payload(view, manifest.chunks)
        except ChunkError:
            self._spool = None  # fetched again from peers at the retry, never trusted
            spool.close()
            raise
        return view

    def get(self, chunk_hash: bytes) -> bytes | None:
        data = super().get(chunk_hash)
        if data is None and self._spool is not None:
            data = self._spool.read(chunk_hash)
        return data

    def put(self, chunk_hash: bytes, data: bytes) -> None:
        spool = self._spool
        if spool is None or chunk_hash not in spool.where:
            super().put(chunk_hash, data)
            return
        if chunk_hash in spool.written:
            return
        if spool.failed:  # (not a write, and a warning, per chunk of a download into a full disk)
            super().put(chunk_hash, data)
            return
        try:
            spool.write(chunk_hash, data)
        except OSError as e:
            log.warning("cannot spool to %s (%s): the rest of this download is kept in memory", self.folder, e)
            spool.failed = True
            super().put(chunk_hash, data)

    def __contains__(self, chunk_hash: object) -> bool:
        if super().__contains__(chunk_hash):
            return True
        return self._spool is not None and chunk_hash in self._spool.written

    def close(self) -> None:
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()

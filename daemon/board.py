"""The bulletin board: a directory of immutable, content-addressed files plus one signed head
per run, laid out so that any static HTTP server (nginx, an object store, a CDN) can host it.

    runs/<run>/head          the only mutable file; replaced atomically, after everything it names
    manifests/<id hex>       manifest envelopes, named by BLAKE3 of the manifest body
    chunks/<hash hex>        payload chunks, named by their BLAKE3 hash (deduplicated across versions)
    certs/<key id hex>       certificates of trainer keys (signed by a root key)
    trust/root.<N>           root documents, version N (a host fetches N+1 until it gets a 404)

Durability: every file is written to a temporary name, fsynced, renamed and its directory
fsynced, and a version's chunks and manifest are durable before the head moves.  The head is
replaced under a per-run lock (``head_slot``: flock, re-read, os.replace), so two signers on this
host never fork or rewind it; a board in an object store does the same with conditional writes
(daemon/board_store.py).

Reading: the layout above is the only thing a board serves.  Its path rules (``TOP_LEVEL``,
``board_limit``) and names live in protocol/board_names.py; ``Board`` reads through swarm/board_files.py's
``BoardFiles`` (confined to the layout, each kind of file within its size bound), the same reader a
seed node and ``patchswarm seed`` use.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from patchswarm.protocol.board_names import (
    BoardName,
    ChunkName,
    ManifestName,
    RootName,
    cert_rel,
    chunk_rel,
    head_rel,
    manifest_rel,
    parse_rel,
    root_rel,
)
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import chunk_views
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.files import fsync_dir, write_atomic
from patchswarm.protocol.patchfile import Version
from patchswarm.swarm.board_files import BoardFiles
from patchswarm.swarm.board_sources import BoardSource, DirSource


class HeadRaceError(PatchswarmError):
    """Another writer replaced the head between this writer's read and its write (nothing was written)."""


class HeadSlot:
    """A run's head as read at the start of a replacement, and the one write that replaces it."""

    def __init__(self, data: bytes | None, write: Callable[[bytes], None]) -> None:
        self.data = data
        self._write = write

    def write(self, envelope_bytes: bytes) -> None:
        self._write(envelope_bytes)


class Board(BoardFiles):
    """A board directory: ``BoardFiles``' confined reads plus the publisher's durable writes."""

    @property
    def location(self) -> str:
        return str(self.root)

    def source(self) -> BoardSource:
        """The board read as hosts read it (a resuming publisher rebuilds its chain through this)."""
        return DirSource(self.root)

    # ------------------------------------------------------------ writing

    def put_version(self, version: Version) -> bytes:
        """Write chunks then the manifest, durably; returns the manifest id."""
        dirs: set[Path] = set()
        for ref, data in chunk_views(version.payload, version.manifest.chunks):
            p = self.path(chunk_rel(ref.hash))
            if not p.exists():
                write_atomic(p, data, sync_dir=False)
                dirs.add(p.parent)
        for d in dirs:
            fsync_dir(d)
        mid = version.manifest.manifest_id
        write_atomic(self.path(manifest_rel(mid)), version.signed.to_bytes())
        return mid

    def put_head(self, run_id: str, envelope_bytes: bytes) -> None:
        write_atomic(self.path(head_rel(run_id)), envelope_bytes)

    @contextmanager
    def head_slot(self, run_id: str) -> Iterator[HeadSlot]:
        """The run's head, read under the per-run lock (``runs/<run>/.lock``, flock: exclusive across
        the processes of this host, released when the holder dies); ``write`` replaces it before the
        lock is released.  Across hosts (a network file system) flock may not hold: use an object store."""
        run_dir = self.path(head_rel(run_id)).parent
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield HeadSlot(self.read(head_rel(run_id)), lambda data: self.put_head(run_id, data))
        finally:
            os.close(fd)  # releases the lock

    def put_certificate(self, key_id: bytes, envelope_bytes: bytes) -> None:
        write_atomic(self.path(cert_rel(key_id)), envelope_bytes)

    def put_root(self, version: int, envelope_bytes: bytes) -> None:
        p = self.path(root_rel(version))
        if p.exists() and self.read(root_rel(version)) != envelope_bytes:
            raise FileExistsError(f"{p} already holds a different root document version {version}")
        write_atomic(p, envelope_bytes)

    # ------------------------------------------------------------ reading

    def root_versions(self) -> list[int]:
        d = self.path("trust")
        if not d.is_dir():
            return []
        names = (parse_rel(f"trust/{p.name}") for p in d.glob("root.*"))
        return sorted(n.version for n in names if isinstance(n, RootName))

    # ------------------------------------------------------------ retention

    def collect_garbage(self, retained: Iterable[CatalogEntry], *, keep_manifests: Iterable[bytes] = ()) -> int:
        """Delete manifests and chunks no retained version needs; returns the number of files removed.

        Call only after the head listing exactly ``retained`` is durable, so no host that
        follows the head can be sent to a file this removes.
        """
        keep_ids = {e.manifest_id for e in retained} | set(keep_manifests)
        keep_chunks: set[bytes] = set()
        for mid in keep_ids:
            m = self.manifest(mid)
            keep_chunks.update(ref.hash for ref in m.chunks)
        keep: set[BoardName] = {ManifestName(mid) for mid in keep_ids}
        keep.update(ChunkName(h) for h in keep_chunks)
        removed = 0
        for folder in ("manifests", "chunks"):
            for p in self.path(folder).glob("*"):
                name = parse_rel(f"{folder}/{p.name}")
                if name is not None and name not in keep:  # a file the board did not name is not its to delete
                    p.unlink()
                    removed += 1
        return removed

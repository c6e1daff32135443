"""The bulletin board in an object store (S3 and S3-compatible stores, GCS, Azure Blob), written
through obstore; ``open_board`` picks it or a directory (daemon/board.py) from a board location.

The layout is the directory board's (protocol/board_names.py), under the URL's prefix.  The order
that keeps every head readable is the same too: a version's chunks, then its manifest, each put
completed (the store acknowledged it: S3, GCS and Azure read their writes back strongly
consistently), before the head moves; a put is all or nothing (an interrupted upload, multipart
included, leaves no object), so a publisher killed at any moment leaves the old head and
everything it names in place.

The head is replaced with a conditional write: its ETag as read, ``If-Match`` on the put
(``If-None-Match: *`` for a run's first head).  Two publishers that read the same head cannot both
replace it: the loser's put fails (412) and it raises ``HeadRaceError`` having written no head, so
the head is never rewound or forked.  Every head differs from the last (its counter and creation
time are signed into it), so its ETag changes with each write and an If-Match can never pass
on a head that was replaced by identical bytes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError

from patchswarm.daemon.board import Board, HeadRaceError, HeadSlot
from patchswarm.protocol.board_names import (
    MAX_HEAD_BYTES,
    BoardName,
    ChunkName,
    ManifestName,
    board_limit,
    cert_rel,
    chunk_rel,
    head_rel,
    manifest_rel,
    parse_rel,
    root_rel,
)
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import chunk_views
from patchswarm.protocol.manifest import Manifest, SignedManifest
from patchswarm.protocol.patchfile import Version
from patchswarm.swarm.board_sources import BoardSource
from patchswarm.swarm.board_store import (
    StoreSource,
    StoreURL,
    is_missing,
    local_path,
    open_store,
    parse_store_url,
    read_object,
    store_error,
)
from patchswarm.swarm.client_errors import shown_url

MAX_ROOTS = 1000  # root documents a board may hold (each is a trust-root rotation or revocation)
UPLOADS = 16  # chunk puts in flight (obstore releases the GIL while a request runs)
# Crash tests only: PATCHSWARM_FAULT_AT=board.chunks@N (half of the chunks of this board's N-th
# put_version stored; an anchor and a patch of one version are two) or board.manifest@N (its
# manifest stored, the head not yet moved) kills this process with SIGKILL there.
FAULT_ENV = "PATCHSWARM_FAULT_AT"
# What a CDN or HTTP client in front of the store may cache (the same rules as swarm/board_http.py).
IMMUTABLE = {"Cache-Control": "public, max-age=31536000, immutable"}
MUTABLE = {"Cache-Control": "no-cache"}


class StoreBoard:
    """A board in an object store: the directory board's reads and writes, over obstore."""

    def __init__(self, loc: StoreURL) -> None:
        self.loc = loc
        self.store = open_store(loc)
        self._versions_put = 0
        point, _, nth = os.environ.get(FAULT_ENV, "").partition("@")
        self._fault = (point, int(nth)) if point.startswith("board.") and nth.isdigit() else None

    @property
    def location(self) -> str:
        return self.loc.url

    def source(self) -> BoardSource:
        return StoreSource(self.loc)

    def _reached(self, point: str) -> None:
        if self._fault == (point, self._versions_put):
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------ reading

    def read(self, rel: str, limit: int | None = None) -> bytes | None:
        """The object at board path ``rel`` (bounded like a directory board's file), or None."""
        bound = board_limit(rel)
        if bound is None:
            return None
        found = read_object(self.store, self.location, rel, bound if limit is None else min(bound, limit))
        return None if found is None else found.data

    def manifest(self, manifest_id: bytes) -> Manifest:
        data = self.read(manifest_rel(manifest_id))
        if data is None:
            raise FileNotFoundError(f"{self.location}/{manifest_rel(manifest_id)}")
        return SignedManifest.from_bytes(data).verify(None)

    def names(self, folder: str) -> list[BoardName]:
        """The board names listed under ``folder`` (needs the permission to list the bucket)."""
        try:
            listed = [meta["path"] for batch in obstore.list(self.store, f"{folder}/") for meta in batch]
        except Exception as e:
            raise store_error(e, f"LIST {self.location}/{folder}/") from None
        names = (parse_rel(p) for p in listed)
        return [n for n in names if n is not None]

    def root_versions(self) -> list[int]:
        """Root documents 1, 2, ... up to the first missing, as hosts fetch them: asked by name, not
        listed, so that a stray object the SDK cannot name (a key holding ``..``) does not stop every
        refresh of the head and every seed's copy."""
        versions: list[int] = []
        while len(versions) < MAX_ROOTS and self._exists(root_rel(len(versions) + 1)):
            versions.append(len(versions) + 1)
        return versions

    # ------------------------------------------------------------ writing

    def _put(self, rel: str, data: bytes | memoryview, **opts: Any) -> None:
        attributes = MUTABLE if rel.startswith("runs/") else IMMUTABLE
        try:
            obstore.put(self.store, rel, data, attributes=attributes, **opts)
        except (AlreadyExistsError, PreconditionError):
            raise
        except Exception as e:
            raise store_error(e, f"PUT {self.location}/{rel}") from None

    def _exists(self, rel: str) -> bool:
        try:
            obstore.head(self.store, rel)
        except Exception as e:
            if is_missing(e):
                return False
            raise store_error(e, f"HEAD {self.location}/{rel}") from None
        return True

    def _put_chunk(self, rel: str, data: memoryview) -> None:
        if not self._exists(rel):  # content-addressed: an object of this name holds these bytes
            self._put(rel, data)

    def put_version(self, version: Version) -> bytes:
        """Upload the chunks (in parallel), then, once every one is stored, the manifest; returns its id."""
        self._versions_put += 1
        chunks = {chunk_rel(ref.hash): data for ref, data in chunk_views(version.payload, version.manifest.chunks)}
        with ThreadPoolExecutor(min(UPLOADS, max(len(chunks), 1)), thread_name_prefix="board-put") as pool:
            futures = [pool.submit(self._put_chunk, rel, data) for rel, data in chunks.items()]
            for i, f in enumerate(futures):
                f.result()  # the first failure propagates (the others finish or fail; none is named yet)
                if i == len(futures) // 2:
                    self._reached("board.chunks")
        mid = version.manifest.manifest_id
        self._put(manifest_rel(mid), version.signed.to_bytes())
        self._reached("board.manifest")
        return mid

    def put_head(self, run_id: str, envelope_bytes: bytes) -> None:
        """Replace the head unconditionally (tests plant heads with it; publishers use ``head_slot``)."""
        self._put(head_rel(run_id), envelope_bytes, use_multipart=False)

    @contextmanager
    def head_slot(self, run_id: str) -> Iterator[HeadSlot]:
        """The run's head with its ETag; ``write`` replaces it only if it is still that object."""
        rel = head_rel(run_id)
        found = read_object(self.store, self.location, rel, MAX_HEAD_BYTES)
        if found is not None and not found.e_tag:
            raise store_error(RuntimeError("no ETag on the head: it cannot be replaced conditionally"), rel)
        mode: Any = "create" if found is None else {"e_tag": found.e_tag}

        def write(data: bytes) -> None:
            try:
                # One request (no multipart), so the condition is checked on the put that lands.
                self._put(rel, data, mode=mode, use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                # A retried put whose first try landed fails its condition on itself.
                now = read_object(self.store, self.location, rel, MAX_HEAD_BYTES)
                if now is not None and now.data == data:
                    return
                raise HeadRaceError(
                    f"the head of run {run_id!r} on {self.location} was replaced by another writer while this one "
                    "wrote (conditional put refused): another publisher writes this run"
                ) from None

        yield HeadSlot(None if found is None else found.data, write)

    def put_certificate(self, key_id: bytes, envelope_bytes: bytes) -> None:
        self._put(cert_rel(key_id), envelope_bytes)

    def put_root(self, version: int, envelope_bytes: bytes) -> None:
        rel = root_rel(version)
        try:
            self._put(rel, envelope_bytes, mode="create")  # a root version is written once
        except (AlreadyExistsError, PreconditionError):
            if self.read(rel) != envelope_bytes:
                raise FileExistsError(
                    f"{self.location}/{rel} already holds a different root document version {version}"
                ) from None

    # ------------------------------------------------------------ retention

    def collect_garbage(self, retained: Iterable[CatalogEntry], *, keep_manifests: Iterable[bytes] = ()) -> int:
        """Delete manifests and chunks no retained version needs (see ``Board.collect_garbage``)."""
        keep_ids = {e.manifest_id for e in retained} | set(keep_manifests)
        keep: set[BoardName] = {ManifestName(mid) for mid in keep_ids}
        for mid in keep_ids:
            keep.update(ChunkName(ref.hash) for ref in self.manifest(mid).chunks)
        doomed = [n.rel for folder in ("manifests", "chunks") for n in self.names(folder) if n not in keep]
        for rel in doomed:
            try:
                obstore.delete(self.store, rel)
            except Exception as e:
                raise store_error(e, f"DELETE {self.location}/{rel}") from None
        return len(doomed)


AnyBoard = Board | StoreBoard


def open_board(location: str | Path | AnyBoard) -> AnyBoard:
    """The board at ``location``: a store URL (``s3://``, ``gs://``, ``az://``), a ``file://`` URL or a
    directory.  ValueError for a malformed URL; StoreError when the store cannot be configured."""
    if isinstance(location, Board | StoreBoard):
        return location
    text = str(location)
    if text.startswith(("http://", "https://")):
        raise ValueError(
            f"{shown_url(text)}: an HTTP board is read-only; publish to its store (s3://, gs://, az://) or a directory"
        )
    loc = parse_store_url(text)
    if loc is not None:
        return StoreBoard(loc)
    return Board(local_path(text) or location)

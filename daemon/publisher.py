"""The trainer's publisher: cast master weights to the served format, diff against the previous
served version, encode, sign and write to the board, then move the head.

    pub = Publisher(board="/srv/board", signing_key=SigningKey.load("trainer.key"),
                    served_format="bf16", anchor_every=10, run_id="run-7")
    for step in training:
        ...
        info = pub.publish(model)        # version, changed fraction, patch bytes, seconds

With ``background=True``, ``publish`` returns as soon as the served copy is taken (the cast
is the copy) and the rest runs on a worker thread; a bounded queue raises
PublisherBehindError instead of silently piling up versions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from daemon.board import Board
from daemon.pull import Held, Puller
from daemon.served_format import ServedFormat
from daemon.sources import DirSource
from protocol.catalog import CatalogEntry
from protocol.chunks import DEFAULT_CHUNK_SIZE
from protocol.errors import PublisherBehindError, UntrustedKeyError
from protocol.head import Head
from protocol.keys import SigningKey, TrustedKeys
from protocol.manifest import Kind
from protocol.patchfile import Version, build_version
from protocol.served import ServedModel

DEFAULT_HEAD_TTL_S = 120.0


@dataclass(frozen=True, slots=True)
class PublishInfo:
    version: int
    changed_fraction: float  # of served elements, vs the previous version (1.0 for the first)
    patch_bytes: int  # payload bytes of the patch (0 when there is no previous version)
    anchor_bytes: int | None  # payload bytes of the anchor published with this version, if any
    served_bytes: int
    seconds: float  # wall time from the call to the head moving
    manifest_id: bytes


def _state_dict(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(model_or_state, torch.nn.Module):
        return model_or_state.state_dict()
    return model_or_state


class Publisher:
    def __init__(
        self,
        board: Board | str | Path,
        signing_key: SigningKey,
        *,
        run_id: str,
        served_format: str | ServedFormat = "bf16",
        anchor_every: int = 10,
        certificate: bytes | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        head_ttl_s: float = DEFAULT_HEAD_TTL_S,
        keep_anchors: int = 2,
        background: bool = False,
        queue_size: int = 2,
        resume: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if anchor_every < 1 or keep_anchors < 1:
            raise ValueError("anchor_every and keep_anchors must be at least 1")
        self.board = board if isinstance(board, Board) else Board(board)
        Board.head_rel(run_id)  # validates the run id
        self.key = signing_key
        self.run_id = run_id
        self.format = served_format if isinstance(served_format, ServedFormat) else ServedFormat(served_format)
        self.anchor_every = anchor_every
        self.chunk_size = chunk_size
        self.head_ttl_ms = int(head_ttl_s * 1000)
        self.keep_anchors = keep_anchors
        self.clock = clock
        if certificate is not None:
            self.board.put_certificate(signing_key.key_id, certificate)
        self._lock = threading.Lock()  # guards the chain state below
        self._prev: ServedModel | None = None
        self._prev_digests: list[bytes] | None = None
        self._prev_manifest: bytes | None = None
        self._version = 0
        self._counter = 0
        self._catalog: list[CatalogEntry] = []
        self._anchor_requested = False
        self._dropped: list[CatalogEntry] = []
        self._queue: queue.Queue[tuple[int, ServedModel, bool, float, Future[PublishInfo]] | None] | None = None
        self._worker: threading.Thread | None = None
        if resume:
            self._resume()
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._worker = threading.Thread(target=self._run_worker, name="patchswarm-publisher", daemon=True)
            self._worker.start()

    @property
    def version(self) -> int:
        """The last version number handed out."""
        return self._version

    def request_anchor(self) -> None:
        """Publish the next version as an anchor as well (e.g. before scaling up the fleet)."""
        self._anchor_requested = True

    def publish(
        self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], *, anchor: bool = False
    ) -> PublishInfo | Future[PublishInfo]:
        """Publish the next version; in background mode returns a Future once the served copy is taken."""
        start = self.clock()
        with torch.no_grad():
            served = ServedModel.from_tensors(self.format.convert(_state_dict(model_or_state)))
        with self._lock:
            self._version += 1
            version = self._version
        anchor = (
            anchor
            or self._anchor_requested
            or version == 1
            or version % self.anchor_every == 0
            or bool(self.format.refreshed and len(self.format.refreshed) * 2 > len(served))
        )
        self._anchor_requested = False
        if self._queue is None:
            return self._publish(version, served, anchor, start)
        fut: Future[PublishInfo] = Future()
        try:
            self._queue.put_nowait((version, served, anchor, start, fut))
        except queue.Full:
            with self._lock:
                self._version -= 1
            raise PublisherBehindError(
                f"publisher is {self._queue.maxsize} versions behind training; version {version} was not taken"
            ) from None
        return fut

    def flush(self) -> None:
        """Wait until every queued version is on the board."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        if self._queue is not None and self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._queue = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh_head(self) -> None:
        """Re-sign the head with a fresh expiry (call periodically when no version is published)."""
        with self._lock:
            if self._catalog:
                self._write_head()

    # ------------------------------------------------------------ internals

    def _resume(self) -> None:
        """Continue the run's chain from the board: rebuild the head version from its own files."""
        if self.board.read(Board.head_rel(self.run_id)) is None:
            return
        puller = Puller(DirSource(self.board.root), TrustedKeys(frozenset([self.key.key_id])), self.run_id)

        async def rebuild() -> tuple[Head, Held]:
            head = await puller.fetch_head()
            return head, await puller.catch_up(None, head)

        try:
            head, held = asyncio.run(rebuild())
        except UntrustedKeyError:
            raise UntrustedKeyError(
                f"run {self.run_id!r} on this board was published with another key; use a new run id"
            ) from None
        self._prev, self._prev_digests = held.model, held.digests
        self._version = head.version
        self._counter = head.counter
        self._catalog = list(head.catalog)
        self._prev_manifest = head.manifest_id

    def _run_worker(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                version, served, anchor, start, fut = item
                try:
                    fut.set_result(self._publish(version, served, anchor, start))
                except BaseException as e:  # the future carries it to the trainer
                    fut.set_exception(e)
            finally:
                self._queue.task_done()

    def _publish(self, version: int, served: ServedModel, anchor: bool, start: float) -> PublishInfo:
        with self._lock:
            now_ms = int(self.clock() * 1000)
            digests = served.digests()
            common = {
                "run_id": self.run_id,
                "version": version,
                "now_ms": now_ms,
                "key": self.key,
                "chunk_size": self.chunk_size,
                "target_digests": digests,
                "prev_manifest": self._prev_manifest,
            }
            patch: Version | None = None
            anchor_v: Version | None = None
            if self._prev is not None and self._prev.specs != served.specs:
                anchor = True  # a new layout cannot be patched: only an anchor reaches it
            elif self._prev is not None:
                patch = build_version(
                    self._prev,
                    served,
                    base_version=version - 1,
                    base_digests=self._prev_digests,
                    **common,  # type: ignore[arg-type]
                )
            if anchor or patch is None:
                anchor_v = build_version(None, served, **common)  # type: ignore[arg-type]
            primary = patch or anchor_v
            assert primary is not None
            for v in (anchor_v, patch):
                if v is not None:
                    mid = self.board.put_version(v)
                    self._catalog.append(
                        CatalogEntry(version, v.manifest.kind, v.manifest.base_version, v.manifest.payload_size, mid)
                    )
            self._prev, self._prev_digests = served, digests
            self._prev_manifest = primary.manifest.manifest_id
            self._retain()
            self._write_head()
            self._collect_garbage()
            changed = patch.encoded.changed / max(patch.encoded.numel, 1) if patch and patch.encoded else 1.0
            return PublishInfo(
                version=version,
                changed_fraction=changed,
                patch_bytes=patch.manifest.payload_size if patch else 0,
                anchor_bytes=anchor_v.manifest.payload_size if anchor_v else None,
                served_bytes=served.nbytes,
                seconds=self.clock() - start,
                manifest_id=primary.manifest.manifest_id,
            )

    def _retain(self) -> None:
        anchors = sorted(e.version for e in self._catalog if e.kind == Kind.ANCHOR)
        if len(anchors) <= self.keep_anchors:
            return
        oldest = anchors[-self.keep_anchors]
        self._dropped = [
            e for e in self._catalog if e.version < oldest or (e.version == oldest and e.kind == Kind.PATCH)
        ]
        self._catalog = [e for e in self._catalog if e not in self._dropped]

    def _write_head(self) -> None:
        now_ms = int(self.clock() * 1000)
        latest = max(self._catalog, key=lambda e: (e.version, e.kind == Kind.PATCH))
        self._counter += 1
        head = Head(
            run_id=self.run_id,
            version=latest.version,
            manifest_id=latest.manifest_id,
            counter=self._counter,
            created_ms=now_ms,
            expires_ms=now_ms + self.head_ttl_ms,
            catalog=tuple(self._catalog),
        )
        self.board.put_head(self.run_id, head.sign(self.key).to_bytes())

    def _collect_garbage(self) -> None:
        if self._dropped:
            self.board.collect_garbage(self._catalog)
            self._dropped = []

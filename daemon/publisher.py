"""The trainer's publisher: cast master weights to the served format, diff against the previous
served version, encode, sign and write to the board, then move the head.

    pub = Publisher(board="/srv/board", signing_key=SigningKey.load("trainer.key"),
                    served_format="bf16", anchor_every=10, run_id="run-7")
    for step in training:
        ...
        info = pub.publish(model)        # version, changed fraction, patch bytes, seconds

``payload_format`` 2, the default, lets patches code float positions under base-value contexts where
that is smaller (docs/format.md section 2a; their manifests say so, section 4); 1 every build reads,
for fleets with hosts of builds before manifest format 2 (docs/board.md, "Payload format").

``board`` is a directory or an object store URL (``s3://bucket/prefix``, ``gs://``, ``az://``;
daemon/board_store.py), credentials from the provider's environment.  Two publishers of one run
never fork or rewind its head: the one that loses a head write raises ``HeadRaceError`` and
writes nothing more.

A run outlives any one trainer process: a Publisher resumes the run it finds on its board after
any pause (its own key, or a newly certified one: key rotation), re-signing the head with a fresh
expiry, and re-signs it in the background while the trainer is idle (``head_ttl``; docs/board.md,
"Run lifecycle").

With ``background=True``, ``publish`` returns as soon as the served copy is taken (the cast
is the copy) and the rest runs on a worker thread; a bounded queue raises
PublisherBehindError instead of silently piling up versions.

Sharded trainers (each rank holds only some tensors) publish one version together through
``begin_sharded`` (daemon/sharded_publish.py).  The chain itself (anchors, the commit of a version,
the head) is daemon/publish_chain.py's.

The hot path (docs/board.md, "Publish latency"): the cast writes into buffers recycled from
the version before last (fresh pages cost a page fault each); worker threads (one per core,
torch on one thread each) take one tensor each and go through it block by block, casting,
scanning against the previous version and hashing (BLAKE3) while the block is in cache; a
tensor that did not change keeps its previous digest unhashed; the calling thread compresses
the patch's streams as the tensors come in.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from patchswarm.daemon.board_store import AnyBoard, open_board
from patchswarm.daemon.head_refresh import (
    check_own_key,
    signer_policy,
)
from patchswarm.daemon.publish_chain import PublishChain
from patchswarm.daemon.publish_chain import PublishInfo as PublishInfo
from patchswarm.daemon.publish_work import (
    Buffers,
    Served,
    Stages,
    cast_served,
    prepare,
    state_dict_of,
)
from patchswarm.daemon.run_rules import DEFAULT_HEAD_TTL_S, check_head_ttl, check_run_id
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.daemon.sharded_publish import ShardedPublish as ShardedPublish
from patchswarm.daemon.sharded_publish import ShardPart as ShardPart
from patchswarm.daemon.sharded_publish import _Rank
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from patchswarm.protocol.errors import PublisherBehindError
from patchswarm.protocol.head import Head
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT, PAYLOAD_FORMATS
from patchswarm.protocol.served import ServedModel
from patchswarm.swarm.puller import Puller

log = logging.getLogger("patchswarm.publisher")

MAX_ANCHOR_EVERY = 1 << 20
MAX_KEEP_ANCHORS = 1 << 10
MAX_QUEUE_SIZE = 1 << 10
MAX_WORLD_SIZE = 1 << 16
# Stage names of PublishInfo.stages (seconds; see docs/board.md "Publish latency").
STAGES = ("cast", "diff", "digests", "prepare", "encode", "anchor", "sign", "write")


class Publisher(PublishChain):
    # The served copy of GPU weights lives in pinned host buffers (see cast_served); False keeps it on
    # the GPU and diffs there (benchmarks/publish_bench.py --served-on-device measures the two).
    served_on_host = True

    def __init__(
        self,
        board: AnyBoard | str | Path,
        signing_key: SigningKey,
        *,
        run_id: str,
        served_format: str | ServedFormat = "bf16",
        anchor_every: int = 10,
        certificate: bytes | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        payload_format: int = DEFAULT_FORMAT,
        head_ttl: float | None = None,
        head_ttl_s: float | None = None,  # the earlier name of head_ttl
        keep_anchors: int = 2,
        background: bool = False,
        queue_size: int = 2,
        resume: bool = True,
        refresh: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(signing_key, SigningKey):
            raise ValueError(f"signing_key must be a SigningKey, not {type(signing_key).__name__}")
        check_run_id(run_id)
        _check_int("anchor_every", anchor_every, 1, MAX_ANCHOR_EVERY)
        _check_int("keep_anchors", keep_anchors, 1, MAX_KEEP_ANCHORS)
        _check_int("chunk_size", chunk_size, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
        _check_int("queue_size", queue_size, 1, MAX_QUEUE_SIZE)
        _check_int("payload_format", payload_format, min(PAYLOAD_FORMATS), max(PAYLOAD_FORMATS))
        if head_ttl is not None and head_ttl_s is not None:
            raise ValueError("give head_ttl or its earlier name head_ttl_s, not both")
        ttl = head_ttl if head_ttl is not None else head_ttl_s
        ttl = DEFAULT_HEAD_TTL_S if ttl is None else check_head_ttl(ttl, "head_ttl")
        if certificate is not None and not isinstance(certificate, bytes):
            raise ValueError(
                f"certificate must be bytes (the certificate file's contents), not {type(certificate).__name__}"
            )
        self.format = served_format if isinstance(served_format, ServedFormat) else ServedFormat(served_format)
        self.board = open_board(board)  # a directory, or s3:// gs:// az:// (daemon/board_store.py)
        self.key = signing_key
        self.run_id = run_id
        self.anchor_every = anchor_every
        self.chunk_size = chunk_size
        self.payload_format = payload_format
        self.head_ttl_ms = int(ttl * 1000)
        self.keep_anchors = keep_anchors
        self.clock = clock
        self._certificate = certificate
        if certificate is not None:
            signer_policy(self.board, signing_key, certificate)  # a certificate that does not parse: refused now
            self.board.put_certificate(signing_key.key_id, certificate)
        self._lock = threading.Lock()  # guards the chain state below
        self._counter_lock = threading.Lock()  # guards the version counter and the open sharded version
        self._prev: ServedModel | None = None
        self._prev_digests: list[bytes] | None = None
        self._prev_version: int | None = None  # version of _prev (the base of the next patch)
        self._prev_owned = False  # _prev's buffers belong to this publisher alone (reusable once replaced)
        self._prev_manifest: bytes | None = None
        self._version = 0
        self._counter = 0
        self._catalog: list[CatalogEntry] = []
        self._anchor_requested = False
        self._dropped: list[CatalogEntry] = []
        self._buffers = Buffers()
        self._ranks: dict[int, _Rank] = {}
        self._sharded: ShardedPublish | None = None
        self._queue: queue.Queue[tuple[int, Served, bool, float, Stages, Future[PublishInfo]] | None] | None
        self._queue = None
        self._worker: threading.Thread | None = None
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None
        self._lost: str | None = None  # why this publisher may no longer write the head (another one won it)
        if resume:
            self._resume()
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._worker = threading.Thread(target=self._run_worker, name="patchswarm-publisher", daemon=True)
            self._worker.start()
        if refresh:
            self._refresher = threading.Thread(target=self._refresh_loop, name="patchswarm-head-refresh", daemon=True)
            self._refresher.start()

    @property
    def head_ttl(self) -> float:
        """Seconds each signed head is valid for (hosts add their clock skew allowance)."""
        return self.head_ttl_ms / 1000

    @property
    def version(self) -> int:
        """The last version number handed out."""
        return self._version

    def publish(
        self,
        model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        anchor: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> PublishInfo | Future[PublishInfo]:
        """Publish the next version; in background mode returns a Future once the served copy is taken.

        ``metadata`` goes into the version's signed manifest (e.g. a checkpoint's ``checkpoint.files``,
        docs/models.md); ``served.format`` (and ``served.quantization_config`` for fp8) is added."""
        if not isinstance(anchor, bool):
            raise ValueError(f"anchor must be True or False, not {anchor!r}")
        if metadata is not None and not (
            isinstance(metadata, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise ValueError("metadata must map strings to strings")
        if not isinstance(model_or_state, torch.nn.Module | Mapping):
            raise ValueError(f"model_or_state must be a module or a state dict, not {type(model_or_state).__name__}")
        start = self.clock()
        stages = Stages()
        if self._sharded is not None:
            raise RuntimeError(f"sharded version {self._sharded.version} is open: finalize or abort it first")
        state = state_dict_of(model_or_state)
        with stages.time("cast"):
            # fp8 scales: those of the version this one follows (kept in memory, else read from it).
            self.format.follow(self._version, self._prev, state.keys())
            if self.format.refresh_at_anchor and self._anchor_due(self._version + 1, anchor):
                self.format.reset()
            try:
                target = cast_served(self.format, state, self._buffers, self.served_on_host)
                target.model.metadata = dict(metadata or {})  # (the format's keys are added at commit)
                if self._queue is not None:
                    target.fill_all()  # the served copy is taken before returning; else cast while diffing
            except BaseException:
                self.format.basis = None  # scales half updated: the next publish reads them from the chain
                raise
        with self._counter_lock:
            if self._sharded is not None:
                self.format.basis = None
                raise RuntimeError(f"sharded version {self._sharded.version} is open: finalize or abort it first")
            self._version += 1
            version = self._version
            self.format.basis = version
        anchor = self._wants_anchor(version, anchor) or bool(
            self.format.refreshed and len(self.format.refreshed) * 2 > len(target.model)
        )
        if self._queue is None:
            return self._publish(version, target, anchor, start, stages)
        fut: Future[PublishInfo] = Future()
        try:
            self._queue.put_nowait((version, target, anchor, start, stages, fut))
        except queue.Full:
            with self._counter_lock:
                self._version -= 1
            self.format.basis = None
            raise PublisherBehindError(
                f"publisher is {self._queue.maxsize} versions behind training; version {version} was not taken"
            ) from None
        return fut

    def begin_sharded(self, world_size: int, *, anchor: bool = False) -> ShardedPublish:
        """Open the next version for ``world_size`` ranks, each adding its own disjoint shard.

        Reserves the version number; until the returned handle is finalized or aborted,
        ``publish`` and another ``begin_sharded`` are refused.  In background mode, versions
        still queued are published first.
        """
        _check_int("world_size", world_size, 1, MAX_WORLD_SIZE)
        if not isinstance(anchor, bool):
            raise ValueError(f"anchor must be True or False, not {anchor!r}")
        start = self.clock()
        self.flush()
        with self._counter_lock:
            if self._sharded is not None:
                raise RuntimeError(f"sharded version {self._sharded.version} is already open")
            self._version += 1
            version = self._version
            base_version = self._prev_version  # read without the chain lock: finalize checks it again
            shard = ShardedPublish(self, version, world_size, self._wants_anchor(version, anchor), base_version, start)
            self._sharded = shard
        return shard

    def flush(self) -> None:
        """Wait until every queued version is on the board."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self._closed.set()
        if self._queue is not None and self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._queue = None
        if self._refresher is not None and self._refresher is not threading.current_thread():
            self._refresher.join()
            self._refresher = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _refresh_loop(self) -> None:
        # Wakes every sixth of the lifetime and re-signs once a third has passed since the last head
        # (this publisher's or another signer's): a head always has over half its lifetime left.
        while not self._closed.wait(max(self.head_ttl / 6, 0.05)):
            try:
                self.refresh_head(only_after=self.head_ttl / 3)
            except Exception as e:  # the trainer goes on; the next tick tries again
                log.warning("run %r: cannot refresh the head: %s", self.run_id, e)

    def _policy(self) -> KeyPolicy:
        return signer_policy(self.board, self.key, self._certificate)

    def _resume(self) -> None:
        """Continue the run's chain from the board after any pause: rebuild the head version from its
        own files, trusting the head through this key's trust chain (another certified key of the run
        may have signed it) but not its expiry, then re-sign it fresh if it is due."""
        if self.board.read(head_rel(self.run_id)) is None:
            return
        policy = self._policy()
        check_own_key(policy, self.key, self.run_id, now_ms=int(self.clock() * 1000))
        source = self.board.source()
        puller = Puller(source, policy, self.run_id, clock=self.clock, allow_expired=True)

        async def rebuild() -> tuple[Head, Held]:
            try:
                head = await puller.fetch_head()
                return head, await puller.catch_up(None, head)
            finally:
                await source.close()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            head, held = asyncio.run(rebuild())
        else:  # constructed inside an async trainer: its loop cannot run another, a thread's can
            with ThreadPoolExecutor(1) as pool:
                head, held = pool.submit(lambda: asyncio.run(rebuild())).result()
        self._prev, self._prev_digests = held.model, held.digests
        self._prev_version = head.version
        self._version = head.version
        self._counter = head.counter
        self._catalog = list(head.catalog)
        self._prev_manifest = head.manifest_id
        if self.clock() * 1000 - head.created_ms >= self.head_ttl_ms / 3 or self.clock() * 1000 > head.expires_ms:
            with self._lock:
                self._write_head()

    def _run_worker(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                version, target, anchor, start, stages, fut = item
                try:
                    fut.set_result(self._publish(version, target, anchor, start, stages))
                except BaseException as e:  # the future carries it to the trainer
                    fut.set_exception(e)
            finally:
                self._queue.task_done()

    def _publish(self, version: int, target: Served, anchor: bool, start: float, stages: Stages) -> PublishInfo:
        with self._lock:
            prepared = prepare(self._prev, self._prev_digests, target, stages, payload_format=self.payload_format)
            try:
                return self._commit(version, target.model, target.owned, prepared, anchor, start, stages, refreshed=0)
            except BaseException:
                prepared.settle()
                self.format.basis = None  # its scales are of a version that is not on the board
                raise


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {value}")

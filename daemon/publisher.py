"""The trainer's publisher: cast master weights to the served format, diff against the previous
served version, encode, sign and write to the board, then move the head.

    pub = Publisher(board="/srv/board", signing_key=SigningKey.load("trainer.key"),
                    served_format="bf16", anchor_every=10, run_id="run-7")
    for step in training:
        ...
        info = pub.publish(model)        # version, changed fraction, patch bytes, seconds

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

Sharded trainers (each rank holds only some tensors) publish one version together:

    shard = pub.begin_sharded(world_size)        # reserves the version number
    shard.add(rank, rank_state_dict)             # on each rank's thread: cast, diff, hash
    info = shard.finalize()                      # once: one payload, one manifest, head moves

Each rank keeps its own previous served shard and hands ``finalize`` only what it computed
from it (per-tensor deltas, digests, specs); see docs/board.md, "Sharded trainers".

The hot path (docs/board.md, "Publish latency"): the cast writes into buffers recycled from
the version before last (fresh pages cost a page fault each); worker threads (one per core,
torch on one thread each) take one tensor each and go through it block by block, casting,
scanning against the previous version and hashing (BLAKE3) while the block is in cache; a
tensor that did not change keeps its previous digest unhashed; the calling thread compresses
the patch's streams as the tensors come in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from patchswarm.daemon.board import HeadRaceError
from patchswarm.daemon.board_store import AnyBoard, open_board
from patchswarm.daemon.head_refresh import (
    board_head,
    check_own_key,
    parse_head,
    signer_policy,
)
from patchswarm.daemon.publish_work import (
    Buffers,
    Prepared,
    Served,
    Stages,
    cast_served,
    prepare,
    prepare_all,
    state_dict_of,
)
from patchswarm.daemon.run_rules import DEFAULT_HEAD_TTL_S, check_head_ttl, check_run_id
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from patchswarm.protocol.codec import TensorDelta, assemble, diff_tensor
from patchswarm.protocol.errors import PatchswarmError, PublisherBehindError
from patchswarm.protocol.head import Head
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.patchfile import Version, sign_version
from patchswarm.protocol.served import ServedModel, TensorSpec, state_root
from patchswarm.swarm.puller import Puller

log = logging.getLogger("patchswarm.publisher")

MAX_ANCHOR_EVERY = 1 << 20
MAX_KEEP_ANCHORS = 1 << 10
MAX_QUEUE_SIZE = 1 << 10
MAX_WORLD_SIZE = 1 << 16
# Stage names of PublishInfo.stages (seconds; see docs/board.md "Publish latency").
STAGES = ("cast", "diff", "digests", "prepare", "encode", "anchor", "sign", "write")


@dataclass(frozen=True, slots=True)
class PublishInfo:
    version: int
    changed_fraction: float  # of served elements, vs the previous version (1.0 for the first)
    patch_bytes: int  # payload bytes of the patch (0 when there is no previous version)
    anchor_bytes: int | None  # payload bytes of the anchor published with this version, if any
    served_bytes: int
    seconds: float  # wall time from the call to the head moving
    manifest_id: bytes
    # Seconds per stage.  cast (to the served format), diff (scan and sparse coding: the deltas)
    # and digests (BLAKE3) are busy time summed over the worker threads, which run them block by
    # block, interleaved; prepare is the wall time of that per-tensor phase.  encode (the patch
    # payload's shared streams, on the calling thread while workers finish), anchor (the anchor
    # payload), sign (chunk hashes, manifests, signatures) and write (board files with fsync,
    # head, garbage collection) are wall times.  A sharded version sums cast, diff, digests and
    # prepare over its ranks.
    stages: dict[str, float] = field(default_factory=dict)


class Publisher:
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

    def request_anchor(self) -> None:
        """Publish the next version as an anchor as well (e.g. before scaling up the fleet)."""
        self._anchor_requested = True

    def _anchor_due(self, version: int, anchor: bool) -> bool:
        return anchor or self._anchor_requested or version == 1 or version % self.anchor_every == 0

    def _wants_anchor(self, version: int, anchor: bool) -> bool:
        wanted = self._anchor_due(version, anchor)
        self._anchor_requested = False
        return wanted

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

    def refresh_head(self, *, only_after: float | None = None) -> bool:
        """Re-sign the head with a fresh expiry (the background refresher calls this while idle).

        ``only_after``: seconds; only if the board's head is at least that old (another signer of
        this host may have just re-signed it).  True if a head was written.
        """
        with self._lock:
            if not self._catalog:
                return False
            if only_after is not None:
                current = board_head(self.board, self.run_id)
                if current is not None and self.clock() * 1000 - current.created_ms < only_after * 1000:
                    return False
            self._write_head()
            return True

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
            prepared = prepare(self._prev, self._prev_digests, target, stages)
            try:
                return self._commit(version, target.model, target.owned, prepared, anchor, start, stages, refreshed=0)
            except BaseException:
                prepared.settle()
                self.format.basis = None  # its scales are of a version that is not on the board
                raise

    def _commit(
        self,
        version: int,
        served: ServedModel,
        owned: bool,
        prepared: Prepared,
        anchor: bool,
        start: float,
        stages: Stages,
        *,
        refreshed: int,
    ) -> PublishInfo:
        """Encode, sign and write ``served`` as ``version`` (a patch when ``prepared`` has deltas against
        the previous version, and/or an anchor), then move the head.  Call with the chain lock held.
        """
        assert self._lock.locked()
        if self._lost is not None:
            raise HeadRaceError(self._lost)  # nothing more goes onto a board another publisher writes
        if refreshed * 2 > len(served):
            anchor = True  # most fp8 scales moved: the patch is dense anyway
        served.metadata.update(self.format.metadata(served.specs))  # served.format, quantization_config
        patchable = prepared.has_deltas and self._prev is not None and self._prev.specs == served.specs
        encoded_patch = None
        if patchable:  # else a new layout, which only an anchor reaches
            t = time.perf_counter()
            encoded_patch = assemble(prepared.deltas())  # while the workers finish the last tensors
            stages.add("encode", time.perf_counter() - t - prepared.waited)
        final = prepared.digests()
        stages.add("prepare", prepared.seconds)
        encoded_anchor = None
        if anchor or not patchable:
            with stages.time("anchor"):
                encoded_anchor = assemble(diff_tensor(spec, None, data) for spec, data in served)
        with stages.time("sign"):
            now_ms = int(self.clock() * 1000)
            common = {
                "run_id": self.run_id,
                "version": version,
                "now_ms": now_ms,
                "key": self.key,
                "chunk_size": self.chunk_size,
                "prev_manifest": self._prev_manifest,
                "metadata": served.metadata,
            }
            patch: Version | None = None
            anchor_v: Version | None = None
            if encoded_patch is not None:
                assert self._prev is not None and self._prev_digests is not None
                patch = sign_version(
                    encoded_patch,
                    served.specs,
                    final,
                    base_version=self._prev_version,
                    base_root=state_root(self._prev.specs, self._prev_digests),
                    **common,  # type: ignore[arg-type]
                )
            if encoded_anchor is not None:
                anchor_v = sign_version(encoded_anchor, served.specs, final, **common)  # type: ignore[arg-type]
        primary = patch or anchor_v
        assert primary is not None
        with stages.time("write"):
            for v in (anchor_v, patch):
                if v is not None:
                    mid = self.board.put_version(v)
                    self._catalog.append(
                        CatalogEntry(version, v.manifest.kind, v.manifest.base_version, v.manifest.payload_size, mid)
                    )
            if self._prev is not None and self._prev_owned:
                self._buffers.give(self._prev)
            self._prev, self._prev_digests, self._prev_owned = served, final, owned
            self._prev_version = version
            self._prev_manifest = primary.manifest.manifest_id
            self._retain()
            self._write_head()
            self._collect_garbage()
        if patch is not None and patch.encoded is not None:
            changed_fraction = patch.encoded.changed / max(patch.encoded.numel, 1)
        else:
            changed_fraction = 1.0
        return PublishInfo(
            version=version,
            changed_fraction=changed_fraction,
            patch_bytes=patch.manifest.payload_size if patch else 0,
            anchor_bytes=anchor_v.manifest.payload_size if anchor_v else None,
            served_bytes=served.nbytes,
            seconds=self.clock() - start,
            manifest_id=primary.manifest.manifest_id,
            stages=dict(stages.seconds),
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
        """Sign and write the head for the chain's latest version (chain lock held).

        Under the board's per-run lock, the board's head is read again: another signer of this run
        on this host (a seed or cron job re-signing it) may have moved its counter, which this head
        then goes past.  A head for a version this publisher did not write is another history.
        """
        if self._lost is not None:
            raise HeadRaceError(self._lost)
        latest = max(self._catalog, key=lambda e: (e.version, e.kind == Kind.PATCH))
        with self.board.head_slot(self.run_id) as slot:
            current = None if slot.data is None else parse_head(slot.data)
            if current is not None and current.counter >= self._counter:
                known = {(e.version, e.manifest_id) for e in (*self._catalog, *self._dropped)}
                if current.version > latest.version or (current.version, current.manifest_id) not in known:
                    self._lost = (
                        f"the head of run {self.run_id!r} moved to version {current.version} (counter "
                        f"{current.counter}) under this publisher: another publisher writes this run"
                    )
                    raise HeadRaceError(self._lost)
                self._counter = current.counter
            now_ms = int(self.clock() * 1000)
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
            try:
                slot.write(head.sign(self.key).to_bytes())
            except HeadRaceError as e:
                self._lost = str(e)  # the run is another publisher's now: nothing more is written
                raise

    def _collect_garbage(self) -> None:
        if self._dropped:
            try:
                self.board.collect_garbage(self._catalog)
            except (OSError, PatchswarmError) as e:
                # The head has moved: the version is published.  What is left costs storage only and goes at
                # the next collection; failing the publish would fail every later one (a stray object in a
                # store that cannot be listed, a delete refused).
                log.warning("publisher: old versions not deleted from %s: %s", self.board.location, e)
                return
            self._dropped = []


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {value}")


# ---------------------------------------------------------------- sharded trainers


class _Rank:
    """What one rank keeps between versions: its previous served shard, the base of its next deltas."""

    def __init__(self, fmt: ServedFormat) -> None:
        self.format = fmt
        self.buffers = Buffers()
        self.version: int | None = None
        self.served: ServedModel | None = None
        self.owned = False  # served's buffers are the rank's own: reusable once it is replaced
        self.digests: list[bytes] | None = None


@dataclass(frozen=True, slots=True)
class ShardPart:
    """What one rank hands to ``finalize``: small, whatever the size of its tensors.

    ``deltas`` and ``digests`` are what the payload and manifest need; ``served`` is the rank's
    new shard, by reference (no copy), read only when the version carries an anchor (a rank in
    another process would send it only then: ``ShardedPublish.anchor`` is known before ``add``).
    """

    rank: int
    version: int
    base_version: int | None
    specs: list[TensorSpec]  # sorted by name
    digests: list[bytes]
    deltas: list[TensorDelta] | None  # against base_version's tensors; None: no base or new layout
    served: ServedModel
    owned: bool
    refreshed: int
    stages: dict[str, float]

    @property
    def delta_bytes(self) -> int:
        return sum(d.nbytes for d in self.deltas or [])


class ShardedPublish:
    """One version published by several ranks: ``add`` once per rank (any thread), then ``finalize``."""

    def __init__(
        self,
        publisher: Publisher,
        version: int,
        world_size: int,
        anchor: bool,
        base_version: int | None,
        start: float,
    ) -> None:
        self._pub = publisher
        self.version = version
        self.world_size = world_size
        self.anchor = anchor  # decided up front, so ranks know whether finalize will need their bytes
        self.base_version = base_version
        self._start = start
        self._lock = threading.Lock()
        self._parts: dict[int, ShardPart] = {}
        self._adding: set[int] = set()
        self._closed: str | None = None  # "finalized" or "aborted"

    def __enter__(self) -> ShardedPublish:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._closed is None:
            self.abort()

    def add(
        self, rank: int, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> ShardPart:
        """Rank ``rank``'s shard: cast to the served format, diff against the rank's previous shard, hash.

        Ranks may call this concurrently from their own threads.  ``version``, when given, must be
        this handle's version (a rank's own idea of which version it is contributing to).
        """
        if version is not None and version != self.version:
            raise ValueError(
                f"rank {rank} adds to version {version}, but this sharded publish is version {self.version}"
            )
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        with self._lock:
            self._check_open()
            if rank in self._parts or rank in self._adding:
                raise ValueError(f"rank {rank} already added its shard to version {self.version}")
            self._adding.add(rank)
        try:
            part = self._make_part(rank, state_dict_of(model_or_state))
        finally:
            with self._lock:
                self._adding.discard(rank)
        with self._lock:
            self._check_open()
            self._parts[rank] = part
        return part

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError(f"sharded version {self.version} was already {self._closed}")

    def _make_part(self, rank: int, state: Mapping[str, torch.Tensor]) -> ShardPart:
        pub = self._pub
        with pub._counter_lock:
            r = pub._ranks.get(rank)
            if r is None:
                fmt = dataclasses.replace(pub.format, scales={}, refreshed=[], basis=None, converted=frozenset())
                r = pub._ranks[rank] = _Rank(fmt)
        stages = Stages()
        with stages.time("cast"):
            # fp8 scales: the rank's own when it made the base from these tensors, else the base's.
            r.format.follow(self.base_version, pub._prev, state.keys())
            if self.anchor and r.format.refresh_at_anchor:
                r.format.reset()
            r.format.basis = None  # until this shard is cast
            target = cast_served(r.format, state, r.buffers, pub.served_on_host)
            r.format.basis = self.version
        served = target.model
        base, base_digests = self._base(r, served.specs)
        deltas, digests = prepare_all(base, base_digests, target, stages)
        return ShardPart(
            rank=rank,
            version=self.version,
            base_version=self.base_version if deltas is not None else None,
            specs=served.specs,
            digests=digests,
            deltas=deltas,
            served=served,
            owned=target.owned,
            refreshed=len(r.format.refreshed),
            stages=dict(stages.seconds),
        )

    def _base(self, r: _Rank, specs: list[TensorSpec]) -> tuple[ServedModel | None, list[bytes] | None]:
        """The rank's base for ``specs``: its own previous shard, else (new rank, moved tensors, a
        version published unsharded, a resumed run) those tensors of the publisher's previous version."""
        if self.base_version is None:
            return None, None
        if r.version == self.base_version and r.served is not None and r.served.specs == specs:
            return r.served, r.digests
        prev, prev_digests = self._pub._prev, self._pub._prev_digests
        if prev is None or prev_digests is None:
            return None, None
        index = {s.name: i for i, s in enumerate(prev.specs)}
        idx = [index.get(s.name) for s in specs]
        if any(i is None or prev.specs[i] != s for i, s in zip(idx, specs, strict=True)):
            return None, None  # new or reshaped tensors: only an anchor reaches this layout
        sel = [i for i in idx if i is not None]
        return ServedModel(specs, [prev.data[i] for i in sel]), [prev_digests[i] for i in sel]

    def abort(self) -> None:
        """Give the version number back; nothing was written."""
        pub = self._pub
        with self._lock:
            self._check_open()
            self._closed = "aborted"
        with pub._counter_lock:
            if pub._version == self.version:
                pub._version -= 1
            pub._sharded = None

    def finalize(self) -> PublishInfo:
        """Assemble one payload and one manifest over the union of the shards; sign, write, move the head.

        Refuses (and stays open, nothing written) while a rank is missing, when two ranks hold a
        tensor of the same name, or when a shard was made for another version or base.
        """
        with self._lock:
            self._check_open()
            missing = [r for r in range(self.world_size) if r not in self._parts]
            if missing:
                raise ValueError(f"version {self.version}: rank(s) {missing} have not added their shard")
            parts = [self._parts[r] for r in range(self.world_size)]
            owner: dict[str, int] = {}
            for p in parts:
                if p.version != self.version:
                    raise ValueError(f"rank {p.rank}'s shard was made for version {p.version}, not {self.version}")
                if p.deltas is not None and p.base_version != self.base_version:
                    raise ValueError(
                        f"rank {p.rank}'s deltas are against version {p.base_version}, "
                        f"but version {self.version} patches version {self.base_version}"
                    )
                for s in p.specs:
                    if s.name in owner:
                        raise ValueError(f"tensor {s.name!r} is in the shards of ranks {owner[s.name]} and {p.rank}")
                    owner[s.name] = p.rank
            self._closed = "finalized"
        try:
            return self._finalize(parts)
        except BaseException:
            with self._lock:
                self._closed = None  # nothing moved: the caller may retry or abort
            raise

    def _finalize(self, parts: list[ShardPart]) -> PublishInfo:
        pub = self._pub
        stages = Stages()
        for p in parts:
            for k, v in p.stages.items():
                stages.add(k, v)
        # Merge the shards into name order: (name, part, index in part).
        order = sorted((s.name, pi, i) for pi, p in enumerate(parts) for i, s in enumerate(p.specs))
        specs = [parts[pi].specs[i] for _, pi, i in order]
        data = [parts[pi].served.data[i] for _, pi, i in order]
        digests = [parts[pi].digests[i] for _, pi, i in order]
        deltas: list[TensorDelta] | None = None
        if all(p.deltas is not None for p in parts):
            deltas = [parts[pi].deltas[i] for _, pi, i in order]  # type: ignore[index]
        metadata: dict[str, str] = {}  # the format's keys are added at commit, as for a one-process publish
        served = ServedModel(specs, data, metadata)
        with pub._lock:
            if pub._prev_version != self.base_version:
                raise RuntimeError(
                    f"the chain moved to version {pub._prev_version} since version {self.version} was opened"
                )
            info = pub._commit(
                self.version,
                served,
                False,  # the union references the ranks' buffers: they recycle them, not the publisher
                Prepared.ready(deltas, digests),
                self.anchor,
                self._start,
                stages,
                refreshed=sum(p.refreshed for p in parts),
            )
            with pub._counter_lock:
                for p in parts:
                    r = pub._ranks[p.rank]
                    if r.served is not None and r.owned:
                        r.buffers.give(r.served)  # neither the chain nor any rank reads it any more
                    r.served, r.owned, r.digests, r.version = p.served, p.owned, p.digests, self.version
                pub._sharded = None
        return info

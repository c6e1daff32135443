"""The rollout daemon's version activation: each verified version decoded once, then made the
engine's (the store written in place under its fence, the sidecar drained around it, the engine
paused for an in-place commit), exported, and the high-water marks persisted.

``VersionActivation`` is the part of ``RolloutDaemon`` (daemon/rollout.py, which sets every
attribute declared here in its ``__init__``) that does this; daemon/rollout_api.py adds what the
API answers, daemon/rollout.py the start-up and the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from patchswarm.daemon.checkpoint_writer import export_version
from patchswarm.daemon.config import DaemonConfig
from patchswarm.daemon.engine_drivers import copies_regions
from patchswarm.daemon.engine_regions import store_regions
from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.prepared import abandon_on_error
from patchswarm.daemon.pull_state import PullState
from patchswarm.daemon.rank_rollout import FAULT_ENV, activate_ranks
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.rollout_engine import EngineControl
from patchswarm.daemon.shadow import (
    StagedVersion,
    StoreModel,
    decode_once,
    materialized,
    settle,
    store_model,
    store_updates,
)
from patchswarm.daemon.sidecar_gate import DrainTimeoutError
from patchswarm.daemon.status import Phase, Status
from patchswarm.daemon.store_format import StoreError, StoreLayout, StoreState, StoreTooSmallError
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.errors import FormatError, PatchswarmError, TargetMismatchError, UnsupportedFormatError
from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.served import state_root
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.server import RunningNode
from patchswarm.swarm.spool import SpoolChunkStore
from patchswarm.swarm.stores import MemoryChunkStore
from patchswarm.swarm.tls import TlsReloader

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking store operation in a thread, so the API and the sidecar keep answering while
    it writes (their p99 otherwise carries every activation).  Cancelling the caller (SIGTERM)
    waits for the write to finish: the store is never closed under a writer."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


log = logging.getLogger("patchswarm.daemon")

EXPORT_FAILED = "export.dir"  # status reason prefix while the last checkpoint export failed


AWAITING_ENGINE = "waiting for the engine to register its buffer (POST /v1/store)"


class DrainTimedOut(StoreError):
    """An activation given up because the sidecar's drain outlasted sidecar.drain_timeout (retried)."""


class VersionActivation(EngineControl):
    """Making each verified version the engine's; the rollout daemon's state it works on."""

    cfg: DaemonConfig
    status: Status
    metrics: DaemonMetrics
    trust: TrustState
    store: WeightStore | None
    ranks: RankStores | None
    shadow: Held | None
    node: RunningNode | None
    tls: TlsReloader | None
    gate: Any
    engine_kind: bool
    device_uuid: str | None
    rank_devices: list[str | None]
    chunks: SpoolChunkStore
    state_path: Path
    journal_dir: Path
    _activating: asyncio.Lock
    _loading: asyncio.Task[None] | None
    _drain: asyncio.Future[None] | None
    _stopping: bool
    _failed_because: str | None

    @property
    def store_is_copy(self) -> bool:
        """A host store is the daemon's verified copy (no private shadow; docs/weightstore.md); rank
        stores hold runtime layouts, not the canonical model, so the daemon keeps its own copy."""
        return not self.engine_kind and self.ranks is None

    def _awaiting_engine(self) -> bool:
        if self.ranks is not None:
            return self.engine_kind and any(s is not None and s.data is None for s in self.ranks.stores)
        return self.engine_kind and self.store is not None and self.store.data is None

    def _holds(self, version: int) -> bool:
        """Whether the store (every rank store) holds ``version``."""
        if self.ranks is not None:
            return self.ranks.common_version() == version
        return self.store is not None and self.store.header().state == StoreState.READY

    async def _decode_once(self, held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
        """The swarm node's apply hook: decode and verify each version once (daemon/shadow.py).  When
        the store is the held copy and a patch does not verify against it, the store's digests tell
        whether it changed under the daemon (an engine that wrote into it): then the held version is
        dropped, so the node fetches an anchor and the store is reloaded."""
        try:
            return await self._decode_verified(held, manifest, parts)
        finally:
            # decoded or refused: its spool goes before the activation's journal (the chunks kept
            # for peers are read back on a thread: up to an eighth of the model)
            await self.chunks.release_off_loop()

    async def _decode_verified(self, held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
        self._bound_chunk_cache(manifest)
        into = None
        if manifest.base_version is None and self.store_is_copy:
            into = self._empty_host_store(StoreLayout.from_specs(list(manifest.specs)))
        try:
            return await asyncio.to_thread(functools.partial(decode_once, held, manifest, parts, into=into))
        except (TargetMismatchError, FormatError) as e:
            # A changed base may also fail to decode at all: format 2 codes positions under the base's
            # exponents (protocol/context_coding.py), so a scribbled store reads as a malformed payload.
            # (A format this build does not read says nothing about the store: not hashed for it.)
            if isinstance(e, UnsupportedFormatError):
                raise
            if held is None or not self.store_is_copy or self.store is None or self.store.data is None:
                raise
            if await off_loop(self.store.digests) == held.digests:
                raise
            log.error("the store's contents changed under version %s; reloading from an anchor", held.version)
            self._forget_held()
            raise StoreError(
                f"the store's contents changed under version {held.version}: reloading from an anchor"
            ) from None

    def _empty_host_store(self, layout: StoreLayout) -> StoreModel | None:
        """The host store's buffers for an anchor to be decoded straight into, when it serves nothing
        (first version, or a failed store): no second copy of the model.  The fence is left odd
        (LOADING) until the load verifies the state root."""
        if self.store is None:
            capacity = int(self.cfg["store.size"]) or None
            if capacity is not None and capacity < layout.nbytes:
                return None  # (refused with its one line when the version is activated)
            self.store = WeightStore.create(self.cfg.store_name, layout, capacity=capacity, group=self.cfg["api.group"])
        store = self.store
        if store.layout.layout_hash != layout.layout_hash or store.header().state == StoreState.READY:
            return None
        # (Not gated: the store serves no version a reader could attribute, and this runs on the
        # event loop; the load that follows waits for the readers in flight before it publishes.)
        store.control.begin(StoreState.LOADING, gated=False)
        return store_model(store)

    def _bound_chunk_cache(self, manifest: Manifest) -> None:
        """Chunks kept to serve peers: swarm.cache_size, or an eighth of the served model; the chunks of
        a finished download past it are evicted now (before its payload is assembled)."""
        if self.node is None:
            return
        chunks = self.node.node.chunks
        if isinstance(chunks, MemoryChunkStore):
            model_bytes = sum(s.nbytes for s in manifest.specs)
            chunks.max_bytes = int(self.cfg["swarm.cache_size"]) or model_bytes // 8
            chunks.trim()

    def _forget_held(self) -> None:
        """Drop the held version: the node plans again from nothing (an anchor) and the store is loaded."""
        self.shadow = None
        if self.node is not None:
            self.node.node.held = None

    async def _load_registered(self) -> None:
        """Load the version the daemon holds into a newly registered engine buffer; a load whose
        sidecar drain timed out is retried with the swarm's backoff (0.5 s doubling to 8 s)."""
        delay = 0.5
        while True:
            async with self._activating:
                held = self.shadow
                if held is None or self._holds(held.version) or (self.store is None and self.ranks is None):
                    return
                self.status.update(phase=Phase.ACTIVATING, target=max(held.version, self.status.target or 0))
                try:
                    await self._serve(held)
                    return
                except Exception as e:  # a task nobody awaits: say why here (status has it too), never lose it
                    log.error("loading version %s into the engine's buffer failed: %s", held.version, e)
                    if not isinstance(e, DrainTimedOut) or self._stopping:
                        return
            await asyncio.sleep(delay)  # (outside the lock: a new version or shutdown may go first)
            delay = min(delay * 2, 8.0)

    async def _on_version(self, held: Held) -> None:
        """Called by the swarm node with a new verified version: make the engine serve it."""
        async with self._activating:
            self.status.update(phase=Phase.STAGING, target=max(held.version, self.status.target or 0))
            self._crash_if_armed("staging")
            await self._serve(held)

    async def _serve(self, held: Held) -> None:
        """Make the engine serve ``held`` (the caller holds the activation lock)."""
        try:
            applied = await self._activate(held)
        except Exception as e:  # reported until a version activates (the swarm node retries, with backoff)
            if self._stopping:
                raise
            if isinstance(e, StoreTooSmallError):
                self._failed_because = f"store.size: {e}"
            else:
                self._failed_because = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
            self.status.update(phase=Phase.ERROR, reason=self._failed_because)
            raise
        self._failed_because = None
        settle(held, self.store, store_is_copy=self.store_is_copy)
        self.shadow = held
        self._persist_state()
        if not applied:  # the version waits in the shadow until the engine registers a buffer (or the
            # rank stores hold a newer one already: a restart catching up from an anchor)
            self.status.update(phase=Phase.IDLE, reason=AWAITING_ENGINE if self._awaiting_engine() else None)
            return
        root = state_root(held.model.specs, held.digests).hex()
        if self._behind is not None:  # written, not yet acknowledged by the engine (retried: daemon/rollout_engine.py)
            self.status.update(phase=Phase.ERROR, reason=f"{self._behind} (retrying)", version=held.version, root=root)
        else:
            self.status.update(phase=Phase.IDLE, version=held.version, root=root)
        await self._export(held)

    async def _export(self, held: Held) -> None:
        """``export.dir``: the activated version as a checkpoint directory (docs/models.md), written off
        the loop before the node moves on (so its buffers stay as they are); a failure is reported in
        the status reason and logged, and serving goes on."""
        if not self.cfg["export.dir"]:
            return
        try:
            await off_loop(export_version, held.model, self.cfg["export.dir"], held.version)
        except (OSError, PatchswarmError, ValueError) as e:
            log.warning("export failed: %s", e, extra={"version": held.version})
            self.status.update(reason=f"{EXPORT_FAILED}: version {held.version}: {e}")
            return
        if (self.status.reason or "").startswith(EXPORT_FAILED):
            self.status.update(reason=None)

    async def _activate(self, held: Held) -> bool:
        """Write ``held`` into the store; False when an engine store has no buffer to write into yet."""
        if self.ranks is not None:
            return await activate_ranks(self, self.ranks, held, off_loop)
        root = state_root(held.model.specs, held.digests)
        layout = StoreLayout.from_specs(held.model.specs)
        if self.store is not None and self.store.layout.layout_hash != layout.layout_hash:
            raise StoreError("the model's layout changed: restart the engine and give the daemon a new store.name")
        if self.store is None and self.engine_kind:
            size = int(self.cfg["store.size"])
            if size and layout.nbytes > size:
                raise StoreTooSmallError(layout.nbytes, size)
            self.store = WeightStore.create(
                self.cfg.store_name, layout, engine_buffer=True, group=self.cfg["api.group"]
            )
        if self.store is not None and self.engine_kind:
            self.store.check_exporter()  # a dead engine's buffer is let go, never written
        if self.store is not None and self.store.data is None:
            return False
        ready = self.store is not None and self.store.header().state == StoreState.READY
        if self.store is None or not ready or self.shadow is None:
            # First version on this host (or a store that needs a full reload): load everything.
            self.status.update(phase=Phase.ACTIVATING)
            if self.store is None:
                capacity = int(self.cfg["store.size"]) or None
                self.store = WeightStore.create(
                    self.cfg.store_name, layout, capacity=capacity, group=self.cfg["api.group"]
                )
            if isinstance(held, StagedVersion) and self.store_is_copy:
                self._forget_held()  # its base was the store, whose contents are now unknown
                raise StoreError(f"the store failed under version {held.version}: reloading from an anchor")
            whole = materialized(held)
            start = time.perf_counter()
            if self.gate is not None:
                await self._drain_sidecar("quiesce", held.version)
            ack: int | None = None
            attempted = False
            try:
                await off_loop(self.store.load, whole.model, held.version, root)
                attempted = True
                ack = await self._engine_commit(self._activation(held.version, full=True))
            finally:  # (no pause: a load is quiesced)
                await self._end_activation(ack, attempted=attempted, paused=False)
            self.status.update(last_activation_pause_s=time.perf_counter() - start)
            self.metrics.applied.inc()
            return True
        updates = await off_loop(store_updates, self.shadow, held)  # decoded once (daemon/shadow.py)
        self._arm_fault_injection(self.store)
        base = self.store.header().version
        full = self.served != base  # the engine missed a version: a copy engine reloads every parameter
        changed = ((u.slot, u.positions) for u in updates)
        copy = not full and copies_regions(self.driver)  # (only a copy engine takes regions)
        regions = {0: store_regions(self.store.layout.specs, changed)} if copy else None
        in_place = self.gate is not None and self.cfg["sidecar.commit_mode"] == "in_place"
        # Staged and journaled (fsync) while the engine serves: only the fenced write, the commit and
        # the resume sit inside the pause.  Abandoned (journal removed) if the drain or pause fails.
        prepared = await off_loop(self.store.prepare, held.version, root, updates, self.journal_dir)
        with abandon_on_error(prepared):
            if self.gate is not None:
                await self._drain_sidecar(self.cfg["sidecar.commit_mode"], held.version)
            self.status.update(phase=Phase.ACTIVATING)
            paused = attempted = False
            ack = None
            t0 = time.perf_counter()
            try:
                if in_place:
                    # Unpinned requests stay in flight across the switch: the engine must hold them
                    # between steps while the weights change (docs/sidecar.md, attribution guarantee).
                    await self._engine_pause()
                    paused = True
                stats = await off_loop(self.store.finish, prepared)
                attempted = True
                ack = await self._engine_commit(self._activation(held.version, full=full, regions=regions))
            finally:
                # Reopen at the version the engine acknowledged (on a failure, the one it served before,
                # or kept closed: daemon/rollout_engine.py); resumed only after, so no request reports a
                # version it did not see.
                await self._end_activation(ack, attempted=attempted, paused=paused)
        self.metrics.pause.observe(stats.pause_s)
        self.metrics.applied.inc()
        self.status.update(last_activation_pause_s=stats.pause_s)
        # engine_s: the engine's side end to end (pause, write, commit, resume), the store's pause inside it
        engine_s = round(time.perf_counter() - t0, 6)
        log.info("activated", extra={"version": held.version, "pause_s": round(stats.pause_s, 6), "engine_s": engine_s})
        return True

    async def _drain_sidecar(self, mode: str, version: int) -> None:
        """Close the sidecar's admission and wait for the requests in flight, for at most
        ``sidecar.drain_timeout``: one long generation must not hold admission closed (every other
        request 503) and the version back forever.  Past the deadline, or at shutdown, admission
        reopens on the old version and StoreError is raised before the store is touched; the swarm
        node retries the activation, with backoff."""
        if self._stopping:
            raise StoreError("activation abandoned: the daemon is stopping")
        if self._holding:  # closed since a commit the engine did not acknowledge: nothing to drain
            self.gate.retarget(version)
            return
        old = self.gate.applied
        drain = asyncio.ensure_future(
            self.gate.begin_activation(mode, version, timeout_s=self.cfg["sidecar.drain_timeout"])
        )
        self._drain = drain  # (shutdown cancels it: SIGTERM never waits on a drain)
        try:
            await drain
        except DrainTimeoutError as e:
            log.warning("activation of version %s put off: %s", version, e, extra={"version": version})
            raise DrainTimedOut(f"{e}; version {old} kept") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if drain.cancelled() and self._stopping and (task is None or not task.cancelling()):
                raise StoreError("activation abandoned: the daemon is stopping") from None
            raise
        finally:
            self._drain = None

    @staticmethod
    def _crash_if_armed(reached: str) -> None:
        """Crash tests only: PATCHSWARM_FAULT_AT=staging kills the process once a verified version is
        staged (decoded once), before a serving store is touched (an anchor may already fill a store
        that serves nothing: its fence is odd)."""
        if os.environ.get(FAULT_ENV) == reached:
            os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _arm_fault_injection(store: WeightStore) -> None:
        """Crash tests only: PATCHSWARM_FAULT_AT=<point> kills this process (SIGKILL) when an activation
        reaches that point (journaled, odd, mid_write, written, flipped; see daemon/weightstore.py)."""
        point = os.environ.get(FAULT_ENV)
        if not point:
            return

        def fault(reached: str) -> None:
            if reached == point:
                os.kill(os.getpid(), signal.SIGKILL)

        store.fault = fault

    def _persist_state(self) -> None:
        if self.node is None:
            return
        with contextlib.suppress(OSError):
            PullState(self.node.node.puller.tracker).save(self.state_path, self.trust)

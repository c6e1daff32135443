"""``patchswarm daemon``: the rollout-host process.

It joins the swarm, keeps a verified copy of the current version (the "shadow": the host store
itself, or a private copy for engine-allocated stores; daemon/shadow.py), and activates every new
version into the shared weight store the local engine reads: the changes, decoded once, are
journaled, then written in place inside the store's version fence.  Its unix-socket
API reports state and lets engines attach; an optional sidecar admits requests by version.

Start-up order: recover the store from its journal -> verify the store's contents -> serve the API
-> join the swarm -> READY=1 (systemd).  SIGTERM: a sidecar drain is cancelled (nothing written),
an activation in progress finishes (it is short), staging is abandoned, the store is left valid and
the high-water marks are persisted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from patchswarm.daemon import systemd
from patchswarm.daemon.api import SocketInUseError, file_id, make_api_app, parse_rank, serve_unix
from patchswarm.daemon.checkpoint_writer import export_version
from patchswarm.daemon.config import ConfigError, DaemonConfig, bind_errors
from patchswarm.daemon.engine import SHM_DIR, store_lock_path
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.instance_lock import FileLock, InstanceLock, InstanceLockedError, StoreLock
from patchswarm.daemon.journal import recover
from patchswarm.daemon.metrics import DaemonMetrics, serve_metrics
from patchswarm.daemon.payloads import EngineRequest, sglang_continue_generation, sglang_pause_generation
from patchswarm.daemon.pull_state import PullState
from patchswarm.daemon.rank_rollout import (
    FAULT_ENV,
    RankStartError,
    activate_ranks,
    open_rank_stores,
    rank_layout,
    rank_stores_for,
    register_rank,
    store_gpus,
)
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.shadow import (
    StagedVersion,
    StoreModel,
    decode_once,
    materialized,
    settle,
    store_model,
    store_updates,
    tune_malloc,
)
from patchswarm.daemon.sidecar import DrainTimeoutError
from patchswarm.daemon.status import Phase, Status
from patchswarm.daemon.store_format import (
    KIND_ENGINE_BUFFER,
    KIND_HOST,
    StoreError,
    StoreLayout,
    StoreMissingError,
    StoreState,
    StoreTooSmallError,
)
from patchswarm.daemon.weightstore import ENGINE_BUFFER_KINDS, RegistrationError, WeightStore, check_registration
from patchswarm.protocol.errors import PatchswarmError, TargetMismatchError
from patchswarm.protocol.head import utc_text
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import load_public_key
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.scheduler_types import SchedulerConfig
from patchswarm.protocol.served import state_root
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.client_errors import describe
from patchswarm.swarm.server import RunningNode, start_http_node
from patchswarm.swarm.serving import ServerLimits, raise_nofile_limit
from patchswarm.swarm.spool import SpoolChunkStore
from patchswarm.swarm.stores import MemoryChunkStore
from patchswarm.swarm.tls import TlsReloader

T = TypeVar("T")

# A pause waits for the engine's step in progress; beyond this the engine is taken as unresponsive.
ENGINE_CALL_TIMEOUT_S = 30.0


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

HEAD_REFUSED = "head refused"  # status reason prefix while the newest head fails verification
EXPORT_FAILED = "export.dir"  # status reason prefix while the last checkpoint export failed
AWAITING_ENGINE = "waiting for the engine to register its buffer (POST /v1/store)"


def swarm_budgets(cfg: DaemonConfig) -> dict[str, Any]:
    """The config's upload and request budgets as NodeConfig keywords."""
    return {
        "max_uploads": cfg["swarm.max_uploads"],
        "upload_queue": cfg["swarm.upload_queue"],
        "tree_fanout": cfg["swarm.tree_fanout"],
        "scheduler": SchedulerConfig(
            max_inflight=cfg["swarm.max_inflight"],
            max_inflight_per_peer=cfg["swarm.max_inflight_per_peer"],
            max_inflight_remote=cfg["swarm.max_inflight_remote"],
            max_inflight_per_remote_peer=cfg["swarm.max_inflight_per_remote_peer"],
            max_peers=cfg["swarm.max_peers"],
        ),
    }


class DaemonError(Exception):
    """A start-up problem worth one line to the operator (bad data dir, unusable store, ...)."""


class DrainTimedOut(StoreError):
    """An activation given up because the sidecar's drain outlasted sidecar.drain_timeout (retried)."""


class RolloutDaemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.status = Status(cfg.node_name, cfg["swarm.run_id"])
        self.metrics = DaemonMetrics()
        self.store: WeightStore | None = None
        self.shadow: Held | None = None
        self.node: RunningNode | None = None
        self.tls: TlsReloader | None = None  # mutual TLS contexts (tls.enabled), reloaded on SIGHUP too
        self.gate: Any = None  # the sidecar's VersionGate, when the sidecar runs
        self._runners: list[Any] = []
        self._servers: list[Any] = []  # sidecar servers (closed at shutdown)
        self._activating = asyncio.Lock()
        # Engine-allocated stores (store.kind cuda / engine-shm): the engine registers its buffer.
        self.engine_kind = cfg["store.kind"] in ENGINE_BUFFER_KINDS
        self.device_uuid: str | None = None  # the GPU a CUDA buffer must be on (None: any)
        self.rank_devices: list[str | None] = []  # per rank store (store.devices), the same
        self._loading: asyncio.Task[None] | None = None
        self._drain: asyncio.Future[None] | None = None  # the sidecar drain an activation waits on
        self._stopping = False
        self._failed_because: str | None = None  # why the last activation failed (None after one succeeds)
        self.trust = TrustState(load_public_key(cfg["trust.root"]), skew_ms=int(cfg["trust.clock_skew"] * 1000))
        self.lock = InstanceLock(cfg.data_dir)
        self.store_lock: StoreLock | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the API socket this process bound
        self.state_path = cfg.data_dir / "pull-state.msgpack"
        self.journal_dir = cfg.data_dir / "journal"
        # The download in progress: an unnamed file here (page cache, not the heap; swarm/spool.py).
        self.chunks = SpoolChunkStore(cfg.data_dir / "spool", int(cfg["swarm.cache_size"]) or 1 << 30)
        # store.plan other than none: N rank stores in the engine's runtime layout (daemon/rank_stores.py)
        self.ranks: RankStores | None = rank_stores_for(cfg, self.journal_dir, self.engine_kind)

    # ------------------------------------------------------------ start-up

    def _lock_data_dir(self) -> None:
        """One daemon per data.dir, before the store, the journal or the socket is touched."""
        _acquire(self.lock, "data.dir")

    def _lock_store(self) -> None:
        """One daemon per store: a second one writing it (with its own journal) would corrupt what the
        engine serves.  Taken before the store is opened or created."""
        name = self.cfg.store_name
        try:
            self.store_lock = StoreLock(name, store_lock_path(name))
        except ValueError as e:
            raise DaemonError(f"store.name: {e}") from None
        _acquire(self.store_lock, "store.name")

    def _prepare_data_dir(self) -> None:
        d = self.cfg.data_dir
        try:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
            probe = d / ".write-probe"
            with open(probe, "wb") as fh:
                fh.write(b"\0" * 4096)
                fh.flush()
                os.fsync(fh.fileno())
            probe.unlink()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DaemonError(f"data.dir: {d} is full; the daemon needs room for its journal") from None
            raise DaemonError(f"data.dir: cannot write to {d}: {e.strerror}") from None

    def _open_store(self) -> None:
        """Re-attach to the store a previous daemon left (the engine may be serving from it).

        A journaled activation is finished or rolled back, then the contents are verified against
        the version the store claims before anything is reported or served.
        """
        self._check_store_config()
        if self.ranks is not None:
            try:
                open_rank_stores(self, self.ranks)
            except RankStartError as e:
                raise DaemonError(str(e)) from None
            return
        try:
            store = WeightStore.open(self.cfg.store_name)  # an engine buffer is re-imported if the engine lives
        except StoreMissingError:
            return
        except StoreError as e:
            raise DaemonError(f"store.name: {self.cfg.store_name}: {e}") from None
        if store.kind != (KIND_ENGINE_BUFFER if self.engine_kind else KIND_HOST):
            store.close()
            what = "an engine-buffer" if store.kind == KIND_ENGINE_BUFFER else "a host shared-memory"
            raise DaemonError(
                f"store.kind: {self.cfg.store_name} is {what} store, but store.kind is {self.cfg['store.kind']!r}: "
                "stop its engine and remove the store, or change store.name"
            )
        if store.data is None:
            log.info("store %s has no engine buffer (the engine is gone): %s", self.cfg.store_name, AWAITING_ENGINE)
            self.store = store
            return
        try:
            outcome = recover(store, self.journal_dir)  # verifies (and rolls back if it must)
        except StoreError as e:
            log.error("store recovery failed: %s; it will be reloaded", e)
            store.mark_failed()
            self.store = store
            return
        header = store.header()
        if header.state != StoreState.READY:
            self.store = store
            return
        # The shadow copy comes from the store itself; its digests (computed where the weights live,
        # on the GPU for a GPU store) double as the store's verification.
        digests = store.digests()
        root = state_root(store.layout.specs, digests)
        if root != header.root:
            log.error("store contents do not verify against version %s; it will be reloaded", header.version)
            store.mark_failed()
            self.store = store
            return
        model = store_model(store) if self.store_is_copy else store.read_model()
        self.shadow = Held(header.version, model, digests)
        self.store = store
        log.info(
            "store re-attached at version %s (%s)",
            header.version,
            outcome.action.name.lower(),
            extra={"version": header.version},
        )
        self.status.update(version=header.version, root=root.hex())

    async def start(self) -> None:
        self._lock_data_dir()
        tune_malloc()  # freed tensors and chunks go back to the system (daemon/shadow.py)
        raise_nofile_limit()  # soft to hard: the servers' connection caps assume the unit's LimitNOFILE
        limits = self.cfg.server_limits()
        try:
            tls = self.tls = self.cfg.tls()  # (a file that does not load: one line, the daemon does not start)
        except ConfigError as e:
            raise DaemonError(str(e)) from None
        for warning in self.cfg.warnings:  # unknown PATCHSWARM_* variables, TLS files with TLS off
            log.warning(warning)
        self._prepare_data_dir()
        state = PullState.load(self.state_path, self.cfg["swarm.run_id"])
        state.restore_into(self.trust)
        self._lock_store()
        self._open_store()
        api = make_api_app(
            self.status, lambda: self._layout_info(0), self._metrics_text, register_store=self._register_store,
            ranks=self.cfg["store.ranks"], rank_layout=self._layout_info,
        )  # fmt: skip
        try:
            self._runners.append(await serve_unix(api, self.cfg["api.socket"], self.cfg["api.group"], limits))
        except (PermissionError, SocketInUseError) as e:
            raise DaemonError(str(e)) from None
        self._socket_id = file_id(self.cfg["api.socket"])  # (no await since the bind: still ours)
        if self.cfg["sidecar.enabled"]:
            await self._start_sidecar(limits, tls if self.cfg["tls.sidecar"] else None)
        if self.cfg["metrics.listen"]:
            on_tls = tls.server_context() if tls is not None and self.cfg["tls.metrics"] else None
            listen = self.cfg["metrics.listen"]
            self._runners.append(await serve_metrics(self._metrics_text, listen, limits=limits, ssl_context=on_tls))
        host, port = self.cfg.listen("node.listen")
        advertise = self.cfg["node.advertise"]
        if advertise is None and host in ("0.0.0.0", "::"):
            advertise = f"{'https' if tls else 'http'}://{socket.getfqdn()}:{port}"
        node_cfg = NodeConfig(
            node_id=self.cfg.node_name,
            run_id=self.cfg["swarm.run_id"],
            cluster_secret=self.cfg.cluster_secret(),
            zone=self.cfg["node.zone"],
            region=self.cfg["node.region"],
            bootstrap=list(self.cfg["swarm.bootstrap"]),
            seed_urls=list(self.cfg["swarm.seed_urls"]),
            upload_rate=self.cfg["swarm.upload_rate"],
            download_rate=self.cfg["swarm.download_rate"],
            **swarm_budgets(self.cfg),
        )
        with bind_errors("node.listen", self.cfg["node.listen"]):
            self.node = await start_http_node(
                node_cfg,
                self.trust,
                host=host,
                port=port,
                advertise=advertise,
                held=self.shadow,
                rng=random.Random(),
                on_version=self._on_version,
                apply=self._decode_once,  # (in a thread: the API and the sidecar keep answering)
                limits=limits,
                tls=tls,
                chunks=self.chunks,
            )
        self.node.node.puller.tracker = state.tracker
        if self.status.phase != Phase.ERROR:
            self.status.update(phase=Phase.IDLE, **({"reason": AWAITING_ENGINE} if self._awaiting_engine() else {}))
        self._log_started()
        systemd.notify("READY=1", f"STATUS=serving version {self.status.version}")

    def _log_started(self) -> None:
        """One line with where everything listens, the store and the version held (fields as extras)."""
        fields: dict[str, Any] = {
            "listen": _bound(self.node.runner) if self.node is not None else None,
            "advertise": self.node.url if self.node is not None else None,
            "api_socket": self.cfg["api.socket"],
            "sidecar": self._servers[0].url if self._servers else "off",
            "metrics": self.cfg["metrics.listen"] or "off",
            "store_kind": self.cfg["store.kind"],
            "store": str(self.store.segment.path) if self.store is not None else f"{SHM_DIR}/{self.cfg.store_name}",
            "store_bytes": self.store.layout.nbytes if self.store is not None else int(self.cfg["store.size"]) or None,
            "data_dir": str(self.cfg.data_dir),
        }
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.info("started: %s version=%s", text, self.status.version, extra={**fields, "version": self.status.version})

    async def _start_sidecar(self, limits: ServerLimits, tls: TlsReloader | None) -> None:
        from patchswarm.daemon.sidecar import VersionGate, start_sidecar

        self.gate = VersionGate(applied=self.status.version or 0)  # versions start at 1: 0 means none yet
        host, port = self.cfg.listen("sidecar.listen")
        with bind_errors("sidecar.listen", self.cfg["sidecar.listen"]):
            server = await start_sidecar(
                self.cfg["sidecar.upstream"],
                self.gate,
                host=host,
                port=port,
                limits=limits,
                ssl_context=tls.server_context() if tls is not None else None,
            )
        self._servers.append(server)

    # ------------------------------------------------------------ activation

    @property
    def store_is_copy(self) -> bool:
        """A host store is the daemon's verified copy (no private shadow; docs/weightstore.md); rank
        stores hold runtime layouts, not the canonical model, so the daemon keeps its own copy."""
        return not self.engine_kind and self.ranks is None

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
        except TargetMismatchError:
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
        store.control.begin(StoreState.LOADING)
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
        self.status.update(
            phase=Phase.IDLE, version=held.version, root=state_root(held.model.specs, held.digests).hex()
        )
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
            try:
                await off_loop(self.store.load, whole.model, held.version, root)
            finally:
                if self.gate is not None:
                    hdr = self.store.header()
                    self.gate.end_activation(hdr.version if hdr.state == StoreState.READY else self.gate.applied)
            self.status.update(last_activation_pause_s=time.perf_counter() - start)
            self.metrics.applied.inc()
            return True
        updates = await off_loop(store_updates, self.shadow, held)  # decoded once (daemon/shadow.py)
        self._arm_fault_injection(self.store)
        in_place = self.gate is not None and self.cfg["sidecar.commit_mode"] == "in_place"
        if self.gate is not None:
            await self._drain_sidecar(self.cfg["sidecar.commit_mode"], held.version)
        self.status.update(phase=Phase.ACTIVATING)
        paused = False
        try:
            if in_place:
                # Unpinned requests stay in flight across the switch: the engine must hold them
                # between steps while the weights change (docs/sidecar.md, attribution guarantee).
                await self._engine_call(sglang_pause_generation("in_place"))
                paused = True
            stats = await off_loop(self.store.activate, held.version, root, updates, self.journal_dir)
        finally:
            if self.gate is not None:
                # Reopen at whatever the store now holds: the new version, or the old one on failure.
                self.gate.end_activation(self.store.header().version)
            if paused:  # resumed only after end_activation, so no request reports a version it did not see
                with contextlib.suppress(StoreError):
                    await self._engine_call(sglang_continue_generation())
        self.metrics.pause.observe(stats.pause_s)
        self.metrics.applied.inc()
        self.status.update(last_activation_pause_s=stats.pause_s)
        log.info("activated", extra={"version": held.version, "pause_s": round(stats.pause_s, 6)})
        return True

    async def _drain_sidecar(self, mode: str, version: int) -> None:
        """Close the sidecar's admission and wait for the requests in flight, for at most
        ``sidecar.drain_timeout``: one long generation must not hold admission closed (every other
        request 503) and the version back forever.  Past the deadline, or at shutdown, admission
        reopens on the old version and StoreError is raised before the store is touched; the swarm
        node retries the activation, with backoff."""
        if self._stopping:
            raise StoreError("activation abandoned: the daemon is stopping")
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

    async def _engine_call(self, req: EngineRequest) -> None:
        """One control call to the engine behind the sidecar (``sidecar.upstream``); StoreError if it fails."""
        url = self.cfg["sidecar.upstream"].rstrip("/") + req.path
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ENGINE_CALL_TIMEOUT_S)) as session,
                session.request(req.method, url, json=req.json, params=req.params) as resp,
            ):
                if resp.status >= 400:
                    raise StoreError(f"sidecar.upstream {req.path} answered {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise StoreError(
                f"sidecar.commit_mode 'in_place' needs the engine's {req.path} at sidecar.upstream: {describe(e)}"
            ) from e
        if req.path == "/pause_generation":
            log.info("engine paused for activation")

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

    # ------------------------------------------------------------ engine-allocated stores

    def _check_store_config(self) -> None:
        kind, dev = self.cfg["store.kind"], self.cfg["store.device"]
        self.rank_devices = [None] * self.cfg["store.ranks"]
        if kind != "cuda":
            if dev not in ("", "cpu"):
                raise DaemonError(f"store.device: {dev!r} needs store.kind = 'cuda' (store.kind is {kind!r})")
            return
        import torch

        if not torch.cuda.is_available():
            raise DaemonError("store.kind: 'cuda' needs CUDA in the daemon's process (torch.cuda.is_available() false)")
        try:
            self.device_uuid, self.rank_devices = store_gpus(self.cfg)
        except RankStartError as e:
            raise DaemonError(str(e)) from None

    def _awaiting_engine(self) -> bool:
        if self.ranks is not None:
            return self.engine_kind and any(s is not None and s.data is None for s in self.ranks.stores)
        return self.engine_kind and self.store is not None and self.store.data is None

    def _holds(self, version: int) -> bool:
        """Whether the store (every rank store) holds ``version``."""
        if self.ranks is not None:
            return self.ranks.common_version() == version
        return self.store is not None and self.store.header().state == StoreState.READY

    async def _register_store(self, body: Any, peer: int | None = None) -> tuple[int, dict[str, Any]]:
        """POST /v1/store: the engine gives the daemon its buffer; the current version is loaded into it.
        ``peer``: the pid of the registering process, watched from now on (daemon/exporter.py)."""
        if not self.engine_kind:
            msg = "store.kind is 'shm': the daemon allocates the store; attach with GET /v1/layout"
            return 409, {"error": "NotEngineStore", "message": msg}
        if self.ranks is not None:
            return await register_rank(self, self.ranks, body, peer)
        try:  # the one rank check (daemon/api.py): `False in (None, 0)` and 0.0 == 0 let those through here
            parse_rank(body.get("rank") if isinstance(body, dict) else None, 1)
        except ValueError:
            return 400, {"error": "BadRequest", "message": "rank must be 0: this daemon feeds one store"}
        if self.store is None:
            msg = "the daemon holds no version yet, so the store has no layout: register once GET /v1/layout answers"
            return 409, {"error": "NotReady", "message": msg}
        store = self.store
        try:
            engine, handle = check_registration(
                store.segment.name, store.layout, body, kind=self.cfg["store.kind"], device_uuid=self.device_uuid
            )
        except RegistrationError as e:
            return (400 if e.code == "BadRequest" else 422), {"error": e.code, "message": str(e)}
        async with self._activating:
            store.check_exporter()
            if store.buffer_id != handle["buffer_id"] or store.data is None:
                exporter = Exporter.of_pid(peer) if peer is not None else None
                if peer is not None and exporter is None:
                    return 422, {"error": "BadHandle", "message": f"the registering process {peer} is gone"}
                try:
                    store.attach_buffer(handle, exporter=exporter)  # a new buffer: EMPTY until loaded
                except StoreTooSmallError as e:
                    if exporter is not None:
                        exporter.close()
                    return 422, {"error": "BufferTooSmall", "message": f"the engine's buffer: {e}"}
                except (StoreError, ValueError, OSError) as e:  # a name or file that is no buffer: one line, no 500
                    if exporter is not None:
                        exporter.close()
                    return 422, {"error": "BadHandle", "message": f"cannot map the engine's buffer: {e}"}
                recover(store, self.journal_dir)  # a journal for an earlier buffer is void now
                self.status.update(version=None, root=None)
                log.info("engine %r registered buffer %x (%s)", engine, handle["buffer_id"], handle["kind"])
            hdr = store.header()
            loading = hdr.state != StoreState.READY and self.shadow is not None
            if loading:
                self._loading = asyncio.create_task(self._load_registered())
        state = "loading" if loading else ("ready" if hdr.state == StoreState.READY else "waiting_for_version")
        return 202 if loading else 200, {
            "engine": engine,
            "buffer_id": handle["buffer_id"],
            "state": state,
            "version": hdr.version if hdr.state == StoreState.READY else None,
            "target": self.shadow.version if self.shadow is not None else None,
        }

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

    # ------------------------------------------------------------ reporting

    def _layout_info(self, rank: int = 0) -> dict[str, Any] | None:
        if self.ranks is not None:
            return rank_layout(self.ranks, rank, self.engine_kind)
        if self.store is None:
            return None
        # An engine store is published before it holds a version: the engine allocates from it.
        if not self.engine_kind and self.store.header().state != StoreState.READY:
            return None
        return {"layout": self.store.layout.to_json(), "attach": self.store.attach_info()}

    def _metrics_text(self) -> bytes:
        # Status and metrics as of this scrape, together: a metric (say, run halted) must never be ahead
        # of the status a client reads right after it.
        self._refresh()
        return self.metrics.render()

    def _refresh(self) -> None:
        if self.tls is not None:
            self.metrics.tls_expiry.labels(file=str(self.tls.files.cert)).set(self.tls.not_after)
        if self.node is None:
            return
        n = self.node.node
        head_version = n.head.version if n.head else None
        progress = [(s.have.count(), s.have.n) for s in n.partial.values()]
        done = sum(p[0] for p in progress)
        total = sum(p[1] for p in progress)
        changes: dict[str, Any] = {
            "target": head_version,
            "chunks_done": done,
            "chunks_total": total,
            "peers": [
                {"node": v.info.node_id, "addr": v.info.addr, "zone": v.info.zone, "version": v.ann.version}
                for v in n.peers.values()
            ],
            "held_versions": [n.held.version] if n.held else [],
        }
        if self.status.phase in (Phase.IDLE, Phase.FETCHING) and not self._activating.locked():
            if n.phase == "fetching":
                changes["phase"] = Phase.FETCHING
            elif n.phase == "idle" and self.status.phase == Phase.FETCHING:
                changes["phase"] = Phase.IDLE
        if n.error and self.status.phase == Phase.IDLE and head_version != self.status.version:
            changes["reason"] = n.error + _retrying(n.failures)
        elif self.status.phase == Phase.ERROR and self._failed_because and n.failures:
            changes["reason"] = self._failed_because + _retrying(n.failures)  # (the node retries, with backoff)
        frozen_ms = n.puller.stats.frozen_since_ms if n.head_error else None
        changes["head_expired_since"] = None if frozen_ms is None else frozen_ms / 1000
        if frozen_ms is not None and self.status.phase == Phase.IDLE:
            # One line, the same at every poll: the engine keeps the last verified version meanwhile.
            changes["reason"] = f"{HEAD_REFUSED}: board frozen since {utc_text(frozen_ms)} (the newest head expired)"
        elif n.head_error and self.status.phase == Phase.IDLE:
            changes["reason"] = f"{HEAD_REFUSED}: {n.head_error}"
        elif "reason" not in changes and (self.status.reason or "").startswith(HEAD_REFUSED):
            changes["reason"] = None
        # (never while an activation holds the lock: it checks the engine itself, before writing)
        watched = [s for s in self.ranks.stores if s is not None] if self.ranks is not None else [self.store]
        if self.engine_kind and not self._activating.locked():
            for store in watched:
                if store is not None:
                    store.check_exporter()
        died = next((s.released_because for s in watched if s is not None and s.released_because), None)
        if self._awaiting_engine() and self.status.phase in (Phase.IDLE, Phase.FETCHING):
            changes["reason"] = f"{died}; {AWAITING_ENGINE}" if died else AWAITING_ENGINE
            if died and self.status.version is not None:
                changes.update(version=None, root=None)
        if n.puller.tracker.halted:  # equivocation: the engine keeps its version, the operator must act
            changes.update(phase=Phase.ERROR, reason=f"run halted: {n.puller.tracker.halted}")
        if self.ranks is not None:
            changes["ranks"] = self.ranks.entries()
        self.status.update(**changes)
        if self.gate is not None and head_version is not None:
            self.gate.set_target(head_version)
        self.metrics.sync(n.metrics, self.status.version, head_version, swarm=n)

    async def run_until(self, stop: asyncio.Event, why: list[str] | None = None) -> None:
        interval = systemd.watchdog_interval()
        watchdog = asyncio.create_task(systemd.watchdog_loop(interval)) if interval else None
        try:
            while not stop.is_set():
                self._refresh()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)
        finally:
            if watchdog:
                watchdog.cancel()
            await self.shutdown(why[-1] if why else "stopped")

    async def shutdown(self, reason: str = "stopped") -> None:
        if not self.lock.held:
            return  # another daemon holds data.dir: its socket and store are not this process's to touch
        systemd.notify("STOPPING=1")
        self.status.update(phase=Phase.STOPPING)
        self._stopping = True
        if self._loading is not None:
            self._loading.cancel()  # a load into a just-registered buffer not begun yet: the next start does it
        if self._drain is not None:
            self._drain.cancel()  # a drain may wait on a request that never ends: admission reopens, nothing written
        async with self._activating:  # an activation in progress finishes first; staging is abandoned
            if self.node is not None:
                await self.node.stop()
                self._persist_state()
            for srv in self._servers:
                await srv.close()
            for r in self._runners:
                await r.cleanup()
            sock = Path(self.cfg["api.socket"])
            if self._socket_id is not None and file_id(sock) == self._socket_id:
                # Only the socket this process bound: one a later daemon bound in its place is not ours.
                with contextlib.suppress(OSError):
                    sock.unlink()
            if self.store is not None:
                self.store.close()
            if self.ranks is not None:
                self.ranks.close()
            self.chunks.close()
        version = self.shadow.version if self.shadow is not None else None
        log.info("stopped: reason=%s version=%s", reason, version, extra={"reason": reason, "version": version})
        if self.store_lock is not None:
            self.store_lock.release()
        self.lock.release()


async def run_daemon(cfg: DaemonConfig) -> None:
    daemon = RolloutDaemon(cfg)
    stop = asyncio.Event()
    why: list[str] = []  # the signal that stopped it, for the last log line
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        why.append(sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, reload_tls, lambda: daemon.tls)
    try:
        await daemon.start()
    except (DaemonError, ConfigError, StoreError, OSError) as e:
        await daemon.shutdown(f"start-up failed: {e}")
        raise
    await daemon.run_until(stop, why)


def reload_tls(current: Callable[[], TlsReloader | None]) -> None:
    """SIGHUP: look at the TLS files now rather than at the next reload interval (never a stop)."""
    tls = current()
    if tls is None:
        log.info("SIGHUP: TLS is off, nothing to reload")
    elif not tls.reload():
        log.info("SIGHUP: TLS files unchanged (or not loadable: see the warning), kept")


def _acquire(lock: FileLock, key: str) -> None:
    """Take one of the daemon's exclusive locks, or DaemonError naming the config key it guards."""
    try:
        lock.acquire()
    except InstanceLockedError as e:
        raise DaemonError(str(e)) from None
    except OSError as e:
        raise DaemonError(f"{key}: cannot lock {lock.path}: {e.strerror}") from None


def _retrying(failures: int) -> str:
    return f" (retrying: {failures} failed in a row)" if failures else ""


def _bound(runner: Any) -> str:
    """The addresses a runner's sites are bound to (the real port when the config said :0)."""
    out = []
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            host, port = addr[0], addr[1]
            out.append(f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}")
        else:
            out.append(str(addr))
    return ",".join(out)

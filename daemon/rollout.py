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
import logging
import os
import random
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchswarm.daemon import systemd
from patchswarm.daemon.api import SocketInUseError, file_id, make_api_app, serve_unix
from patchswarm.daemon.config import ConfigError, DaemonConfig
from patchswarm.daemon.config_values import bind_errors
from patchswarm.daemon.engine import SHM_DIR, store_lock_path
from patchswarm.daemon.engine_drivers import make_driver
from patchswarm.daemon.instance_lock import FileLock, InstanceLock, InstanceLockedError, StoreLock
from patchswarm.daemon.journal import recover
from patchswarm.daemon.metrics import DaemonMetrics, serve_metrics
from patchswarm.daemon.pull_state import PullState
from patchswarm.daemon.rank_rollout import FAULT_ENV as FAULT_ENV  # (named here too: crash tests set it)
from patchswarm.daemon.rank_rollout import (
    RankStartError,
    open_rank_stores,
    rank_stores_for,
    store_gpus,
)
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.rollout_activation import AWAITING_ENGINE
from patchswarm.daemon.rollout_api import ApiAnswers
from patchswarm.daemon.shadow import (
    store_model,
    tune_malloc,
)
from patchswarm.daemon.status import Phase, Status
from patchswarm.daemon.store_buffer import ENGINE_BUFFER_KINDS
from patchswarm.daemon.store_format import (
    KIND_ENGINE_BUFFER,
    KIND_HOST,
    StoreError,
    StoreMissingError,
    StoreState,
)
from patchswarm.daemon.user_error import UserError
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import load_public_key
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.scheduler_types import SchedulerConfig
from patchswarm.protocol.served import state_root
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.server import RunningNode, start_http_node
from patchswarm.swarm.serving import ServerLimits, raise_nofile_limit
from patchswarm.swarm.spool import SpoolChunkStore
from patchswarm.swarm.tls import TlsReloader

log = logging.getLogger("patchswarm.daemon")


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


class RolloutDaemon(ApiAnswers):
    """The rollout-host process: start-up, the run loop and shutdown here; version activation in
    daemon/rollout_activation.py, what the API answers in daemon/rollout_api.py."""

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
        # The engine this daemon drives (engine.kind; daemon/engine_drivers.py): only a version it
        # acknowledged is reported as served (status served_version, the sidecar's gate).
        try:
            self.driver = make_driver(cfg, lambda: self.status.version)
        except UserError as e:
            raise DaemonError(str(e)) from None
        self.served: int | None = None
        self._behind: str | None = None
        self._recommit: asyncio.Task[None] | None = None
        self._holding = self._held_paused = False

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
        await self._engine_start()  # (before the sidecar: its gate opens on the version the engine serves)
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
        from patchswarm.daemon.sidecar import start_sidecar
        from patchswarm.daemon.sidecar_gate import VersionGate

        self.gate = VersionGate(applied=self.served or 0)  # versions start at 1: 0 means none yet
        host, port = self.cfg.listen("sidecar.listen")
        with bind_errors("sidecar.listen", self.cfg["sidecar.listen"]):
            server = await start_sidecar(
                self.cfg["sidecar.upstream"],
                self.gate,
                host=host,
                port=port,
                limits=limits,
                ssl_context=tls.server_context() if tls is not None else None,
                allow_routes=self.cfg["sidecar.allow_routes"],
            )
        self._servers.append(server)
        await self._hold_if_behind()

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

    # ------------------------------------------------------------ running and stopping

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
        await self._engine_stop()  # a commit retry waiting for the engine is given up (the next start asks again)
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

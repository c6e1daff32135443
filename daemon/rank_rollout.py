"""The rollout daemon's side of rank stores (store.plan other than none): start-up recovery, activation
of a version across the ranks, engine buffer registration per rank, per-rank layout and status.

Kept apart from daemon/rollout.py, which calls these with itself as ``host``; the stores and the
activation order are daemon/rank_stores.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from patchswarm.daemon.config import DaemonConfig
from patchswarm.daemon.engine_driver import Activation
from patchswarm.daemon.engine_drivers import copies_regions
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.prepared import abandon_on_error
from patchswarm.daemon.rank_plans import PlanRefused, read_plan_file, resolve_plan
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.shadow import StagedVersion, store_updates
from patchswarm.daemon.status import Phase, Status
from patchswarm.daemon.store_buffer import RegistrationError, check_registration
from patchswarm.daemon.store_format import StoreError, StoreState, StoreTooSmallError, TensorUpdate
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.held import Held
from patchswarm.protocol.layout_inverse import routing_for, routing_to_json
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.sparse_apply import WordChange, commit

log = logging.getLogger("patchswarm.daemon")
FAULT_ENV = "PATCHSWARM_FAULT_AT"  # crash tests: SIGKILL at this point (daemon/rank_stores.py names them)


class RankHost(Protocol):
    """What these functions use of the rollout daemon (daemon/rollout.py ``RolloutDaemon``)."""

    cfg: DaemonConfig
    status: Status
    metrics: DaemonMetrics
    gate: Any
    served: int | None
    driver: Any
    shadow: Held | None
    journal_dir: Path
    rank_devices: list[str | None]

    _activating: asyncio.Lock
    _loading: asyncio.Task[None] | None

    async def _drain_sidecar(self, mode: str, version: int) -> None: ...

    async def _load_registered(self) -> None: ...

    def _activation(self, version: int, *, full: bool, regions: Any = None) -> Activation: ...

    async def _engine_pause(self) -> None: ...

    async def _engine_commit(self, activation: Activation) -> int | None: ...

    async def _end_activation(self, ack: int | None, *, attempted: bool, paused: bool) -> None: ...


class RankStartError(Exception):
    """A rank store the daemon cannot start with (one line naming the config key)."""


def rank_stores_for(cfg: DaemonConfig, journal_dir: Path, engine_kind: bool) -> RankStores | None:
    """The daemon's rank stores (store.plan other than none), or None: one store of the canonical model."""
    if cfg["store.plan"] == "none":
        return None
    return RankStores(
        cfg.store_name, cfg["store.ranks"], journal_dir, engine_kind=engine_kind, group=cfg["api.group"],
        capacity=int(cfg["store.size"]),
    )  # fmt: skip


def store_gpus(cfg: DaemonConfig) -> tuple[str | None, list[str | None]]:
    """store.kind cuda: the GPU of store.device and of each rank (store.devices), as UUIDs; None: any GPU."""
    one = gpu_uuid("store.device", cfg["store.device"])
    devices = cfg["store.devices"]
    per_rank = [gpu_uuid("store.devices", d) for d in devices] if devices else [one]
    return one, per_rank + [None] * (cfg["store.ranks"] - len(per_rank))


def gpu_uuid(key: str, dev: str) -> str | None:
    """The UUID of a GPU named in the config (cuda:N as this process sees it, or GPU-<uuid>); None: any."""
    import torch

    if dev.lower().startswith("gpu-"):
        return dev
    if dev.startswith("cuda:"):
        index, count = int(dev[5:]), torch.cuda.device_count()
        if index >= count:
            raise RankStartError(f"{key}: {dev}, but this process sees {count} GPU(s)")
        return str(torch.cuda.get_device_properties(index).uuid)
    if dev:
        raise RankStartError(f"{key}: {dev!r} is not a GPU for store.kind 'cuda' (use cuda:N or GPU-<uuid>)")
    return None


def open_rank_stores(host: RankHost, ranks: RankStores) -> None:
    """Start-up: re-attach every rank store a previous daemon left and bring them to one version.

    A journal is rolled forward (or back) on every rank; each rank's root is verified where its
    weights live.  The host's version is the one every rank holds (None when any needs a load).
    """
    setting = host.cfg["store.plan"]
    if "/" in setting:
        try:
            ranks.plan_file = read_plan_file(setting)
        except PlanRefused as e:
            raise RankStartError(str(e)) from None
    try:
        ranks.open_existing()
    except StoreError as e:
        raise RankStartError(f"store.name: {e}") from None
    version = ranks.recover()
    host.status.update(ranks=ranks.entries())
    if version is None:
        return
    log.info("rank stores re-attached at version %s (%d ranks)", version, len(ranks), extra={"version": version})
    host.status.update(version=version)  # (the canonical root comes with the shadow, once fetched)


async def activate_ranks(host: RankHost, ranks: RankStores, held: Held, off_loop: Any) -> bool:
    """Make every rank serve ``held``; False while an engine rank has no buffer to write into yet.

    The plan is resolved and checked against the model before any store is created or written.
    """
    if not isinstance(held, StagedVersion):
        return await _activate_ranks(host, ranks, held, held.model, None, off_loop)
    # A patch decoded once (daemon/shadow.py): the rank digests and any whole load need the new
    # canonical model, so its changes go into the daemon's canonical copy first (no second copy of
    # the model; absolute values, so this is undone exactly if the activation fails).
    changes = held.changes
    updates = store_updates(host.shadow, held)  # (checks the version was decoded against this copy)
    await off_loop(commit, held.model, changes)
    try:
        done = await _activate_ranks(host, ranks, held, held.model, updates, off_loop)
    except BaseException:
        await off_loop(commit, held.model, [WordChange(c.index, c.positions, c.old, c.new) for c in changes])
        raise
    held.changes = []  # (laid in already: settle has nothing left to write)
    return done


async def _activate_ranks(
    host: RankHost,
    ranks: RankStores,
    held: Held,
    model: ServedModel,
    staged: list[TensorUpdate] | None,
    off_loop: Any,
) -> bool:
    if ranks.canonical != model.specs:
        plan = resolve_plan(host.cfg["store.plan"], len(ranks), model.specs, model.metadata, ranks.plan_file)
        await off_loop(ranks.prepare, plan, model.specs)
        host.status.update(ranks=ranks.entries())
    common = ranks.common_version()
    if common is not None and common > held.version:
        # Restarted with every rank at a newer version than the swarm hands over first (it catches up
        # from an anchor): never move the engine back; the shadow follows until it reaches them.
        await off_loop(lambda: ranks.apply(held.version, model, None, write=False))
        return False
    updates = staged
    if host.shadow is held:
        updates = []  # (a rank registered a new buffer: it is loaded, the others hold the version)
    elif updates is None and host.shadow is not None and host.shadow.model.specs == model.specs:
        updates = await off_loop(store_updates, host.shadow, held)  # (another model: an anchor)
    ranks.arm_faults(os.environ.get(FAULT_ENV))
    mode = host.cfg["sidecar.commit_mode"] if updates is not None else "quiesce"
    in_place = host.gate is not None and mode == "in_place"
    # Routed, hashed, staged and journaled (fsync) while the engine serves: only the writes, the
    # commit and the resume sit inside the pause.  Abandoned (journal removed) if the drain or pause fails.
    prepared = await off_loop(ranks.prepare_apply, held.version, model, updates)
    assert prepared is not None
    with abandon_on_error(prepared):
        if host.gate is not None:
            await host._drain_sidecar(mode, held.version)
        host.status.update(phase=Phase.ACTIVATING)
        paused = attempted = False
        ack = stats = None
        start = time.perf_counter()
        try:
            if in_place:
                await host._engine_pause()
                paused = True
            stats = await off_loop(ranks.finish_apply, prepared)
            if ranks.common_version() == held.version:  # (else a rank waits for its buffer: committed once loaded)
                # Whole when every rank was loaded, or the engine missed a version (its regions are not these).
                full = updates is None or stats is None or host.served != common
                regions = ranks.written_regions() if not full and copies_regions(host.driver) else None
                attempted = True
                ack = await host._engine_commit(host._activation(held.version, full=full, regions=regions))
        finally:  # the engine's acknowledged version (or kept closed: daemon/rollout_engine.py)
            await host._end_activation(ack, attempted=attempted, paused=paused)
            host.status.update(ranks=ranks.entries())
    pause = stats.total_pause_s if stats is not None else time.perf_counter() - start
    host.metrics.applied.inc()
    host.metrics.pause.observe(pause)
    host.status.update(last_activation_pause_s=pause)
    if stats is not None:
        log.info("activated on %d ranks", len(ranks), extra={"version": held.version, "pause_s": round(pause, 6)})
    return ranks.common_version() == held.version


def rank_layout(ranks: RankStores, rank: int, engine_kind: bool) -> dict[str, Any] | None:
    """GET /v1/layout?rank=K: that rank store's layout and attach info (None: not ready)."""
    store = ranks.store(rank)
    if store is None:
        return None
    if not engine_kind and store.header().state != StoreState.READY:
        return None
    answer = {"rank": rank, "ranks": len(ranks), "layout": store.layout.to_json(), "attach": store.attach_info()}
    # The plan's routing of the rank's entries: a copy engine's loader then takes the canonical tensors
    # an entry it cannot copy comes from (protocol/layout_inverse.py); left out past its bound.
    if ranks.plan is not None and ranks.canonical is not None:
        try:
            routing = routing_for(ranks.plan, ranks.canonical, rank, ranks.plan.params[rank])
            answer["routing"] = routing_to_json(routing)
        except PlanError:
            pass
    return answer


def check_rank_registration(host: RankHost, ranks: RankStores, body: Any) -> tuple[int, dict[str, Any]] | int:
    """POST /v1/store with "rank": the rank, or the (status, answer) refusing it."""
    from patchswarm.daemon.api import parse_rank

    raw = body.get("rank") if isinstance(body, dict) else None
    try:
        rank = parse_rank(raw, len(ranks))
    except ValueError as e:
        return 400, {"error": "BadRequest", "message": str(e)}
    store = ranks.store(rank)
    if store is None:
        msg = "the daemon holds no version yet, so the store has no layout: register once GET /v1/layout answers"
        return 409, {"error": "NotReady", "message": msg}
    try:
        check_registration(
            store.segment.name, store.layout, body, kind=host.cfg["store.kind"], device_uuid=host.rank_devices[rank]
        )
    except RegistrationError as e:
        return (400 if e.code == "BadRequest" else 422), {"error": e.code, "message": str(e)}
    return rank


def attach_rank_buffer(
    host: RankHost, ranks: RankStores, rank: int, body: dict[str, Any], peer: int | None = None
) -> dict[str, Any] | None:
    """Map a registered rank buffer (under the activation lock); an error answer, or None when attached.
    ``peer``: the pid of the registering engine, watched from now on (daemon/exporter.py)."""
    store = ranks.store(rank)
    assert store is not None
    handle = body["buffer"]
    if store.buffer_id == handle["buffer_id"] and store.data is not None:
        return None
    exporter = Exporter.of_pid(peer) if peer is not None else None
    if peer is not None and exporter is None:
        return {"error": "BadHandle", "message": f"the registering process {peer} is gone"}
    try:
        store.attach_buffer(handle, exporter=exporter)  # a new buffer: EMPTY until loaded
    except StoreTooSmallError as e:
        return {"error": "BufferTooSmall", "message": f"the engine's buffer: {e}"}
    except (StoreError, ValueError, OSError) as e:
        return {"error": "BadHandle", "message": f"cannot map the engine's buffer: {e}"}
    host.status.update(version=None, root=None, ranks=ranks.entries())  # until every rank holds it again
    log.info("engine %r registered rank %d buffer %x (%s)", body["engine"], rank, handle["buffer_id"], handle["kind"])
    return None


async def register_rank(
    host: RankHost, ranks: RankStores, body: Any, peer: int | None = None
) -> tuple[int, dict[str, Any]]:
    """POST /v1/store with "rank": one rank's buffer; that rank is loaded as soon as it is registered."""
    rank = check_rank_registration(host, ranks, body)
    if isinstance(rank, tuple):
        return rank
    async with host._activating:
        refused = attach_rank_buffer(host, ranks, rank, body, peer)
        if refused is not None:
            return 422, refused
        store = ranks.store(rank)
        assert store is not None
        hdr = store.header()
        loading = hdr.state != StoreState.READY and host.shadow is not None
        if loading:
            host._loading = asyncio.create_task(host._load_registered())
    state = "loading" if loading else ("ready" if hdr.state == StoreState.READY else "waiting_for_version")
    return 202 if loading else 200, {
        "engine": body["engine"],
        "rank": rank,
        "buffer_id": body["buffer"]["buffer_id"],
        "state": state,
        "version": hdr.version if hdr.state == StoreState.READY else None,
        "target": host.shadow.version if host.shadow is not None else None,
    }

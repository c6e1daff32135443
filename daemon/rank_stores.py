"""Rank stores: one daemon feeding N weight stores, one per tensor-parallel rank (docs/weightstore.md section 10).

The daemon keeps one canonical host shadow (Hugging Face tensor names); a layout plan maps it to
each rank's runtime parameters (protocol/layout_plan.py).  Every rank store is a ``WeightStore``
holding only its rank's parameters.  A version is applied to the ranks as one activation:

1. the canonical sparse updates are routed to ranks (slot, positions, new, old) and every rank
   stages them on its device, before any fence moves;
2. one journal (daemon/journal.py format 2) holding every rank's writes is written and fsynced;
3. rank by rank: fence odd, scatter, gather-compare, publish that rank's version (each rank
   writes inside its own fence; an engine's rank k observes only rank k's fence);
4. the journal is removed.  The host's version (status, the sidecar gate, /v1/wait) moves only
   once every rank holds the version.

A kill -9 anywhere leaves a journal that ``journal.recover_ranks`` rolls forward on every rank (or
back on every rank), so after a restart all ranks hold one version.  Store names: ``<store.name>``
for one rank (existing deployments keep their store), ``<store.name>.r<k>`` for N > 1.  The plan is
resolved in daemon/rank_plans.py; steps 2 and 3 are daemon/rank_activation.py.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchswarm.daemon import journal
from patchswarm.daemon.engine import SHM_DIR, SharedSegment
from patchswarm.daemon.engine_driver import Region
from patchswarm.daemon.engine_regions import store_regions, whole_regions
from patchswarm.daemon.rank_activation import PreparedRanks, RankHashing, RanksApplied, stage_ranks, write_ranks
from patchswarm.daemon.rank_plans import PlanRefused
from patchswarm.daemon.store_format import (
    KIND_ENGINE_BUFFER,
    KIND_HOST,
    StoreError,
    StoreLayout,
    StoreMissingError,
    StoreState,
    StoreStateError,
    StoreTooSmallError,
    TensorUpdate,
)
from patchswarm.daemon.store_updates import torch_threads
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_digest import RankDigests
from patchswarm.protocol.layout_file import PlanFile
from patchswarm.protocol.layout_flat import FlatRouter, RankChanges
from patchswarm.protocol.layout_plan import LayoutPlan, rank_model
from patchswarm.protocol.layout_route import Router, SlotChange
from patchswarm.protocol.served import ServedModel, TensorSpec, state_root

log = logging.getLogger("patchswarm.store")


def rank_store_names(base: str, ranks: int) -> list[str]:
    """``base`` for one rank (an existing deployment keeps its store), ``base.r<k>`` otherwise."""
    return [base] if ranks == 1 else [f"{base}.r{k}" for k in range(ranks)]


def _kill_at(point: str) -> Callable[[str], None]:
    def fault(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def _no_fault(point: str) -> None:
    pass


class RankStores:
    """The daemon's N rank stores (``stores[k]`` is None until created); the caller serialises calls."""

    def __init__(
        self, base_name: str, ranks: int, journal_dir: Path, *, engine_kind: bool, group: str = "", capacity: int = 0
    ) -> None:
        self.journal_dir = journal_dir
        self.names = rank_store_names(base_name, ranks)
        self.engine_kind = engine_kind
        self.group = group
        self.capacity = capacity  # store.size, per rank store (0: exactly the rank's parameters)
        self.stores: list[WeightStore | None] = [None] * ranks
        self.plan: LayoutPlan | None = None
        self.canonical: list[TensorSpec] | None = None  # the model specs the plan was prepared for
        self.plan_file: PlanFile | None = None  # store.plan as a plan file (read at start-up)
        self.router: Router | None = None
        self.roots: list[bytes | None] = [None] * ranks  # each rank's root of the version the host holds
        # What the last apply wrote: the ranks written in place (with their routed changes) and those
        # loaded whole, for written_regions() (kept as routed: only a copy engine needs the regions).
        self._written: tuple[dict[int, list[SlotChange] | RankChanges], list[int]] = ({}, [])
        # ... and its runtime parameters' digests: a version applied in place re-hashes only the
        # parameters its changes reach (protocol/layout_digest.py), never the whole rank
        self.digests: list[list[bytes] | None] = [None] * ranks
        self.digester: RankDigests | None = None
        # the changes routed in one pass into each rank store's words (None: this plan or these stores
        # cannot be: ``router`` hands each rank one change per parameter) and each slot's first word
        self.flat: FlatRouter | None = None
        self.bases: list[list[int]] = []
        # the last apply's phases, seconds (benchmarks/rank_bench.py prints them)
        self.phases: dict[str, float] = {}
        # Crash tests: called at "journal_tmp", "journaled", "between_ranks", "all_flipped"; store
        # points are "rank<k>:<point>" (odd, mid_write, written, flipped, loading).
        self.fault: Callable[[str], None] = _no_fault

    def __len__(self) -> int:
        return len(self.names)

    def arm_faults(self, point: str | None) -> None:
        """Crash tests only: SIGKILL this process when an activation reaches ``point``."""
        if not point:
            return
        self.fault = _kill_at(point)

    # ------------------------------------------------------------ start-up

    def open_existing(self) -> None:
        """Re-attach to the rank stores a previous daemon left (engine buffers re-imported if alive)."""
        want = KIND_ENGINE_BUFFER if self.engine_kind else KIND_HOST
        for k, name in enumerate(self.names):
            try:
                store = WeightStore.open(name)
            except StoreMissingError:
                continue
            except StoreError as e:
                raise StoreError(f"rank {k} store {name}: {e}") from None
            if store.kind != want:
                store.close()
                what = "an engine-buffer" if store.kind == KIND_ENGINE_BUFFER else "a host shared-memory"
                raise StoreError(
                    f"store.kind: {name} (rank {k}) is {what} store of another store.kind: "
                    "stop its engine and remove the store, or change store.name"
                )
            self.stores[k] = store

    def recover(self) -> int | None:
        """Finish or undo a journaled activation on every rank and verify what each holds.

        Returns the version every rank holds (verified), or None when a load is needed first.
        A rank whose engine is gone, or missing, cannot take part: the others are then reloaded
        too (a journal cannot be finished on part of the ranks)."""
        present = [s for s in self.stores if s is not None and s.data is not None]
        if len(present) != len(self):
            for s in present:
                s.mark_failed()
            journal.remove_journal(self.journal_dir)
            return None
        try:
            journal.recover_ranks(present, self.journal_dir)
        except StoreError as e:
            log.error("rank store recovery failed: %s; every rank will be reloaded", e)
            for s in present:
                s.mark_failed()
            journal.remove_journal(self.journal_dir)
            return None
        return self.common_version()

    def common_version(self) -> int | None:
        """The version every rank store holds (READY, fence closed), or None."""
        versions = set()
        for s in self.stores:
            if s is None or s.data is None:
                return None
            h = s.header()
            if h.state != StoreState.READY or not h.stable:
                return None
            versions.add(h.version)
        return versions.pop() if len(versions) == 1 else None

    # ------------------------------------------------------------ layouts

    def prepare(self, plan: LayoutPlan, canonical: list[TensorSpec]) -> None:
        """Check the plan against the model, then make every rank store exist with its rank's layout.

        Everything is checked before any store is created or written: a bad plan, a world size that
        is not store.ranks, or a rank larger than store.size is refused (PlanRefused/StoreTooSmallError)
        with nothing touched.  An existing host store laid out for another plan or world size is
        recreated (one log line); an engine store is refused (its engine allocated for that layout).
        """
        if plan.world != len(self):
            raise PlanRefused(f"store.plan: the plan is for {plan.world} ranks, store.ranks is {len(self)}")
        try:
            plan.check(canonical)
            router = Router(plan, canonical)
        except (PlanError, ValueError) as e:
            raise PlanRefused(f"store.plan: {e}") from None
        layouts = [StoreLayout.from_specs(plan.rank_specs(k)) for k in range(len(self))]
        for lay in layouts:
            if self.capacity and lay.nbytes > self.capacity:
                raise StoreTooSmallError(lay.nbytes, self.capacity)
        stale = [k for k, s in enumerate(self.stores) if s is not None and s.layout.specs != layouts[k].specs]
        if stale and self.engine_kind:
            k = stale[0]
            raise StoreError(
                f"store.name: {self.names[k]} (rank {k}) is laid out for another plan or world size: stop its "
                "engine and remove the store, or change store.name"
            )
        for k in stale:
            old = self.stores[k]
            assert old is not None
            log.warning(
                "rank store %s (rank %d) was laid out for another plan or world size (%d tensors, %d bytes; "
                "this plan: %d tensors, %d bytes): recreated",
                self.names[k], k, len(old.layout.slots), old.layout.nbytes, len(layouts[k].slots), layouts[k].nbytes,
            )  # fmt: skip
            old.destroy()
            self.stores[k] = None
            self.roots[k] = None
        for k, lay in enumerate(layouts):
            if self.stores[k] is None:
                # (open_existing found no store by this name, or a segment whose creation never finished)
                SharedSegment.path_for(self.names[k], SHM_DIR).unlink(missing_ok=True)
                cap = None if self.engine_kind or not self.capacity else self.capacity
                self.stores[k] = WeightStore.create(
                    self.names[k], lay, capacity=cap, engine_buffer=self.engine_kind, group=self.group
                )
        self.plan, self.router, self.canonical = plan, router, list(canonical)
        self.digester = RankDigests(plan, canonical)
        self.flat, self.bases = None, []
        bases = [lay.word_bases() for lay in layouts]
        if all(b is not None for b in bases):
            self.bases = [b for b in bases if b is not None]
            self.flat = FlatRouter.compile(router, self.bases)
        self.digests = [None] * len(self)

    def store(self, rank: int) -> WeightStore | None:
        return self.stores[rank]

    # ------------------------------------------------------------ writing

    def apply(
        self, version: int, model: ServedModel, updates: list[TensorUpdate] | None, *, write: bool = True
    ) -> RanksApplied | None:
        """``finish_apply(prepare_apply(...))``: make every rank that has a buffer hold ``version``."""
        prepared = self.prepare_apply(version, model, updates, write=write)
        return None if prepared is None else self.finish_apply(prepared)

    def prepare_apply(
        self, version: int, model: ServedModel, updates: list[TensorUpdate] | None, *, write: bool = True
    ) -> PreparedRanks | None:
        """Everything of ``apply`` before the first byte a rank's engine reads changes: routing, the
        ranks' roots, staging, the journal (fsynced).  Serving goes on; the daemon prepares before it
        drains the sidecar or pauses the engine, then calls ``finish_apply`` or ``abandon`` on it
        (daemon/prepared.py).  None when ``write`` is False.

        ``apply``: make every rank that has a buffer hold ``version`` (canonical ``model``).

        Ranks READY at the version the host held take ``updates`` (canonical sparse updates, shadow
        -> model) in place under one journal; the others (EMPTY, FAILED, never loaded) are loaded
        whole.  ``updates`` None: every rank is loaded whole unless it holds the version already.
        ``write`` False: nothing is written, only each rank's root of ``version`` is remembered.
        The roots are updated from ``updates``, so they must lead from the model of the previous call
        (the shadow) to ``model``, as the stores' contents must.
        Returns the in-place activation's figures, or None when there was none.
        """
        plan, router, digester = self.plan, self.router, self.digester
        assert plan is not None and router is not None and digester is not None, "prepare first"
        # Routed once for every rank; each rank's root from its previous digests and the parameters
        # the changes reach (a rank without previous digests is hashed whole, from ``model``).
        # One torch thread: these are many small copies, which a second OpenMP thread on a busy host
        # slows down (a strided copy of 0.7 MB: 0.1 ms on one thread, 8 ms on two of two shared cores).
        routed: list[list[SlotChange]] | list[RankChanges] | None = None
        digests: list[list[bytes]] = []
        t0 = time.perf_counter()
        with torch_threads(1):
            # The parameters to hash again: those any changed canonical tensor feeds (the exact set
            # the routing reaches, but for a piece whose own region saw no change: hashed again,
            # its digest the same), so that hashing starts before the routing and runs beside it.
            changed = {u.slot for u in updates} if updates is not None else set()
            jobs: list[tuple[int, int]] = []
            for k in range(len(self)):
                prev = self.digests[k]
                if updates is not None and prev is not None:
                    digests.append(list(prev))
                    jobs += [(k, i) for i, sources in enumerate(digester.sources[k]) if not sources.isdisjoint(changed)]
                else:
                    digests.append([b""] * len(digester.params[k]))
                    jobs += [(k, i) for i in range(len(digester.params[k]))]
            hashing = RankHashing(digester, model, jobs)
            try:
                if updates is not None:
                    changes = [SlotChange(u.slot, u.positions, u.new, u.old) for u in updates]
                    routed = self.flat.route(changes) if self.flat is not None else None
                    if routed is None:
                        routed = router.route(changes)
            finally:
                t1 = time.perf_counter()
                hashed = hashing.finish()
            for (k, i), d in zip(jobs, hashed, strict=True):
                digests[k][i] = d
            roots = [digester.root(k, d) for k, d in enumerate(digests)]
        self.phases = {"route": t1 - t0, "digests": time.perf_counter() - t1}
        incremental: list[int] = []
        loads: list[int] = []
        for k, s in enumerate(self.stores):
            if s is None or s.data is None:
                continue  # an engine rank not registered yet: loaded when it registers
            h = s.header()
            ready = h.state == StoreState.READY and h.stable
            if ready and h.version == version and h.root == roots[k]:
                continue  # holds it already (verified at start-up, or activated earlier)
            if routed is not None and ready and self.roots[k] == h.root:
                incremental.append(k)
            else:
                loads.append(k)
        if not write:  # (only the roots of the version the host now holds)
            self.roots, self.digests = list[bytes | None](roots), list[list[bytes] | None](digests)
            return None
        if not (incremental and routed is not None):
            incremental, routed = [], None
        prepared = (
            self._stage(incremental, version, roots, routed) if routed is not None else PreparedRanks(self.journal_dir)
        )
        prepared.version, prepared.model, prepared.roots, prepared.digests = version, model, roots, digests
        prepared.loads, prepared.routed = loads, routed
        return prepared

    def finish_apply(self, p: PreparedRanks) -> RanksApplied | None:
        """The writes of a prepared ``apply``: the in-place ranks under their fences (every rank's
        readers held first), then the ranks loaded whole.  Returns the in-place activation's figures,
        or None when there was none.  A rank store that moved since ``prepare_apply`` is not written:
        the journal is removed and StoreStateError raised."""
        plan, model = self.plan, p.model
        assert plan is not None and model is not None
        moved = [
            k
            for k, s in p.stores.items()
            if s.data is None or s.data.data_ptr() != p.data_ptrs[k] or s.control.raw() != p.bases[k]
        ]
        if moved:
            p.abandon()
            raise StoreStateError(f"rank stores {moved} changed between preparing the activation and writing it")
        p.claim()
        self._written = ({}, [])
        stats = write_ranks(p, fault=self.fault, phases=self.phases) if p.routed is not None else None
        in_place = {k: p.routed[k] for k in p.stores} if stats is not None and p.routed is not None else {}
        self._written = (in_place, p.loads)
        for k in p.loads:  # (only the ranks loaded whole are built)
            self._load(k, rank_model(plan, model, k), p.version, p.roots[k])
        self.roots, self.digests = list[bytes | None](p.roots), list[list[bytes] | None](p.digests)
        return stats

    def written_regions(self) -> dict[int, tuple[Region, ...]]:
        """Per rank, the byte ranges the last apply wrote (whole entries for a rank loaded whole): the
        regions a copy engine takes (daemon/engine_driver.py ``Activation.regions``)."""
        in_place, loads = self._written
        out = {k: whole_regions(self._rank(k).layout.specs) for k in loads}
        for k, routed in in_place.items():
            changes = routed.per_slot(self.bases[k]) if isinstance(routed, RankChanges) else routed
            out[k] = store_regions(self._rank(k).layout.specs, ((c.slot, c.positions) for c in changes))
        return out

    def _load(self, k: int, m: ServedModel, version: int, root: bytes) -> None:
        s = self._rank(k)
        s.fault = self._rank_fault(k)
        s.load(m, version, root)
        log.info("rank %d store %s loaded version %s", k, self.names[k], version, extra={"version": version})

    def _rank(self, k: int) -> WeightStore:
        s = self.stores[k]
        if s is None:
            raise StoreError(f"rank {k} store {self.names[k]} does not exist yet")
        return s

    def _stage(
        self, ranks: list[int], version: int, roots: list[bytes], routed: list[list[SlotChange]] | list[RankChanges]
    ) -> PreparedRanks:
        """Stage every in-place rank and write the one journal covering them (nothing written yet)."""
        stores = {k: self._rank(k) for k in ranks}
        return stage_ranks(
            stores, version, roots, routed, self.bases, self.journal_dir,
            fault=self.fault, rank_fault=self._rank_fault, phases=self.phases,
        )  # fmt: skip

    def _rank_fault(self, k: int) -> Callable[[str], None]:
        return lambda point: self.fault(f"rank{k}:{point}")

    def load_rank(self, k: int, version: int, model: ServedModel) -> None:
        """Load one rank (an engine buffer just registered) with the version the host holds."""
        assert self.plan is not None and self.digester is not None
        digests = self.digester.rank_digests(model, k)
        root = self.digester.root(k, digests)
        self._load(k, rank_model(self.plan, model, k), version, root)
        self.roots[k], self.digests[k] = root, digests

    # ------------------------------------------------------------ reporting

    def entries(self) -> list[dict[str, Any]]:
        """status.ranks: each rank's store, version, state root and state."""
        out = []
        for k, (name, s) in enumerate(zip(self.names, self.stores, strict=True)):
            if s is None:
                out.append({"rank": k, "store": name, "version": None, "root": None, "state": "absent"})
                continue
            try:
                h = s.header()
            except ValueError:  # (closed under us: a stale store being recreated)
                out.append({"rank": k, "store": name, "version": None, "root": None, "state": "absent"})
                continue
            ready = h.state == StoreState.READY and h.stable and (s.data is not None)
            state = h.state.name.lower() if s.data is not None or not self.engine_kind else "waiting_for_buffer"
            out.append(
                {
                    "rank": k,
                    "store": name,
                    "version": h.version if ready else None,
                    "root": h.root.hex() if ready else None,
                    "state": state,
                }
            )
        return out

    def rank_roots(self) -> list[bytes]:
        """Each rank's state root computed where its weights live (store.digests on its device)."""
        out = []
        for s in self.stores:
            assert s is not None
            out.append(state_root(s.layout.specs, s.digests()))
        return out

    def close(self) -> None:
        for s in self.stores:
            if s is not None:
                s.close()

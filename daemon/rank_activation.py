"""One activation across rank stores (daemon/rank_stores.py ``RankStores.apply``): each rank's
parameters hashed beside the routing, every in-place rank staged and one journal covering them
written, then each rank written under its own fence, every rank's readers held first; a failure
brings every rank to one version from the journal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from patchswarm.daemon import journal
from patchswarm.daemon.prepared import Prepared
from patchswarm.daemon.store_format import Header, JournalError, StoreError, TensorUpdate
from patchswarm.daemon.store_updates import torch_threads
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.layout_digest import RankDigests
from patchswarm.protocol.layout_flat import RankChanges
from patchswarm.protocol.layout_route import SlotChange
from patchswarm.protocol.served import ServedModel

__all__ = ["MAX_DIGEST_WORKERS", "PreparedRanks", "RankHashing", "RanksApplied", "stage_ranks", "write_ranks"]

log = logging.getLogger("patchswarm.store")

Fault = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RanksApplied:
    pause_s: float  # the longest single rank's fence odd -> even
    total_pause_s: float  # first fence odd -> last fence even (ranks are written one after another)
    journal_s: float
    journal_bytes: int
    changed: int


class PreparedRanks(Prepared):
    """A prepared ``RankStores.apply``: its in-place ranks staged and journaled, the ranks to load."""

    def __init__(self, journal_dir: Path, journal_s: float = 0.0, journal_bytes: int = 0, *, journaled: bool = False):
        super().__init__(journal_dir, journal_s, journal_bytes, journaled=journaled)
        self.version = 0
        self.model: ServedModel | None = None
        self.roots: list[bytes] = []
        self.digests: list[list[bytes]] = []
        self.loads: list[int] = []
        self.routed: list[list[SlotChange]] | list[RankChanges] | None = None
        self.stores: dict[int, WeightStore] = {}  # the ranks written in place
        self.staged: dict[int, list[TensorUpdate]] = {}
        self.bases: dict[int, Header] = {}
        self.data_ptrs: dict[int, int] = {}


MAX_DIGEST_WORKERS = 8


class RankHashing:
    """The digests of ``jobs`` (rank, slot) on one thread per core (at most ``MAX_DIGEST_WORKERS``),
    the largest first, started at once: the caller routes the version meanwhile and joins as a
    worker in ``finish``.  BLAKE3 and torch's copies let go of the GIL.  At TP=8 every parameter is
    small (hashed on one core each) and a third of the bytes are assembled first (column splits);
    one thread for those hashed in place and one for the others left a core idle (issue 33)."""

    def __init__(self, digester: RankDigests, model: ServedModel, jobs: list[tuple[int, int]]) -> None:
        self.digester, self.model, self.jobs = digester, model, jobs
        self.out = [b""] * len(jobs)
        self.order = iter(sorted(range(len(jobs)), key=lambda i: -digester.nbytes(*jobs[i])))
        self.take = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.far: list[Future[None]] = []
        digester.hold(model)
        workers = min(len(jobs), os.cpu_count() or 1, MAX_DIGEST_WORKERS)
        if workers > 1 and all(t.device.type == "cpu" for t in model.data):
            self.pool = ThreadPoolExecutor(workers - 1, thread_name_prefix="rank-digest")
            self.far = [self.pool.submit(self._work, w) for w in range(1, workers)]

    def _work(self, worker: int) -> None:
        while True:
            with self.take:
                i = next(self.order, None)
            if i is None:
                return
            self.out[i] = self.digester.digest(self.model, *self.jobs[i], worker=worker)

    def finish(self) -> list[bytes]:
        try:
            self._work(0)
        finally:
            try:
                for f in self.far:
                    f.result()
            finally:
                if self.pool is not None:
                    self.pool.shutdown()
                self.digester.release()
        return self.out


def stage_ranks(
    stores: dict[int, WeightStore],
    version: int,
    roots: list[bytes],
    routed: list[list[SlotChange]] | list[RankChanges],
    word_bases: list[list[int]],
    journal_dir: Path,
    *,
    fault: Fault,
    rank_fault: Callable[[int], Fault],
    phases: dict[str, float],
) -> PreparedRanks:
    """Stage every in-place rank (``stores``) and write the one journal covering them (nothing
    written yet); ``phases`` gets the stage's and the journal's seconds."""
    t0 = time.perf_counter()
    ranks = list(stores)
    per_rank: dict[int, list[TensorUpdate]] = {}
    runs: dict[int, journal.RunUpdates] = {}
    staged: dict[int, list[TensorUpdate]] = {}
    # Every rank stages (moves its updates to its device) before any fence goes odd: routed in
    # one pass, as one run over its store's words (protocol/layout_flat.py), or one per parameter.
    with torch_threads(1):  # (small operations per rank: see RankStores.prepare_apply)
        for k in ranks:
            r = routed[k]
            if isinstance(r, RankChanges):
                runs[k] = journal.RunUpdates(r.slots, r.counts, r.within(word_bases[k]), r.new, r.old)
                per_rank[k] = []
                flat = stores[k].stage_flat(r)
                staged[k] = flat if flat is not None else stores[k].stage(runs[k].updates())
            else:
                per_rank[k] = [TensorUpdate(c.slot, c.positions, c.new, c.old) for c in r]
                staged[k] = stores[k].stage(per_rank[k])
    bases = {k: stores[k].header() for k in ranks}
    for k in ranks:
        stores[k].fault = rank_fault(k)
    # One journal for every rank taking part (all ranks, unless an engine rank is being reloaded).
    entries = [
        journal.Journal(
            stores[k].layout.layout_hash, (b.version, b.root), (version, roots[k]), per_rank[k], runs.get(k)
        )
        for k, b in bases.items()
    ]
    t1 = time.perf_counter()
    jbytes = journal.write_rank_journal(journal_dir, entries, fault=fault)
    t2 = time.perf_counter()
    prepared = PreparedRanks(journal_dir, t2 - t1, jbytes, journaled=True)
    prepared.stores, prepared.staged, prepared.bases = stores, staged, bases
    prepared.data_ptrs = {k: s._require_data().data_ptr() for k, s in stores.items()}
    phases |= {"stage": t1 - t0, "journal": t2 - t1}
    fault("journaled")
    return prepared


def write_ranks(p: PreparedRanks, *, fault: Fault, phases: dict[str, float]) -> RanksApplied:
    """The fenced writes of the staged ranks (their journal on disk): every rank's readers held,
    then each rank in turn; a failure brings every rank to one version from the journal.
    ``phases`` gets the writes' and the journal's removal's seconds."""
    stores, staged, bases, version = p.stores, p.staged, p.bases, p.version
    ranks, roots = list(stores), p.roots
    t2 = time.perf_counter()
    _hold_readers(stores, p.journal_dir)
    longest = 0.0
    try:
        for i, k in enumerate(ranks):
            a = time.perf_counter()
            stores[k].write_fenced(bases[k], version, roots[k], staged[k])
            longest = max(longest, time.perf_counter() - a)
            if i == 0 and len(ranks) > 1:
                fault("between_ranks")
    except Exception as e:
        # (A rank whose values did not read back restored its base.)  Bring every rank to one
        # version, forward if the others verify, else back, from the journal still on disk.
        log.error("rank activation of version %s failed: %s; recovering every rank from the journal", version, e)
        try:
            journal.recover_ranks([stores[k] for k in ranks], p.journal_dir)
        except StoreError as again:
            log.error("rank recovery after the failed activation failed too: %s", again)
        raise
    t3 = time.perf_counter()
    fault("all_flipped")
    with contextlib.suppress(JournalError):  # a journal left behind only re-applies what the ranks hold
        journal.remove_journal(p.journal_dir)
    changed = sum(u.count for st in staged.values() for u in st)
    phases |= {"write": t3 - t2, "remove": time.perf_counter() - t3}
    return RanksApplied(longest, t3 - t2, p.journal_s, p.journal_bytes, changed)


def _hold_readers(stores: dict[int, WeightStore], journal_dir: Path) -> None:
    """Wait for every rank's readers in flight before any rank's fence goes odd (each rank's
    ``write_fenced`` then finds its gate held): a rank whose readers stall past the bound
    stops the activation with nothing written, never with some ranks ahead of the others."""
    taken: list[WeightStore] = []
    try:
        for s in stores.values():
            s.gate.acquire(s.control)
            taken.append(s)
    except StoreError:
        for s in taken:
            s.gate.release(s.control)
        with contextlib.suppress(JournalError):
            journal.remove_journal(journal_dir)
        raise

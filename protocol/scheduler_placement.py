"""Which peer the chunk scheduler (protocol/scheduler.py) asks for which chunk, and when it may not ask.

A round's free peers; this node's budgets; the seed and stripe-tree rules; the choice among a
chunk's holders by tier and rate; issuing a request.  The rules themselves are listed in
protocol/scheduler.py's docstring.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from patchswarm.protocol.scheduler_state import SchedulerState, _Flight, _Peer, _seq_of
from patchswarm.protocol.scheduler_types import PeerInfo, Request


@dataclass(slots=True, eq=False, init=False)
class _Round:
    """What one ``next_requests`` call computes once: the peers that can take requests, and more."""

    now: float
    free: list[_Peer]
    any_banned: bool
    slow_below: float | None  # a holder measured below this is "too slow" (None: seed rate unknown)
    peers: dict[str, _Peer]
    held: int  # the chunks some free peer holds (an OR of their masks; a superset once peers fill up)
    blocked: int  # the chunks held by peers left out only because this node's budget for their class is spent
    _fast: list[_Peer] | None

    def __init__(
        self,
        now: float,
        free: list[_Peer],
        any_banned: bool,
        slow_below: float | None,
        peers: dict[str, _Peer],
        held: int = -1,
        blocked: int = 0,
    ) -> None:
        self.now = now
        self.free = free
        self.any_banned = any_banned
        self.slow_below = slow_below
        self.peers = peers
        self.held = held
        self.blocked = blocked
        self._fast = None

    @property
    def fast(self) -> list[_Peer]:
        """Non-banned non-seed peers not too slow (computed on first use: most rounds never ask)."""
        if self._fast is None:
            now, slow_below = self.now, self.slow_below
            self._fast = [
                p
                for p in self.peers.values()
                if not p.info.is_seed
                and p.banned_until <= now
                and (slow_below is None or p.rate is None or p.rate >= slow_below)
            ]
        return self._fast


class ChunkPlacement(SchedulerState):
    """The choosing half of ``ChunkScheduler`` (which adds the driver's calls)."""

    def _room(self, remote: bool | None = None) -> bool:
        """Whether this node may start another request (to a peer of class ``remote``; None: either,
        where the remote budget counts only while some known peer is remote, so that a node in one
        region is "full" when its one budget is, as without a remote budget)."""
        cfg = self._cfg
        local = self._n_inflight - self._n_remote < self._max_local
        if not cfg.max_inflight_remote or remote is False:
            return local
        far = self._n_remote < cfg.max_inflight_remote
        return far if remote else local or (far and self._remote_peers > 0)

    def _round(self, now: float, pool_bits: int = -1) -> _Round:
        """The free peers holding something this node lacks (and in ``pool_bits``), in the order they
        were added (with an active set, ``max_peers``: the order they were last heard from)."""
        cfg = self._cfg
        want = pool_bits & self._missing
        free: list[_Peer] = []
        spent: list[str] = []
        for p in self._live.values():  # (a walk on each call: kept to a few tests on plain fields)
            if p.free_at <= now and p.load < p.cap:
                bits = p.bits
                if bits & want:
                    free.append(p)
                elif not bits & self._missing:
                    spent.append(p.info.peer_id)  # it holds nothing this node lacks: out of the walks
        for pid in spent:
            del self._live[pid]
        if len(free) > 1:
            free.sort(key=_seq_of)
        blocked = 0
        if cfg.max_inflight_remote and not (self._room(False) and self._room(True)):
            full = not self._room(True)  # the class whose budget is spent (only one can be: _room() held)
            blocked = self._holders_of(p for p in free if p.remote == full and not p.info.is_seed)
            free = [p for p in free if p.remote != full]
        if self._banned:
            self._banned = {pid for pid in self._banned if self._peers[pid].banned_until > now}
        seed_rate: float | None = None
        for p in self._seeds.values():
            if p.banned_until <= now and p.rate is not None:
                seed_rate = p.rate if seed_rate is None else max(seed_rate, p.rate)
        slow_below = None if seed_rate is None else seed_rate / cfg.slow_factor
        return _Round(now, free, bool(self._banned), slow_below, self._peers, self._holders_of(free), blocked)

    @staticmethod
    def _holders_of(peers: Iterable[_Peer]) -> int:
        """The chunks any of ``peers`` holds (an OR of their masks)."""
        held = 0
        for p in peers:
            held |= p.bits
        return held

    def _choose(self, chunk: int, rnd: _Round, waiting_since: float | None = None) -> _Peer | None:
        """The peer to ask for ``chunk`` now, or None.  ``waiting_since`` marks an endgame duplicate."""
        candidates = self._candidates(chunk, rnd, waiting_since)
        return self._best(candidates) if candidates else None

    def _candidates(self, chunk: int, rnd: _Round, waiting_since: float | None = None) -> list[_Peer]:
        """The free peers that may be asked for ``chunk`` now: non-seed holders, or else the seeds."""
        if self._parents and waiting_since is None:
            tree = self._tree_candidates(chunk, rnd)
            if tree is not None:
                return tree
        holders: list[_Peer] = []
        seeds: list[_Peer] = []
        for p in rnd.free:
            if p.bits >> chunk & 1 and chunk not in p.inflight:
                (seeds if p.info.is_seed else holders).append(p)
        if not seeds:
            return holders
        if self._too_slow(chunk, rnd):
            return seeds
        if holders:
            return holders
        if rnd.blocked >> chunk & 1:
            return []  # its holders wait for this node's own budget (see the module docstring)
        if waiting_since is None:
            if self._no_holder(chunk, rnd):
                return seeds
            waiting_since = self._since.get(chunk, rnd.now if self._epoch is None else self._epoch)
        return seeds if rnd.now - waiting_since >= self._cfg.seed_patience else []

    def _tree_candidates(self, chunk: int, rnd: _Round) -> list[_Peer] | None:
        """The chunk's stripe parent if it may be asked now, [] to wait for it, None: the usual rules."""
        parent_id = self._parents[chunk % len(self._parents)]
        if parent_id == "":  # no parent in this stripe (it left): the usual rules
            return None
        if parent_id is None:  # a root: its stripe comes from the seeds, first hand
            return [p for p in rnd.free if p.info.is_seed and p.bits >> chunk & 1 and chunk not in p.inflight] or None
        parent = self._peers.get(parent_id)
        if parent is not None:
            if parent.banned_until > rnd.now:
                return None
            if parent.bits >> chunk & 1:
                free = parent.load < parent.cap and parent.free_at <= rnd.now and chunk not in parent.inflight
                return [parent] if free and parent in rnd.free else []
        # The parent lacks it (or has not announced this version yet): wait, unless others have held it a while.
        since = self._since.get(chunk)
        if since is None or self._avail[chunk] + self._n_full == 0:
            return []
        return [] if rnd.now < since + self._cfg.tree_patience else None  # (as next_deadline computes it)

    @staticmethod
    def _only_seeds_can_help(rnd: _Round) -> bool:
        """Only seeds are free, and only "nobody holds it" could let them be asked (no bans, no slow rule)."""
        return not rnd.any_banned and rnd.slow_below is None and all(p.info.is_seed for p in rnd.free)

    def _no_holder(self, chunk: int, rnd: _Round) -> bool:
        """No non-banned non-seed peer holds the chunk."""
        if self._avail[chunk] + self._n_full == 0:
            return True
        if not rnd.any_banned:
            return False
        return not any(
            not p.info.is_seed and p.banned_until <= rnd.now and p.holds(chunk) for p in self._peers.values()
        )

    def _too_slow(self, chunk: int, rnd: _Round) -> bool:
        """The chunk has non-banned holders and every one is measured below the seed's rate / slow_factor."""
        if rnd.slow_below is None or self._no_holder(chunk, rnd):
            return False
        return not any(p.holds(chunk) for p in rnd.fast)

    def _best(self, candidates: list[_Peer]) -> _Peer:
        cfg = self._cfg
        rates = [cfg.initial_rate if p.rate is None else p.rate for p in candidates]
        slow_below = max(rates) / cfg.slow_factor
        best: tuple[int, float, float] | None = None
        chosen = candidates[0]
        for p, rate in zip(candidates, rates, strict=True):
            key = (3 if rate < slow_below else self._tier(p.info), -rate / (1 + len(p.inflight)), self._rng.random())
            if best is None or key < best:
                best, chosen = key, p
        return chosen

    def _tier(self, info: PeerInfo) -> int:
        me = self._me
        same_region = info.region == me.region
        if me.zone and info.zone == me.zone and same_region:
            return 0
        if me.region and same_region:
            return 1
        return 2

    def _issue(self, chunk: int, peer: _Peer, rnd: _Round, *, duplicate: bool) -> Request:
        cfg = self._cfg
        pid = peer.info.peer_id
        size = self._sizes[chunk]
        allow = cfg.deadline_base + size / cfg.deadline_rate
        if cfg.deadline_slack and peer.rate is not None:  # measured: its own pace (protocol/peer_timing.py)
            allow = peer.timing.timeout(size / peer.rate, cfg.deadline_slack, allow, max(allow, cfg.deadline_max))
        deadline = rnd.now + allow
        req = Request(chunk, pid, deadline, duplicate)
        remote = peer.remote
        self._flights.setdefault(chunk, {})[pid] = _Flight(req, rnd.now, remote)
        heapq.heappush(self._deadlines, (deadline, chunk, pid))
        if len(self._deadlines) > 4 * self._n_inflight + 64:  # compact the entries of dropped requests
            self._deadlines = [(f.request.deadline, c, q) for c, fl in self._flights.items() for q, f in fl.items()]
            heapq.heapify(self._deadlines)
        peer.inflight.add(chunk)
        peer.load = len(peer.inflight)
        self._n_inflight += 1
        self._n_remote += remote
        if not duplicate:
            self._pool_remove(chunk)
        if peer.load >= peer.cap:
            rnd.free.remove(peer)
        if not self._room(remote):  # this class is full: its peers leave the round, their chunks wait
            rnd.blocked |= self._holders_of(p for p in rnd.free if p.remote == remote and not p.info.is_seed)
            rnd.free = [p for p in rnd.free if p.remote != remote]
        self._counters["requests"] += 1
        self._counters["duplicates"] += duplicate
        self._counters["seed_requests"] += peer.info.is_seed
        return req

    def _peer_cap(self, peer: _Peer) -> int:
        cfg = self._cfg
        if peer.info.is_seed:
            return cfg.max_inflight_per_parent if None in self._parents else cfg.max_inflight_seed
        if peer.info.peer_id in self._parents:
            return cfg.max_inflight_per_parent
        return cfg.max_inflight_per_remote_peer if peer.remote else cfg.max_inflight_per_peer

    def _in_endgame(self) -> bool:
        left = self._have.n - self._have.count()
        return 0 < left <= self._cfg.endgame_remaining

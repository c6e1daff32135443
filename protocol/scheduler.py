"""The chunk scheduler for one version being downloaded: which chunk to ask of which peer, and when.

Sans-IO: the driver tells it what happened (``update_peer``, ``on_success``, ``on_failure``,
``remove_peer``), asks it what to do (``next_requests``, ``expired``) and arms one timer
(``next_deadline``).  It never reads a clock and draws every random choice from the injected
``random.Random``, so one seed gives one request sequence in the asyncio driver and in a
simulation alike.  A driver loop::

    on any event or timer at time t:
        for r in sched.expired(t): cancel r            # counted as TIMEOUT already
        for r in sched.next_requests(t): start r       # arm its deadline r.deadline
        arm the timer for sched.next_deadline()
    on a verified chunk: for r in sched.on_success(t, ...): cancel r
    on a failed request: sched.on_failure(t, ..., reason, retry_after)

Requests handed back for cancelling (by ``on_success``, ``expired``, ``remove_peer``) are
already forgotten; reports about requests the scheduler no longer tracks are tolerated.

Rules (after Kraken, BitTorrent and Dragonfly: docs/design.md#swarm-distribution):

* Caps: ``max_inflight`` per node, ``max_inflight_per_peer`` per peer (``max_inflight_per_remote_peer``
  per peer in another region), ``max_inflight_seed`` per seed; requests to peers in another region
  (both regions known) count against their own ``max_inflight_remote`` instead of ``max_inflight``
  (0: they share ``max_inflight``, and such peers count as local), since a flow across regions is
  capped at window / RTT and filling a downlink takes more of them; a
  chunk already held is never requested; only a peer whose bitfield has the chunk
  is asked (``has=None``: every chunk); a banned or resting peer is not asked.
* Chunk order: the first ``random_first`` picks uniformly at random among the chunks that can
  be requested now, then rarest first.  Rarity counts the non-seed peers known to hold a chunk;
  ties follow a random permutation drawn once from the rng.  (Counting the holders of this node's
  region first was measured 2-5% slower across regions: docs/simulation.md#measured-and-not-adopted.)
* Peer order for a chunk: same zone, then same region, then elsewhere; a peer whose rate estimate
  is below ``1/slow_factor`` of the best candidate's is demoted behind every tier.  Within a tier
  the highest ``rate / (1 + in flight)`` wins (fast peers first, load spread among equals), with
  a random tiebreak.  Unknown peers are assumed to deliver ``initial_rate`` so they get tried.
* The seed is a last resort: asked for a chunk only when no non-banned non-seed peer holds it,
  or the chunk has waited ``seed_patience`` (since it entered the pool or since its first holder
  appeared) while every holder was at its cap or resting, or every holder's measured rate is
  below the seed's measured rate divided by ``slow_factor``.  A holder left out only because
  this node's own budget for its class (local or remote) is spent still counts as a holder: the
  chunk waits for the node's requests, not for the seed.  A refusal (BUSY) rests the seed
  for ``retry_after`` and the peers wait for each other.
* Stripe trees (``set_parents``, protocol/trees.py): a chunk is asked of its stripe's parent alone
  (a root's: of the seeds at once), in line for it while the parent is busy or lacks the chunk,
  until others have held the chunk ``tree_patience``; a banned or gone (``orphan``) parent leaves
  its stripe to the rules above.  A parent gets ``max_inflight_per_parent``, and the node's budget
  grows to that times the stripes.
* Endgame: once every missing chunk is in flight and at most ``endgame_remaining`` remain, each
  gets one duplicate request to another eligible peer (to the seed only after ``seed_patience``
  or when the holders are too slow); the first success returns the other to cancel.
* Deadlines: for a peer whose rate is measured, its own (protocol/peer_timing.py: ``deadline_slack`` x
  the time its rate predicts for the chunk, plus deviations and its round trip from busy/missing
  answers, at most ``deadline_max``), never shorter than the fixed deadline; for one never measured
  (or ``deadline_slack`` 0), the fixed ``deadline_base + size / deadline_rate`` after the request.
  An expired request is a TIMEOUT: the chunk goes back to the pool, the peer rests and its rate estimate is cut to at
  most half of what it could have delivered, so faster peers win next time.
* Failures: HASH bans the peer for ``ban_seconds``; ERROR, TIMEOUT and BUSY rest it for
  ``failure_backoff`` doubling per consecutive failure up to ``backoff_cap`` (BUSY with
  ``retry_after`` rests exactly that long); MISSING clears that bit of the peer's bitfield, and
  for ``failure_backoff`` seconds ``update_peer`` cannot set it again (a stale announcement);
  ``on_have`` can (it is news).  ERROR/TIMEOUT reports for requests no longer tracked are ignored.

Cost: ``next_requests`` walks the pooled chunks in rarest-first order (kept sorted incrementally)
and stops as soon as the caps are reached; free peers that hold nothing pooled are skipped with
one big-integer AND, and while only seeds are free in the first ``seed_patience`` seconds the walk
stops at the first chunk somebody holds.  Worst case O(pooled chunks x free peers) per call (a
free peer holding only the last chunk in order); measured here ~0.15 ms per completed chunk at
20k chunks and 30 peers.  ``on_have`` is the O(log n) way to report one new chunk of a peer.

Where the parts live: the configuration, peer, request and failure types in
protocol/scheduler_types.py; the state and its bookkeeping (rarity order, patience clocks, timers)
in protocol/scheduler_state.py; the choice of peer for a chunk in protocol/scheduler_placement.py;
here, the calls a driver makes and the failure rules.
"""

from __future__ import annotations

import heapq
import math

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.scheduler_placement import ChunkPlacement, _Round
from patchswarm.protocol.scheduler_state import _ALL, _MIN_ELAPSED, _NO_FLIGHTS, _Flight, _indices, _Peer
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, Request


class ChunkScheduler(ChunkPlacement):
    """Chunk scheduling for one download; see the module docstring for the rules (the constructor:
    ``SchedulerState``)."""

    # ------------------------------------------------------------------ state

    @property
    def have(self) -> Bitfield:
        """A copy of the chunks held."""
        return self._have.copy()

    @property
    def complete(self) -> bool:
        return self._have.complete

    def holds(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` is held (no copy, unlike ``have``)."""
        return chunk in self._have

    def holders(self, chunk: int) -> int:
        """Non-seed peers known to hold ``chunk``."""
        return self._avail[self._index(chunk)] + self._n_full

    @property
    def held_count(self) -> int:
        return self._have.count()

    @property
    def inflight(self) -> int:
        return self._n_inflight

    @property
    def full(self) -> bool:
        """Every request this node may have in flight is out: the local budget spent, and the remote
        one too while some known peer is remote."""
        return not self._room()

    def inflight_requests(self) -> list[Request]:
        """Every request in flight, by chunk."""
        return [f.request for c in sorted(self._flights) for f in self._flights[c].values()]

    def stats(self) -> dict[str, float]:
        """Counters (requests, duplicates, seed_requests, bytes, seed_bytes, timeouts, bans, ...),
        plus ``bytes:<peer>`` and ``rate:<peer>`` per known peer."""
        out = dict(self._counters)
        out["have"] = float(self._have.count())
        out["inflight"] = float(self._n_inflight)
        out["inflight_remote"] = float(self._n_remote)
        for pid, p in self._peers.items():
            out[f"bytes:{pid}"] = float(p.bytes)
            if p.rate is not None:
                out[f"rate:{pid}"] = p.rate
        return out

    # ------------------------------------------------------------------ peers

    def update_peer(self, peer: PeerInfo, has: Bitfield | int | None, now: float) -> None:
        """Add or refresh a peer; ``has=None``: it holds every chunk (the seed, or a complete node).

        ``has`` is a Bitfield, or the same as an int (bit i: chunk i; what ``Bitfield.mask_from_bytes``
        makes of a wire bitfield, saving the driver a Bitfield per announcement).  It is not kept:
        later changes to it are not seen.  Rate estimate, rest and ban survive a refresh.
        """
        self._tick(now)
        if peer.peer_id == self._me.peer_id:
            raise ValueError("update_peer() about this node itself")
        n = len(self._sizes)
        if has is None:
            new_bits = _ALL
        elif isinstance(has, Bitfield):
            if has.n != n:
                raise ValueError(f"bitfield of {has.n} chunks for a version of {n}")
            new_bits = has.to_int()
        else:
            if has < 0 or has >> n:
                raise ValueError(f"bitfield int names chunks outside a version of {n}")
            new_bits = has
        p = self._peers.get(peer.peer_id)
        if p is not None and p.missing:  # a stale announcement must not undo a fresh MISSING
            p.missing = {c: t for c, t in p.missing.items() if t > now}
            if p.missing:
                if new_bits == _ALL:
                    new_bits = (1 << n) - 1
                for c in p.missing:
                    new_bits &= ~(1 << c)
        if p is None:
            p = self._peers[peer.peer_id] = _Peer(peer, 0, self._next_seq())
            old_counted = False
            if self._cfg.max_peers and not peer.is_seed:
                self._make_room(peer.peer_id)
        else:
            old_counted = not p.info.is_seed
            if self._cfg.max_peers:  # the most recently heard from last: the first to go is the stalest
                self._peers[peer.peer_id] = self._peers.pop(peer.peer_id)
                p.seq = self._next_seq()
        new_counted = not peer.is_seed
        old_bits = p.bits
        p.info, p.bits = peer, new_bits
        if new_bits & self._missing:
            self._live[peer.peer_id] = p
        me = self._me
        remote = bool(self._cfg.max_inflight_remote and me.region and peer.region and peer.region != me.region)
        self._remote_peers += remote - p.remote
        p.remote = remote
        p.cap = self._peer_cap(p)
        if peer.is_seed:
            self._seeds[peer.peer_id] = p
        else:
            self._seeds.pop(peer.peer_id, None)
        removed: list[int] = []
        added: list[int] = []
        full_delta = 0
        # (an announcement usually differs from the last one by a chunk or two)
        if old_counted and new_counted and old_bits != _ALL and new_bits != _ALL:
            changed = old_bits ^ new_bits
            removed = _indices(old_bits & changed)
            added = _indices(new_bits & changed)
        else:
            if old_counted:
                if old_bits == _ALL:
                    full_delta -= 1
                else:
                    removed = _indices(old_bits)
            if new_counted:
                if new_bits == _ALL:
                    full_delta += 1
                else:
                    added = _indices(new_bits)
        self._apply_availability(removed, added, full_delta, now)

    def _make_room(self, newcomer: str) -> None:
        """Over ``max_peers`` non-seed peers: forget the one heard from longest ago that has nothing
        in flight and is neither resting nor banned (forgetting those would cut a rest or a ban short)."""
        count = len(self._peers) - len(self._seeds)
        if count <= self._cfg.max_peers:
            return
        now = self._now
        for pid, p in self._peers.items():
            if (
                pid != newcomer
                and not p.info.is_seed
                and not p.inflight
                and p.free_at <= now
                and pid not in self._parents
            ):
                self.remove_peer(pid)
                return

    def on_have(self, peer_id: str, chunk: int, now: float) -> None:
        """A peer announced one more chunk (cheaper than ``update_peer`` with a new bitfield)."""
        self._tick(now)
        p = self._peers.get(peer_id)
        if p is None:
            return
        p.missing.pop(chunk, None)  # news newer than its MISSING answer
        bits = p.bits
        if bits == _ALL or bits >> self._index(chunk) & 1:
            return
        p.bits = bits | 1 << chunk
        if self._missing >> chunk & 1:
            self._live[peer_id] = p
        if not p.info.is_seed:
            self._avail_change(chunk, +1, now)

    def set_parents(self, parents: tuple[str | None, ...]) -> None:
        """Stripe trees (protocol/trees.py): chunk ``c`` is asked of ``parents[c % len(parents)]``
        (None: the seeds; "": no parent, the usual rules) unless that peer is banned, even if it does
        not hold the chunk yet, for up to ``tree_patience`` after some other peer does; () turns the
        trees off."""
        if self._me.peer_id in parents:
            raise ValueError("a node is not its own parent")
        self._parents = tuple(parents)
        # Room for every parent's requests: a root's seed requests must not crowd out its other stripes.
        self._max_local = max(self._cfg.max_inflight, len(parents) * self._cfg.max_inflight_per_parent)
        for p in self._peers.values():
            p.cap = self._peer_cap(p)

    def orphan(self, peer_id: str) -> None:
        """``peer_id`` is gone for good: the stripes it was the parent of follow the usual rules."""
        if peer_id in self._parents:
            self._parents = tuple("" if p == peer_id else p for p in self._parents)

    def remove_peer(self, peer_id: str) -> list[Request]:
        """Forget a peer (dead or gone); returns its in-flight requests, now dropped (cancel them)."""
        p = self._peers.pop(peer_id, None)
        if p is None:
            return []
        self._live.pop(peer_id, None)
        self._seeds.pop(peer_id, None)
        self._banned.discard(peer_id)
        self._remote_peers -= p.remote
        dropped = [self._drop_flight(c, peer_id).request for c in sorted(p.inflight)]
        if not p.info.is_seed:
            if p.bits == _ALL:
                self._apply_availability([], [], -1, self._now)
            else:
                self._apply_availability(_indices(p.bits), [], 0, self._now)
        for r in dropped:
            self._maybe_repool(r.chunk, self._now)
        return dropped

    # ------------------------------------------------------------------ decisions

    def next_requests(self, now: float) -> list[Request]:
        """New requests to start now, obeying every cap and rule."""
        self._tick(now)
        out: list[Request] = []
        if self._have.complete or not self._room():
            return out
        # Peers holding nothing in the pool cannot take a new chunk: one pass lists the free peers that do.
        pool = self._pool
        pool_bits = pool.to_int()
        scan = self._round(now, pool_bits) if pool_bits else None
        if scan is not None and scan.free:
            self._ensure_order()
            self._new_requests(now, scan, out)
        if pool.count() == 0 and self._in_endgame() and self._room():
            rnd = self._round(now)
            for c in sorted(self._flights):
                if not rnd.free:
                    break
                flights = self._flights[c]
                if len(flights) != 1:
                    continue
                (first,) = flights.values()
                peer = self._choose(c, rnd, waiting_since=first.start)
                if peer is not None:
                    out.append(self._issue(c, peer, rnd, duplicate=True))
        return out

    def _new_requests(self, now: float, scan: _Round, out: list[Request]) -> None:
        """Random-first, then rarest-first requests for pooled chunks, to the free peers of ``scan``."""
        cfg = self._cfg
        early = self._epoch is not None and now - self._epoch < cfg.seed_patience
        n = len(self._sizes)  # (the keys of _order: availability x n + rank)
        while self._random_left > 0 and scan.free:
            candidates = []
            held = scan.held
            for key in self._order:
                if early and key // n + self._n_full and self._only_seeds_can_help(scan):
                    break  # as below
                c = self._perm[key % n]
                if held >> c & 1 and self._candidates(c, scan):
                    candidates.append(c)
            if not candidates:
                break
            c = self._rng.choice(candidates)
            peer = self._choose(c, scan)
            assert peer is not None
            out.append(self._issue(c, peer, scan, duplicate=False))
            self._random_left -= 1
        if self._random_left == 0:
            order, i = self._order, 0
            while i < len(order) and scan.free:
                key = order[i]
                c = self._perm[key % n]
                if early and key // n + self._n_full and self._only_seeds_can_help(scan):
                    break  # from here on every chunk has a holder and none has waited its patience yet
                if not scan.held >> c & 1:
                    i += 1  # no free peer holds it: _choose would find nobody (O(1) instead of O(free peers))
                    continue
                peer = self._choose(c, scan)
                if peer is None:
                    i += 1
                else:  # issuing removes order[i]: the next chunk moves into place i
                    out.append(self._issue(c, peer, scan, duplicate=False))

    def on_success(self, now: float, chunk: int, peer_id: str, nbytes: int, elapsed: float) -> list[Request]:
        """A chunk arrived from ``peer_id`` and passed its hash; returns duplicate requests to cancel."""
        self._tick(now)
        self._index(chunk)
        p = self._peers.get(peer_id)
        if p is not None:
            p.timing.transfer(elapsed, None if p.rate is None else nbytes / p.rate)
            sample = nbytes / max(elapsed, _MIN_ELAPSED)
            a = self._cfg.rate_alpha
            p.rate = sample if p.rate is None else a * sample + (1 - a) * p.rate
            p.failures = 0
            p.bytes += nbytes
        own = self._drop_flight(chunk, peer_id) if peer_id in self._flights.get(chunk, _NO_FLIGHTS) else None
        cancel = [self._drop_flight(chunk, pid).request for pid in list(self._flights.get(chunk, _NO_FLIGHTS))]
        self._counters["cancelled"] += len(cancel)
        if not self._have.set(chunk):
            return cancel
        self._missing &= ~(1 << chunk)
        self._pool_remove(chunk)
        self._counters["successes"] += 1
        self._counters["bytes"] += nbytes
        if p is not None and p.info.is_seed:
            self._counters["seed_bytes"] += nbytes
        if own is not None and own.request.duplicate:
            self._counters["duplicate_bytes"] += nbytes
        return cancel

    def on_failure(
        self,
        now: float,
        chunk: int,
        peer_id: str,
        reason: FailureReason,
        retry_after: float | None = None,
        elapsed: float | None = None,
    ) -> None:
        """A request failed; the chunk becomes requestable again unless another request covers it.
        ``elapsed``: how long a BUSY or MISSING answer took (a round trip: the peer's deadlines)."""
        self._tick(now)
        self._index(chunk)
        flight = self._drop_flight(chunk, peer_id) if peer_id in self._flights.get(chunk, _NO_FLIGHTS) else None
        p = self._peers.get(peer_id)
        if p is not None and elapsed is not None and reason in (FailureReason.BUSY, FailureReason.MISSING):
            p.timing.answer(elapsed)
        # An ERROR or TIMEOUT for a request no longer tracked was already accounted for (expired or
        # cancelled); HASH, MISSING and BUSY still say something about the peer.
        stale = flight is None and reason in (FailureReason.ERROR, FailureReason.TIMEOUT)
        if p is not None and not stale:
            self._punish(p, now, chunk, reason, retry_after, flight)
        self._maybe_repool(chunk, now)

    def expired(self, now: float) -> list[Request]:
        """In-flight requests past their deadline, now dropped as TIMEOUT failures (cancel them)."""
        self._tick(now)
        flights = self._flights
        first = self._first_deadline()
        if first is None or first > now:
            return []  # the usual case (deadlines are seconds away): no sort, no list
        late = [f.request for c in sorted(flights) for f in flights[c].values() if f.request.deadline <= now]
        for r in late:
            self.on_failure(now, r.chunk, r.peer_id, FailureReason.TIMEOUT)
        return late

    def next_deadline(self) -> float | None:
        """When to call ``expired``/``next_requests`` next if nothing else happens.

        The earliest in-flight deadline (even if past), or the earliest future end of a rest or
        ban, or moment a waiting chunk's seed patience runs out.  "Future" is relative to the
        latest ``now`` the scheduler was given, so a driver that re-arms after each call never spins.
        """
        first_deadline = self._first_deadline()
        deadlines = [] if first_deadline is None else [first_deadline]
        later: list[float] = []
        wake = self._first_wake()
        if wake is not None:
            later.append(wake)
        seeds = list(self._seeds.values())
        if self._epoch is not None and seeds:  # when a waiting chunk may go to a seed
            ready = min(max(p.resting_until, p.banned_until) for p in seeds)
            patience = self._cfg.seed_patience
            first = self._first_patience_end(self._since_heap, patience)
            if first is not None:
                later.append(max(ready, first))
            later.append(max(ready, self._epoch + patience))  # chunks waiting since the start
            if self._pool.count() == 0 and self._in_endgame():
                later.extend(
                    max(ready, f.start + patience) for fl in self._flights.values() if len(fl) == 1 for f in fl.values()
                )
        if self._parents and (tree := self._first_patience_end(self._tree_heap, self._cfg.tree_patience)) is not None:
            later.append(tree)  # a chunk may leave its stripe's parent for the usual rules
        after = self._now
        return min(deadlines + [t for t in later if t > after], default=None)

    # ------------------------------------------------------------------ failures

    def _punish(
        self,
        p: _Peer,
        now: float,
        chunk: int,
        reason: FailureReason,
        retry_after: float | None,
        flight: _Flight | None,
    ) -> None:
        cfg = self._cfg
        if reason is FailureReason.HASH:
            p.banned_until = max(p.banned_until, now + cfg.ban_seconds)
            p.free_at = max(p.free_at, p.banned_until)
            self._banned.add(p.info.peer_id)
            heapq.heappush(self._wakes, (p.banned_until, p.info.peer_id))
            self._counters["bans"] += 1
            return
        if reason is FailureReason.MISSING:
            self._counters["missing"] += 1
            p.missing[chunk] = now + cfg.failure_backoff
            if p.bits == _ALL:
                p.bits = (1 << len(self._sizes)) - 1
                if not p.info.is_seed:  # from "holds everything" to an explicit bitfield
                    self._apply_availability([], list(range(len(self._sizes))), -1, now)
            if p.bits >> chunk & 1:
                p.bits &= ~(1 << chunk)
                if not p.info.is_seed:
                    self._avail_change(chunk, -1, now)
            return
        p.failures += 1
        rest = min(cfg.backoff_cap, cfg.failure_backoff * 2.0 ** min(p.failures - 1, 60))
        if reason is FailureReason.BUSY:
            self._counters["busy"] += 1
            if retry_after is not None and math.isfinite(retry_after):
                rest = max(0.0, retry_after)
        elif reason is FailureReason.TIMEOUT:
            self._counters["timeouts"] += 1
            size = self._sizes[chunk]
            elapsed = now - flight.start if flight is not None else cfg.deadline_base + size / cfg.deadline_rate
            could = max(size, 1) / max(elapsed, _MIN_ELAPSED)  # it delivered less than this
            p.rate = min(cfg.initial_rate if p.rate is None else p.rate, could) / 2
        else:
            self._counters["errors"] += 1
        p.resting_until = max(p.resting_until, now + rest)
        p.free_at = max(p.free_at, p.resting_until)
        heapq.heappush(self._wakes, (p.resting_until, p.info.peer_id))

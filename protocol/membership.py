"""Cluster membership: SWIM failure detection with the Lifeguard extensions, sans-IO.

After hashicorp/memberlist and the SWIM and Lifeguard papers.  One ``Membership`` object is one
node's view of the cluster.  It never reads a clock (every call takes ``now`` in seconds), never
touches the network (it returns ``Send`` values and is handed received messages) and draws every
random choice from the injected ``random.Random``, so the same seed and inputs give the same
outputs.  The driver loop is: deliver each received message with ``receive``, call ``tick`` when
``next_deadline()`` has come, send whatever either returns, and read ``drain_events`` for changes.

Protocol, per node:
- Probing: round-robin over a shuffled member list (re-shuffled each round).  A direct ``Ping``;
  after ``probe_timeout`` a ``PingReq`` through ``indirect_probes`` random alive helpers, who ping
  the target and relay its ``Ack``, or answer ``Nack`` when it stays silent; no ``Ack`` by the end
  of the probe interval makes the target SUSPECT.
- Gossip: facts (``Update``) ride on every message from a queue, each sent
  ``retransmit_mult * ceil(log10(N + 1))`` times, least-sent first; a gossip round sends the queue
  to ``gossip_fanout`` random members; ``Sync`` exchanges full state (anti-entropy, join).
- Precedence: a higher incarnation wins; at equal incarnation LEFT > DEAD > SUSPECT > ALIVE.  Only
  a node raises its own incarnation: when it hears it is suspected or declared dead it refutes by
  gossiping ALIVE at a higher incarnation.  A claim more than ``MAX_INCARNATION_JUMP`` above the
  incarnation this node knows is ignored: honest incarnations grow by one per refutation, so only a
  forger (an insider holding the cluster secret) makes such jumps, and accepting them would let one
  message push a victim's incarnation to the wire limit, after which it could never refute again.
- Lifeguard: suspicion starts at the longest timeout and shrinks towards the shortest as other
  nodes independently confirm it (``Update.origin`` names who asserted a suspicion); a local
  health score (``awareness``) slows this node's own probing while its own messages seem to be
  getting lost (failed probes with no ``Nack``, refuted suspicions).
- Bounded view (``max_members`` = k > 0; 0, the default, is SWIM's full membership): a node keeps
  at most k other members, those with the lowest *rank*, a hash of (its id, their id), among the
  members it has heard of.  The view is thus a pseudo-random k-subset that does not depend on the
  order in which members were heard of, and every member sits in about k views, so it is probed
  about as often as under full membership.  The join seeds (by address) always keep their place:
  they are the contacts a node falls back on (in patchswarm, the trainer's seed).  A member that
  loses its place is forgotten silently (it is alive: a driver may keep talking to it).  Updates
  about members outside the view are still relayed, once per (incarnation, state) as remembered in
  a bounded record of recent facts, so joins and deaths reach every view; a DEAD or LEFT one is
  also reported by ``drain_events`` (a driver may know that member from elsewhere).  The
  broadcast queue is bounded too.  Memory and a ``Sync`` are O(k) instead of O(N): for clusters
  of thousands of hosts (docs/simulation.md#bounded-membership-views).

Where the parts live: the messages and a node's identity in protocol/membership_messages.py, the
configuration and suspicion timeouts in protocol/membership_config.py, the records this state
machine keeps in protocol/membership_records.py, its sorted indexes of members by state (what
random picks are drawn from) in protocol/membership_index.py.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random

from patchswarm.protocol.membership_config import MembershipConfig, suspicion_bounds, suspicion_timeout
from patchswarm.protocol.membership_index import _InfoView, _SortedIds
from patchswarm.protocol.membership_messages import (
    MAX_SYNC_MEMBERS,
    Ack,
    Gossip,
    MemberState,
    Message,
    Nack,
    NodeInfo,
    Ping,
    PingReq,
    Send,
    Sync,
    Update,
)
from patchswarm.protocol.membership_records import _Broadcast, _Member, _Probe, _Relay, _Suspicion

# Far more refutations than a node makes in its life, far less than the 2**63 the wire carries.
MAX_INCARNATION_JUMP = 1 << 20
# Bounded view: facts about non-members remembered (to relay each once) and broadcasts queued, per member.
HEARD_PER_MEMBER = 8
QUEUE_PER_MEMBER = 4

ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


class Membership:
    """One node's SWIM/Lifeguard membership state machine (see the module docstring)."""

    def __init__(self, me: NodeInfo, config: MembershipConfig, rng: random.Random, now: float) -> None:
        if not me.node_id:
            raise ValueError("a node needs a non-empty node_id")
        self._me = me
        self._cfg = config
        self._rng = rng
        self._incarnation = 0
        self._left = False
        self._awareness = 0
        self._members: dict[str, _Member] = {}
        # Indexes over _members by state, kept by _track (O(log n) per change instead of a sort per query).
        self._usable = _SortedIds()  # ALIVE or SUSPECT
        self._alive_ids = _SortedIds()  # ALIVE
        self._dead_ids = _SortedIds()  # DEAD
        self._gone: set[str] = set()  # DEAD or LEFT: reclaimed after dead_reclaim
        self._suspicions: dict[str, _Suspicion] = {}
        self._queue: dict[str, _Broadcast] = {}
        self._queue_order: list[tuple[int, int, str]] = []  # (transmits, -order, node_id) of _queue, sorted
        self._order = 0
        self._probe_order: list[str] = []
        self._probe_index = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self._seeds: list[NodeInfo] = []
        self._events: list[tuple[NodeInfo, MemberState]] = []
        # Bounded view only: (rank, id) of the members, sorted (the last one leaves first), and the latest
        # (incarnation, state) relayed about each recent non-member, oldest first.
        self._ranks: list[tuple[int, str]] = []
        self._heard: dict[str, tuple[int, MemberState]] = {}
        self._rank_hash = hashlib.blake2b(f"{me.node_id}\0".encode(), digest_size=8)  # _rank's common prefix
        self._next_probe_at = now + rng.uniform(0, config.probe_interval)
        self._next_gossip_at = now
        self._next_sync_at = now + rng.uniform(0, config.sync_interval)
        self._broadcast(self.local())

    # ----------------------------------------------------------------- queries

    @property
    def awareness(self) -> int:
        """Lifeguard local health score, 0 (healthy) .. awareness_max - 1."""
        return self._awareness

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def pending_broadcasts(self) -> int:
        """Updates still waiting to be gossiped (after ``leave``, tick until this is 0 or time is up)."""
        return len(self._queue)

    def settle(self) -> None:
        """Drop the queued broadcasts: what this node knows is old news to the others.  For a
        simulation starting from a swarm that has been running (its members learnt of each other long
        ago); the queue would otherwise carry every member's join round the swarm again.  The events
        stay for ``drain_events`` (the driver has not seen them)."""
        self._queue.clear()
        self._queue_order.clear()

    def local(self) -> Update:
        """This node's own record as it gossips it (ALIVE, or LEFT after ``leave``)."""
        return Update(self._me, self._incarnation, LEFT if self._left else ALIVE, self._me.node_id)

    def members(self) -> list[tuple[NodeInfo, MemberState]]:
        """Everyone known except self: ALIVE, then SUSPECT, DEAD, LEFT; by node_id within a state."""
        ms = sorted(self._members.values(), key=lambda m: (m.state, m.info.node_id))
        return [(m.info, m.state) for m in ms]

    def alive(self) -> list[NodeInfo]:
        """Usable peers (ALIVE and SUSPECT), excluding self, by node_id."""
        members = self._members
        return [members[k].info for k in self._usable.ids]

    def alive_count(self) -> int:
        """How many members ``alive()`` would list (O(1))."""
        return len(self._usable)

    def known(self) -> list[Update]:
        """Full state, self included, by node_id: what a ``Sync`` carries."""
        members = self._members
        ids = sorted(members)
        out = [m.fact or Update(m.info, m.incarnation, m.state, m.origin) for m in (members[k] for k in ids)]
        out.insert(bisect.bisect_left(ids, self._me.node_id), self.local())
        return out

    def drain_events(self) -> list[tuple[NodeInfo, MemberState]]:
        """State (or address) changes of other members since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float:
        """Earliest time ``tick`` has work; ``math.inf`` when none (only after ``leave``)."""
        times = [r.nack_at for r in self._relays.values()]
        times.extend(s.deadline for s in self._suspicions.values())
        times.extend(self._members[k].since + self._cfg.dead_reclaim for k in self._gone)
        if self._probe is not None:
            times.append(self._probe.deadline if self._probe.indirect else self._probe.timeout_at)
        elif not self._left:
            times.append(self._next_probe_at)
        if self._queue:
            times.append(self._next_gossip_at)
        if not self._left:
            times.append(self._next_sync_at)
        return min(times, default=math.inf)

    # ----------------------------------------------------------------- inputs

    def join(self, seeds: list[NodeInfo], now: float) -> list[Send]:
        """Push-pull full state with each seed (a seed's node_id may be "" when only its address is known).

        The seeds are kept: while this node knows no live member, each periodic sync retries them.
        """
        if self._left:
            self._left = False
            self._incarnation += 1
            self._broadcast(self.local())
        me = self._me
        for seed in seeds:
            if seed.node_id != me.node_id and seed.addr != me.addr and seed not in self._seeds:
                self._seeds.append(seed)
        return [self._sync_to(seed, reply=True) for seed in self._seeds if seed in seeds]

    def leave(self, now: float) -> list[Send]:
        """Graceful leave: gossip LEFT about self; probing and syncing stop, pings are still answered."""
        if self._left:
            return []
        self._left = True
        self._probe = None
        self._broadcast(self.local())
        return self._gossip_round(now)

    def receive(self, now: float, sender: NodeInfo, message: Message) -> list[Send]:
        """Handle one message from ``sender``; returns the messages to send in response.

        An unknown sender is added as ALIVE at incarnation 0 (not gossiped: its real incarnation comes
        with its own updates).  A sender we hold DEAD or LEFT is told so, at most once a probe interval,
        so that it can refute.
        """
        if not sender.node_id or sender.node_id == self._me.node_id:
            return []
        incarnation = self._incarnation
        for u in message.piggyback:
            self._apply(u, now)
        if isinstance(message, Sync):
            for u in message.members:
                self._apply(u, now, synced_from=sender.node_id)
        if sender.node_id not in self._members and (rank := self._admit(sender)) is not None:  # talking to us: alive
            self._add(Update(sender, 0, ALIVE, sender.node_id), now, rank)
        out = self._tell_if_dead(sender, now)
        me = self._me.node_id
        if isinstance(message, Ping):
            if message.target_id == me:
                out.append(Send(sender, Ack(message.seq, me, self._take())))
        elif isinstance(message, PingReq):
            out.extend(self._serve_ping_req(now, sender, message))
        elif isinstance(message, Ack):
            out.extend(self._on_ack(message))
        elif isinstance(message, Nack):
            p = self._probe
            if p is not None and p.seq == message.seq and p.target.node_id == message.target_id:
                p.nackers.add(sender.node_id)
        elif isinstance(message, Sync) and message.reply:
            out.append(self._sync_to(sender, reply=False))
        if self._incarnation > incarnation and not any(s.to == sender for s in out):
            out.append(Send(sender, Gossip(self._take())))  # refuted: tell the accuser first, it may not hear otherwise
        return out

    def tick(self, now: float) -> list[Send]:
        """Run everything due at ``now`` (late calls are fine: nothing is replayed twice)."""
        out: list[Send] = []
        for seq, relay in sorted(self._relays.items()):
            if relay.nack_at <= now:
                del self._relays[seq]
                out.append(Send(relay.requester, Nack(relay.seq, relay.target_id, self._take())))
        out.extend(self._probe_step(now))
        for node_id in sorted(self._suspicions):
            s = self._suspicions[node_id]
            if s.deadline <= now:
                del self._suspicions[node_id]
                m = self._members.get(node_id)
                if m is not None and m.state is SUSPECT and m.incarnation == s.incarnation:
                    self._apply(Update(m.info, m.incarnation, DEAD, self._me.node_id), now)
        for node_id in sorted(self._gone):
            m = self._members[node_id]
            if m.since + self._cfg.dead_reclaim <= now:
                self._remove(node_id)
                if self._cfg.max_members:  # (its old news may still travel: not relayed again)
                    self._note_heard(node_id, m.incarnation, m.state)
        if self._queue and self._next_gossip_at <= now:
            self._next_gossip_at = now + self._cfg.gossip_interval
            out.extend(self._gossip_round(now))
        if not self._left and self._next_sync_at <= now:
            self._next_sync_at = now + self._cfg.sync_interval
            out.extend(self._sync_round())
        return out

    # ----------------------------------------------------------------- probing

    def _probe_step(self, now: float) -> list[Send]:
        out: list[Send] = []
        cfg, p = self._cfg, self._probe
        scale = 1 + self._awareness
        if p is not None and not p.indirect and p.timeout_at <= now:
            p.indirect = True
            p.deadline = max(p.deadline, now + (cfg.probe_interval - cfg.probe_timeout) * scale)
            known = self._members.get(p.target.node_id)
            skip = p.target.node_id if known is not None and known.info == p.target else None
            helpers = self._pick(cfg.indirect_probes, self._alive_ids, skip)
            out.extend(Send(h, PingReq(p.seq, p.target, self._take())) for h in helpers)
        if p is not None and p.indirect and p.deadline <= now:
            self._probe = None
            m = self._members.get(p.target.node_id)
            if m is not None and m.state <= SUSPECT:
                if not p.nackers:  # nobody answered at all: our own messages may be what is lost
                    self._adjust_awareness(+1)
                self._apply(Update(m.info, m.incarnation, SUSPECT, self._me.node_id), now)
        if self._probe is None and not self._left and self._next_probe_at <= now:
            self._next_probe_at = now + cfg.probe_interval * (1 + self._awareness)
            target = self._next_target()
            if target is not None:
                seq = self._next_seq()
                timeout_at = now + cfg.probe_timeout * (1 + self._awareness)
                self._probe = _Probe(seq, target, timeout_at, self._next_probe_at)
                out.append(Send(target, Ping(seq, target.node_id, self._take())))
        return out

    def _next_target(self) -> NodeInfo | None:
        for _ in range(2):
            while self._probe_index < len(self._probe_order):
                m = self._members.get(self._probe_order[self._probe_index])
                self._probe_index += 1
                if m is not None and m.state <= SUSPECT:
                    return m.info
            self._probe_order = sorted(self._members)
            self._rng.shuffle(self._probe_order)
            self._probe_index = 0
        return None

    def _on_ack(self, ack: Ack) -> list[Send]:
        p = self._probe
        if p is not None and p.seq == ack.seq and p.target.node_id == ack.target_id:
            self._probe = None
            self._adjust_awareness(-1)
            return []
        relay = self._relays.get(ack.seq)
        if relay is not None and relay.target_id == ack.target_id:
            del self._relays[ack.seq]
            return [Send(relay.requester, Ack(relay.seq, relay.target_id, self._take()))]
        return []

    def _serve_ping_req(self, now: float, sender: NodeInfo, req: PingReq) -> list[Send]:
        if req.target.node_id == self._me.node_id:
            return [Send(sender, Ack(req.seq, self._me.node_id, self._take()))]
        if not req.target.node_id or req.target.node_id == sender.node_id:
            return []
        seq = self._next_seq()
        self._relays[seq] = _Relay(sender, req.seq, req.target.node_id, now + self._cfg.nack_timeout)
        return [Send(req.target, Ping(seq, req.target.node_id, self._take()))]

    def _adjust_awareness(self, delta: int) -> None:
        self._awareness = min(max(self._awareness + delta, 0), self._cfg.awareness_max - 1)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ----------------------------------------------------------------- state rules

    def _apply(self, u: Update, now: float, synced_from: str = "") -> None:
        node_id = u.info.node_id
        if not node_id:
            return
        if node_id == self._me.node_id:
            self._about_me(u)
            return
        m = self._members.get(node_id)
        if m is None:
            # (a DEAD/LEFT stranger is not worth remembering)
            if u.state <= SUSPECT and (rank := self._admit(u.info)) is not None:
                self._add(u, now, rank)
                self._broadcast(u)
            elif self._cfg.max_members:
                self._relay(u)
            return
        state, origin = u.state, u.origin
        if synced_from and state is DEAD:  # memberlist: a pushed DEAD becomes our suspicion, not a verdict
            state, origin = SUSPECT, synced_from
        if u.incarnation < m.incarnation or u.incarnation > m.incarnation + MAX_INCARNATION_JUMP:
            return
        if u.incarnation == m.incarnation:
            if state is SUSPECT and m.state is SUSPECT:
                self._confirm(node_id, Update(m.info, m.incarnation, SUSPECT, origin))
            if state <= m.state:
                return
        changed = state != m.state or u.info != m.info
        if state != m.state:
            m.since = now
            self._track(node_id, m.state, state)
        m.info, m.incarnation, m.state, m.origin = u.info, u.incarnation, state, origin
        m.fact = Update(m.info, m.incarnation, state, origin)
        self._suspicions.pop(node_id, None)
        if state is SUSPECT:
            self._start_suspicion(m, now)
        self._broadcast(m.fact)
        if changed:
            self._events.append((m.info, state))

    def _about_me(self, u: Update) -> None:
        if self._left or u.incarnation > self._incarnation + MAX_INCARNATION_JUMP:
            return
        if u.state is ALIVE:
            if u.incarnation > self._incarnation or (u.incarnation == self._incarnation and u.info != self._me):
                self._refute(u.incarnation)
            return
        if u.incarnation < self._incarnation:  # stale: make sure our newer ALIVE is still travelling
            if self._me.node_id not in self._queue:
                self._broadcast(self.local())
            return
        if u.state is SUSPECT:
            self._adjust_awareness(+1)
        self._refute(u.incarnation)

    def _refute(self, incarnation: int) -> None:
        self._incarnation = max(self._incarnation, incarnation) + 1
        self._broadcast(self.local())

    def _add(self, u: Update, now: float, rank: int) -> None:
        m = _Member(u.info, u.incarnation, u.state, u.origin, now, fact=u)
        self._members[u.info.node_id] = m
        self._track(u.info.node_id, None, u.state)
        if self._cfg.max_members:
            m.rank = rank
            bisect.insort(self._ranks, (rank, u.info.node_id))
            self._heard.pop(u.info.node_id, None)
        pos = self._rng.randint(0, len(self._probe_order))
        self._probe_order.insert(pos, u.info.node_id)
        if pos < self._probe_index:
            self._probe_index += 1
        if u.state is SUSPECT:
            self._start_suspicion(m, now)
        self._events.append((u.info, u.state))

    def _remove(self, node_id: str) -> _Member:
        """Forget a member (reclaimed, or out of a bounded view)."""
        m = self._members.pop(node_id)
        self._track(node_id, m.state, None)
        self._suspicions.pop(node_id, None)
        if self._cfg.max_members:
            del self._ranks[bisect.bisect_left(self._ranks, (m.rank, node_id))]
        return m

    # ----------------------------------------------------------------- bounded view

    def _rank(self, info: NodeInfo) -> int:
        """A pseudo-random rank, fixed per (this node, that node): the view keeps the lowest.  A join seed: -1."""
        for seed in self._seeds:
            if seed.addr == info.addr:
                return -1
        h = self._rank_hash.copy()  # blake2b(f"{own id}\0{their id}"), without hashing the prefix each time
        h.update(info.node_id.encode())
        # The top 62 bits, in order: a compiled (native) build keeps an int under 2**62 unboxed.
        return int.from_bytes(h.digest(), "big") >> 2

    def _admit(self, info: NodeInfo) -> int | None:
        """The rank a stranger joins the view with (0 under full membership), or None if it does not: it
        joins while there is room, and a full bounded view when it ranks below the worst member, which
        then leaves (silently: it is alive).  Full membership admits no one past ``max_full_members``."""
        k = self._cfg.max_members
        if not k:
            return 0 if len(self._members) < self._cfg.max_full_members else None
        rank = self._rank(info)
        if len(self._members) < k:
            return rank
        if rank >= self._ranks[-1][0]:
            return None
        m = self._remove(self._ranks[-1][1])
        self._note_heard(m.info.node_id, m.incarnation, m.state)
        return rank

    def _relay(self, u: Update) -> None:
        """Bounded view: pass on a fact about a non-member once (unless an equal or newer one was)."""
        node_id = u.info.node_id
        seen = self._heard.get(node_id)
        if seen is not None and ((u.incarnation, u.state) <= seen or u.incarnation > seen[0] + MAX_INCARNATION_JUMP):
            return
        self._note_heard(node_id, u.incarnation, u.state)
        self._broadcast(u)
        if u.state >= DEAD:
            self._events.append((u.info, u.state))

    def _note_heard(self, node_id: str, incarnation: int, state: MemberState) -> None:
        heard = self._heard
        heard.pop(node_id, None)  # to the end: the oldest leave first
        heard[node_id] = (incarnation, state)
        if len(heard) > HEARD_PER_MEMBER * self._cfg.max_members:
            del heard[next(iter(heard))]

    def _start_suspicion(self, m: _Member, now: float) -> None:
        n = 1 + len(self._usable)
        shortest, longest = suspicion_bounds(self._cfg, n)
        expected = self._cfg.suspicion_confirmations
        if n - 2 < expected:  # too few others to ever confirm: do not wait for them
            expected = 0
        deadline = now + suspicion_timeout(0, expected, shortest, longest)
        s = _Suspicion(m.incarnation, now, expected, shortest, longest, {m.origin}, deadline)
        self._suspicions[m.info.node_id] = s

    def _confirm(self, node_id: str, u: Update) -> None:
        s = self._suspicions.get(node_id)
        if s is None or s.incarnation != u.incarnation or u.origin in s.confirmers:
            return
        if len(s.confirmers) - 1 >= s.expected:
            return
        s.confirmers.add(u.origin)
        s.deadline = s.start + suspicion_timeout(len(s.confirmers) - 1, s.expected, s.shortest, s.longest)
        self._broadcast(u)  # let the new, independent confirmation reach the others

    # ----------------------------------------------------------------- dissemination

    def _broadcast(self, u: Update) -> None:
        node_id = u.info.node_id
        old = self._queue.get(node_id)
        if old is not None:
            self._queue_remove(old.transmits, old.order, node_id)
        self._order += 1
        self._queue[node_id] = _Broadcast(u, 0, self._order)
        self._queue_order.insert(0, (0, -self._order, node_id))  # the newest of the least sent: first
        k = self._cfg.max_members
        if k and len(self._queue) > QUEUE_PER_MEMBER * k:  # bounded: drop the most sent (oldest among equals)
            q = self._queue_order
            at = -1 if q[-1][2] != self._me.node_id else -2  # never our own record (a refutation)
            del self._queue[q.pop(at)[2]]

    def _queue_remove(self, transmits: int, order: int, node_id: str) -> None:
        q = self._queue_order
        del q[bisect.bisect_left(q, (transmits, -order, node_id))]

    def _take(self, first: Update | None = None) -> tuple[Update, ...]:
        """Up to max_piggyback queued updates, least sent first, newest first among equals (the queue
        is kept in that order, so a message costs O(max_piggyback log n), not a sort of the queue)."""
        out = [] if first is None else [first]
        if not self._queue:
            return tuple(out)
        # (a bounded view counts the recent non-members it heard of too: the cluster is larger than the view)
        known = len(self._members) + len(self._heard)
        limit = self._cfg.retransmit_mult * math.ceil(math.log10(known + 2))
        q = self._queue_order
        k = max(0, self._cfg.max_piggyback - len(out))
        taken, q[:k] = q[:k], []
        for transmits, neg_order, node_id in taken:
            b = self._queue[node_id]
            out.append(b.update)
            b.transmits = transmits + 1
            if b.transmits >= limit:
                del self._queue[node_id]
            else:
                bisect.insort(q, (b.transmits, neg_order, node_id))
        return tuple(out)

    def _gossip_round(self, now: float) -> list[Send]:
        targets = self._pick(self._cfg.gossip_fanout, self._usable)
        return [Send(t, Gossip(self._take())) for t in targets if self._queue]

    def _sync_round(self) -> list[Send]:
        out = [self._sync_to(t, reply=True) for t in self._pick(1, self._alive_ids)]
        if not self._usable:
            out.extend(self._sync_to(seed, reply=True) for seed in self._seeds)
        # one presumed-dead member too: a healed partition finds its way back (lost if it really is dead)
        out.extend(self._sync_to(t, reply=True) for t in self._pick(1, self._dead_ids))
        return out

    def _sync_to(self, to: NodeInfo, reply: bool) -> Send:
        known = self.known()
        if len(known) > MAX_SYNC_MEMBERS:  # more than a frame may list: our own record and a random sample
            me = self._me.node_id
            others = [u for u in known if u.info.node_id != me]
            keep = self._rng.sample(others, MAX_SYNC_MEMBERS - 1) + [self.local()]
            known = sorted(keep, key=lambda u: u.info.node_id)
        return Send(to, Sync(tuple(known), reply, self._take()))

    def _tell_if_dead(self, sender: NodeInfo, now: float) -> list[Send]:
        m = self._members.get(sender.node_id)
        if m is None or m.state < DEAD or now < m.told_at + self._cfg.probe_interval:
            return []
        m.told_at = now
        verdict = Update(m.info, m.incarnation, m.state, m.origin)
        return [Send(sender, Gossip(self._take(first=verdict)))]

    def _pick(self, k: int, among: _SortedIds, skip: str | None = None) -> list[NodeInfo]:
        """``k`` random members of an index (by node_id, less ``skip``): the draws a sample over the
        filtered, sorted member list makes, without building that list."""
        pool = _InfoView(among.ids, self._members, skip)
        return self._rng.sample(pool, min(k, len(pool)))

    def _track(self, node_id: str, old: MemberState | None, new: MemberState | None) -> None:
        """Move a member between the state indexes (``None``: not a member)."""
        for state, present in ((old, False), (new, True)):
            if state is None:
                continue
            op = _SortedIds.add if present else _SortedIds.discard
            if state <= SUSPECT:
                op(self._usable, node_id)
            if state is ALIVE:
                op(self._alive_ids, node_id)
            if state is DEAD:
                op(self._dead_ids, node_id)
            if state >= DEAD:
                (self._gone.add if present else self._gone.discard)(node_id)

    def _sorted(self) -> list[_Member]:
        return [self._members[k] for k in sorted(self._members)]

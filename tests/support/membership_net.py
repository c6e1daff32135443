"""A simulated network of Membership instances (the sans-IO SWIM core) with latency, crashes, one-way
cuts and slow senders, in virtual time; and a check of a Membership's internal indexes.  Shared by
tests/unit/protocol/test_membership.py and test_membership_view.py."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from patchswarm.protocol.membership import Membership
from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.membership_messages import MemberState, Message, NodeInfo, Send

ALIVE, SUSPECT = MemberState.ALIVE, MemberState.SUSPECT
CFG = MembershipConfig()
LATENCY = 0.005


@dataclass
class Net:
    """Nodes n0..n{size-1} joined through one seed; latency-delayed delivery; crashes, cuts and slow links."""

    seed: int
    size: int
    config: MembershipConfig = CFG
    now: float = 0.0
    nodes: dict[str, Membership] = field(default_factory=dict)
    crashed: set[str] = field(default_factory=set)
    cut: set[tuple[str, str]] = field(default_factory=set)  # (src, dst) one-way drops
    extra_delay: dict[str, float] = field(default_factory=dict)  # slow senders
    events: list[tuple[float, str, str, MemberState]] = field(default_factory=list)
    sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    queue: list[tuple[float, int, str, str, Message]] = field(default_factory=list)
    boots: Counter[str] = field(default_factory=Counter)
    _count: int = 0

    def __post_init__(self) -> None:
        self.infos = {f"n{i}": NodeInfo(f"n{i}", f"sim://{i}", zone=f"z{i % 2}") for i in range(self.size)}
        self.by_addr = {info.addr: node_id for node_id, info in self.infos.items()}

    def boot(self, node_id: str, seeds: tuple[str, ...] = ("n0",), address_only: bool = False) -> None:
        self.boots[node_id] += 1
        rng = random.Random(f"{self.seed}/{node_id}/{self.boots[node_id]}")
        self.nodes[node_id] = Membership(self.infos[node_id], self.config, rng, self.now)
        self.crashed.discard(node_id)
        seed_infos = [NodeInfo("", self.infos[s].addr) if address_only else self.infos[s] for s in seeds]
        self.act(node_id, lambda m: m.join(seed_infos, self.now))

    def act(self, node_id: str, call: Callable[[Membership], list[Send]]) -> None:
        self._route(node_id, call(self.nodes[node_id]))
        self._collect(node_id)

    def crash(self, node_id: str) -> None:
        self.crashed.add(node_id)

    def _route(self, src: str, sends: list[Send]) -> None:
        for s in sends:
            self.sent[(src, type(s.message).__name__)] += 1
            dst = s.to.node_id or self.by_addr.get(s.to.addr, "")
            if src in self.crashed or (src, dst) in self.cut or dst not in self.infos:
                continue
            at = self.now + LATENCY + self.extra_delay.get(src, 0.0)
            heapq.heappush(self.queue, (at, self._count, src, dst, s.message))
            self._count += 1

    def _collect(self, node_id: str) -> None:
        for info, state in self.nodes[node_id].drain_events():
            self.events.append((self.now, node_id, info.node_id, state))

    def live(self) -> list[str]:
        return [k for k in sorted(self.nodes) if k not in self.crashed]

    def run(self, duration: float) -> None:
        end, same_time = self.now + duration, 0
        while True:
            nxt = min([self.queue[0][0]] if self.queue else [], default=math.inf)
            nxt = min([nxt, *(self.nodes[k].next_deadline() for k in self.live())])
            if nxt > end:
                break
            same_time = same_time + 1 if nxt <= self.now else 0
            assert same_time < 1000, "a node keeps asking for a tick that does nothing"
            self.now = max(self.now, nxt)
            while self.queue and self.queue[0][0] <= self.now:
                _, _, src, dst, msg = heapq.heappop(self.queue)
                if dst in self.crashed or dst not in self.nodes:
                    continue
                self._route(dst, self.nodes[dst].receive(self.now, self.infos[src], msg))
                self._collect(dst)
            for k in self.live():
                if self.nodes[k].next_deadline() <= self.now:
                    self.act(k, lambda m: m.tick(self.now))
        self.now = end

    def view(self, observer: str, node_id: str) -> tuple[MemberState, int] | None:
        for u in self.nodes[observer].known():
            if u.info.node_id == node_id:
                return u.state, u.incarnation
        return None

    def about(self, node_id: str, since: float = 0.0) -> list[tuple[float, str, MemberState]]:
        return [(t, obs, st) for t, obs, n, st in self.events if n == node_id and t >= since]


def check_indexes(m: Membership) -> None:
    """The state indexes and the ordered broadcast queue agree with a recomputation from the members."""
    members = m._members
    assert m._usable.ids == sorted(k for k, x in members.items() if x.state <= SUSPECT)
    assert m._alive_ids.ids == sorted(k for k, x in members.items() if x.state is ALIVE)
    assert m._dead_ids.ids == sorted(k for k, x in members.items() if x.state is MemberState.DEAD)
    assert m._gone == {k for k, x in members.items() if x.state >= MemberState.DEAD}
    assert m.alive() == [i for i, s in sorted(m.members(), key=lambda e: e[0].node_id) if s <= SUSPECT]
    assert m.alive_count() == len(m.alive())
    assert m._queue_order == sorted((b.transmits, -b.order, k) for k, b in m._queue.items())

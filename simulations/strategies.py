"""The distribution strategies a study compares on the same hosts, network and churn.

* ``checkpoint``: every host downloads the full checkpoint from one central store (the seed host,
  with the seed's uplink).  A host that falls behind fetches only the newest checkpoint.
* ``central``: every host downloads each version's patch from the same central store, in order.
* ``swarm``: the real swarm nodes (``simulations.swarm_strategy``), the seed serving the patch.
* the Kumar-Ross lower bound for the patch (``bound``), printed beside them.

The two central strategies need no nodes: each host runs one flow at a time from the store on
the flow model (``simulations.network``): the request pays one one-way latency, the reply is a
flow (latency, then its max-min share).  A crash cancels the host's flow; the bytes of its whole
chunks are kept (a ranged GET resumes from there), and the host resumes when it rejoins.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.scheduler_types import SchedulerConfig
from patchswarm.simulations.bounds import kumar_ross
from patchswarm.simulations.network import Flow, Network
from patchswarm.simulations.placeholder import placeholder_held
from patchswarm.simulations.runner import Churn, simulate_stream
from patchswarm.simulations.scenario import ChurnEvent, Layout, Scenario
from patchswarm.simulations.synthetic import synthetic_setup


@dataclass(frozen=True)
class Outcome:
    """One host and one version under one strategy."""

    host: str
    version: int
    completion: float  # seconds from the version's publication until the host held it (or newer); inf: never
    from_seed: float  # bytes of this version's payload the host took from the seed/store
    from_peers: float


@dataclass(frozen=True)
class StrategyRun:
    strategy: str
    outcomes: tuple[Outcome, ...]  # host-major, versions in order
    seed_egress: float  # bytes the seed/store put on the network until the last publication + run.deadline
    events: int  # network events processed (swarm: virtual-time jumps of the loop)
    wall: float  # wall seconds the simulation took
    note: str = ""

    def times(self, version: int | None = None) -> list[float]:
        return [o.completion for o in self.outcomes if version is None or o.version == version]


def bound(s: Scenario, lay: Layout) -> float:
    """No schedule gives every receiver the patch faster: Kumar-Ross over the hosts' links, and, with regions,
    the patch crossing into each region without the seed over that region's incoming backbones at least once."""
    kr = kumar_ross(s.patch_size, lay.seed.up, [p.up for p in lay.peers], [p.down for p in lay.peers])
    populated = {p.region for p in lay.peers} - {lay.seed.region}
    for region in sorted(populated):
        incoming = math.fsum(b.capacity for b in lay.backbones if region in (b.a, b.b))
        kr = max(kr, s.patch_size / incoming if incoming > 0 else math.inf)
    return kr


@dataclass
class _HostState:
    up: bool = True
    held: int = 0
    target: int = 0  # the version being fetched or resumed (0: none)
    done: float = 0.0  # bytes of the target already held (whole chunks)
    busy: bool = False  # a request or a flow is under way
    flow: Flow | None = None
    token: int = 0  # bumps on crash: a request sent before it is void


@dataclass(order=True)
class _Agenda:
    time: float
    seq: int
    action: Callable[[float], None] = field(compare=False)


def central(s: Scenario, lay: Layout, churn: Sequence[ChurnEvent], kind: str) -> StrategyRun:
    """``kind``: "checkpoint" (full checkpoints, newest only) or "central" (each patch in order)."""
    if kind not in ("checkpoint", "central"):
        raise ValueError(f"unknown central strategy {kind!r}")
    wall0 = time.perf_counter()
    size = float(s.checkpoint_size if kind == "checkpoint" else s.patch_size)
    net = Network([lay.seed, *lay.peers], lay.regions, lay.backbones, window=s.window, quantum=s.quantum)
    state = {p.id: _HostState() for p in lay.peers}
    reached: dict[tuple[str, int], float] = {}
    got: dict[tuple[str, int], float] = {}
    agenda: list[_Agenda] = []
    seq = itertools.count()
    published = 0

    def at(t: float, action: Callable[[float], None]) -> None:
        heapq.heappush(agenda, _Agenda(t, next(seq), action))

    def kick(hid: str, now: float) -> None:
        st = state[hid]
        if not st.up or st.busy or published <= st.held:
            return
        want = st.held + 1 if kind == "central" else published
        if want != st.target:  # else resume what a crash interrupted
            st.target, st.done = want, 0.0
        st.busy = True
        token = st.token
        at(now + net.latency(hid, lay.seed.id), lambda t: start(hid, token, t))  # the request leg

    def start(hid: str, token: int, now: float) -> None:
        st = state[hid]
        if st.token == token:
            st.flow = net.add_flow(now, lay.seed.id, hid, size - st.done, on_done=lambda f: finished(hid, f))

    def finished(hid: str, f: Flow) -> None:
        st = state[hid]
        got[(hid, st.target)] = got.get((hid, st.target), 0.0) + f.size
        for v in range(st.held + 1, st.target + 1):
            reached[(hid, v)] = f.done_at
        st.held, st.target, st.done, st.busy, st.flow = st.target, 0, 0.0, False, None
        kick(hid, f.done_at)

    def publish(v: int, now: float) -> None:
        nonlocal published
        published = v
        for hid in state:
            kick(hid, now)

    def change(e: ChurnEvent, now: float) -> None:
        st = state[e.host]
        if e.up and not st.up:
            st.up = True
            kick(e.host, now)
        elif not e.up and st.up:
            st.up, st.busy = False, False
            st.token += 1
            if st.flow is not None:
                net.cancel(now, st.flow)
                moved = st.flow.size - st.flow.remaining
                got[(e.host, st.target)] = got.get((e.host, st.target), 0.0) + moved
                st.done += math.floor(moved / s.chunk_size) * s.chunk_size
                st.flow = None

    window_egress = math.nan

    def measure(now: float) -> None:
        """The seed's egress at the end of the measured window (what the swarm's run is cut at):
        the store goes on serving past it, for the completions, but those bytes are not the window's.
        Read without settling the flows: a settle here would split their float arithmetic in two and
        move later completions by an ulp."""
        nonlocal window_egress
        moving = [f for st in state.values() if (f := st.flow) is not None and f.state == "active"]
        window_egress = net.traffic.sent.get(lay.seed.id, 0.0) + math.fsum(f.size - f.remaining_at(now) for f in moving)

    for v in range(1, s.versions + 1):
        at(s.publication(v), functools.partial(publish, v))
    at(s.publication(s.versions) + s.deadline, measure)
    for e in churn:
        at(e.time, functools.partial(change, e))
    events = 0
    while True:
        t_net = net.next_event_time()
        t_ag = agenda[0].time if agenda else math.inf
        t = min(t_net, t_ag)
        if t == math.inf:  # no deadline: the store serves everyone who is up, eventually
            break
        if t_net <= t_ag:
            net.advance(t_net)
            events += 1
        else:
            heapq.heappop(agenda).action(t_ag)
    outcomes = tuple(
        Outcome(
            p.id,
            v,
            reached[(p.id, v)] - s.publication(v) if (p.id, v) in reached else math.inf,
            got.get((p.id, v), 0.0),
            0.0,
        )
        for p in lay.peers
        for v in range(1, s.versions + 1)
    )
    return StrategyRun(kind, outcomes, window_egress, events, time.perf_counter() - wall0)


_SCHEDULER_KEYS: tuple[str, ...] = ("max_inflight", "max_inflight_per_peer", "max_inflight_per_remote_peer")
_SCHEDULER_KEYS += ("max_inflight_seed",)
_SCHEDULER_KEYS += ("max_inflight_remote", "seed_patience", "endgame_remaining", "max_peers")
_SCHEDULER_KEYS += ("tree_patience", "max_inflight_per_parent")


def node_options(s: Scenario) -> dict[str, object]:
    """The scenario's ``[swarm]`` settings as NodeConfig keywords (the scheduler's inside a SchedulerConfig)."""
    opts: dict[str, object] = {k: v for k, v in s.swarm if k not in _SCHEDULER_KEYS and k != "max_members"}
    sched: dict[str, Any] = {k: v for k, v in s.swarm if k in _SCHEDULER_KEYS}
    if sched:
        opts["scheduler"] = SchedulerConfig(**sched)
    return opts


def swarm(
    s: Scenario,
    lay: Layout,
    churn: Sequence[ChurnEvent],
    progress: Callable[[float, int, int], None] | None = None,
) -> StrategyRun:
    """The real swarm nodes in placeholder mode (real signed manifests, sized chunks): every peer starts
    holding the anchor (version 0); versions 1..count are patches of ``payload.patch_size``."""
    wall0 = time.perf_counter()
    run = synthetic_setup(patch_bytes=s.patch_size, chunk_bytes=s.chunk_size, versions=s.versions)
    members = dict(s.swarm).get("max_members")  # a membership setting, not a NodeConfig field
    result = simulate_stream(
        run.setup,
        lay.seed,
        list(lay.peers),
        versions=run.versions,
        interval=s.interval,
        regions=lay.regions,
        backbones=lay.backbones,
        window=s.window,
        quantum=s.quantum,
        tcp=s.tcp,
        pace_seed=s.seed_paced,
        seed=s.rng_seed,
        churn=Churn(events=tuple((e.time, e.host, e.up) for e in churn)) if churn else None,
        start_from=placeholder_held(0),
        deadline=s.deadline,
        node_options=node_options(s),
        membership=MembershipConfig(max_members=int(members)) if members else None,
        progress=progress,
    )
    rows = {(r.host, r.version): r for r in result.rows}
    outcomes = tuple(
        Outcome(p.id, v, r.latency, float(r.from_seed), float(r.from_peers))
        for p in lay.peers
        for v in run.versions
        if (r := rows[(p.id, v)]) is not None
    )
    note = "; ".join(f"{h}: {e}" for h, e in sorted(result.errors.items()))
    return StrategyRun("swarm", outcomes, float(result.seed_uploaded), result.events, time.perf_counter() - wall0, note)

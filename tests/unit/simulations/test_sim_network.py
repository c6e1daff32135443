"""The flow-level network model: the golden max-min case, caps, routes, and properties of every allocation.

The incremental re-sharing (simulations/network_share.py) is checked against a recomputation from
scratch after every event, on random scenarios and on random swarm-shaped workloads (many flows
per link, equal capacities, so ties everywhere), and must never need its fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.simulations.bounds import kumar_ross, mundinger
from patchswarm.simulations.network import (
    TOLERANCE,
    Backbone,
    Flow,
    Host,
    Network,
    NetworkError,
    Region,
    has_bottleneck,
)

MB = 1e6


def run_all(net: Network) -> list[Flow]:
    done: list[Flow] = []
    while (t := net.next_event_time()) < math.inf:
        done += net.advance(t)
    return done


def test_golden_max_min_case_of_design_section_7() -> None:
    """SimGrid CM02: a 100 MB/s seed uplink, two 100 MB flows, one receiver's downlink at 30 MB/s, 11 ms latency."""
    net = Network(
        [Host("seed", "lan", up=100 * MB), Host("slow", "lan", down=30 * MB), Host("fast", "lan")],
        [Region("lan", latency=0.011)],
    )
    slow = net.add_flow(0.0, "seed", "slow", 100 * MB)
    fast = net.add_flow(0.0, "seed", "fast", 100 * MB)
    done = run_all(net)
    assert [f.id for f in done] == [fast.id, slow.id]
    assert fast.done_at == pytest.approx(1.4396, abs=1e-3)
    assert slow.done_at == pytest.approx(3.3443, abs=1e-3)
    # The exact values: latency once, then 70 MB/s (and 30 MB/s), then 30 MB/s for the rest.
    assert fast.done_at == pytest.approx(0.011 + 100 / 70, rel=1e-12)
    assert slow.done_at == pytest.approx(0.011 + 10 / 3, rel=1e-12)
    assert net.traffic.sent == {"seed": 200 * MB}


def test_golden_case_in_mebibytes_gives_the_same_times() -> None:
    mib = float(1 << 20)
    net = Network(
        [Host("seed", "lan", up=100 * mib), Host("slow", "lan", down=30 * mib), Host("fast", "lan")],
        [Region("lan", latency=0.011)],
    )
    slow = net.add_flow(0.0, "seed", "slow", 100 * mib)
    fast = net.add_flow(0.0, "seed", "fast", 100 * mib)
    run_all(net)
    assert (round(fast.done_at, 4), round(slow.done_at, 4)) == (1.4396, 3.3443)


@pytest.mark.parametrize("quantum", [1e-4, 1e-3, 0.05])
def test_a_time_quantum_makes_events_late_by_less_than_it_never_early(quantum: float) -> None:
    net = Network(
        [Host("seed", "lan", up=100 * MB), Host("slow", "lan", down=30 * MB), Host("fast", "lan")],
        [Region("lan", latency=0.011)],
        quantum=quantum,
    )
    slow = net.add_flow(0.0, "seed", "slow", 100 * MB)
    fast = net.add_flow(0.0, "seed", "fast", 100 * MB)
    run_all(net)
    exact_fast, exact_slow = 0.011 + 100 / 70, 0.011 + 10 / 3
    assert exact_fast <= fast.done_at < exact_fast + 2 * quantum  # the activation and the completion round up
    assert exact_slow - 1e-12 <= slow.done_at < exact_slow + 3 * quantum
    assert net.traffic.sent == {"seed": 200 * MB}


def test_window_caps_a_flow_at_window_over_rtt() -> None:
    net = Network([Host("a", "r"), Host("b", "r")], [Region("r", latency=0.05)], window=1 * MB)
    f = net.add_flow(1.0, "a", "b", 10 * MB)
    run_all(net)
    # 1 MB per 100 ms round trip = 10 MB/s; the 50 ms latency is paid once, before the transfer.
    assert f.done_at == pytest.approx(1.0 + 0.05 + 1.0)


def test_no_latency_and_no_limits_completes_at_once() -> None:
    net = Network([Host("a"), Host("b")])
    f = net.add_flow(2.5, "a", "b", 123)
    assert net.next_event_time() == 2.5
    assert run_all(net) == [f]
    assert f.done_at == 2.5


def test_backbone_is_shared_by_flows_crossing_it_and_routes_take_the_lowest_latency() -> None:
    hosts = [Host(f"{r}{i}", r) for r in "abc" for i in range(2)]
    net = Network(
        hosts,
        [Region("a", 0.001), Region("b", 0.001), Region("c", 0.001)],
        [
            Backbone("a", "b", capacity=10 * MB, latency=0.1),
            Backbone("b", "c", 10 * MB, 0.01),
            Backbone("a", "c", 5, 1.0),
        ],
        window=None,
    )
    assert net.latency("a0", "c0") == pytest.approx(0.11)  # via b, not over the slow direct link
    f1 = net.add_flow(0.0, "a0", "b0", 10 * MB)
    f2 = net.add_flow(0.0, "a1", "b1", 10 * MB)
    f3 = net.add_flow(0.0, "b0", "a0", 10 * MB)  # the other direction has its own capacity
    run_all(net)
    assert f1.done_at == pytest.approx(0.1 + 2.0)
    assert f2.done_at == pytest.approx(0.1 + 2.0)
    assert f3.done_at == pytest.approx(0.1 + 1.0)


def test_a_pinned_backbone_is_the_route_even_when_a_detour_is_faster() -> None:
    """RTTs of 20 / 80 / 150 ms between three regions (the real-latency testbed's) break the triangle
    inequality; a pinned backbone keeps b <-> c at its own 75 ms instead of 50 ms through a."""
    hosts = [Host(f"{r}0", r) for r in "abc"]
    links = [Backbone("a", "b", latency=0.010), Backbone("a", "c", latency=0.040)]
    free = Network(hosts, [], [*links, Backbone("b", "c", 10 * MB, 0.075)], window=None)
    pinned = Network(hosts, [], [*links, Backbone("b", "c", 10 * MB, 0.075, pinned=True)], window=None)
    assert free.latency("b0", "c0") == pytest.approx(0.050)  # through a
    assert pinned.latency("b0", "c0") == pytest.approx(0.075)
    assert pinned.latency("c0", "b0") == pytest.approx(0.075)  # both directions
    assert pinned.latency("a0", "c0") == pytest.approx(0.040)  # other pairs keep their routes
    f = pinned.add_flow(0.0, "b0", "c0", 10 * MB)  # and the flow crosses the pinned link's capacity
    run_all(pinned)
    assert f.done_at == pytest.approx(0.075 + 1.0)


def test_cancel_counts_the_bytes_moved_so_far_and_frees_capacity() -> None:
    net = Network([Host("s", up=10.0), Host("a"), Host("b")], window=None)
    fa = net.add_flow(0.0, "s", "a", 100.0)
    fb = net.add_flow(0.0, "s", "b", 100.0)
    net.advance(4.0)
    net.cancel(4.0, fa)  # 20 bytes moved at 5 B/s
    run_all(net)
    assert fb.done_at == pytest.approx(4.0 + 80.0 / 10.0)
    assert net.traffic.sent["s"] == pytest.approx(120.0)
    assert fa.state == "cancelled" and fb.state == "done"


def test_unknown_hosts_and_missing_routes_are_refused() -> None:
    net = Network([Host("a", "x"), Host("b", "y")])
    with pytest.raises(NetworkError):
        net.add_flow(0.0, "a", "zz", 1)
    with pytest.raises(NetworkError):
        net.add_flow(0.0, "a", "b", 1)


def test_bounds() -> None:
    # docs/design.md#distribution-lower-bounds: 500 MB to 1,000 nodes at 10 Gbit/s: 0.40 s, 0.43 s with 4 MiB chunks.
    u = 10e9 / 8
    assert kumar_ross(500 * MB, u, [u] * 1000, [u] * 1000) == pytest.approx(0.4)
    assert mundinger(500 * MB, u, 1000, math.ceil(500 * MB / (4 << 20))) == pytest.approx(0.43, abs=0.005)
    assert kumar_ross(500 * MB, u, [], []) == 0.0
    assert kumar_ross(100.0, 10.0, [0.0, 0.0], [math.inf, 5.0]) == 20.0


# ---------------------------------------------------------------- properties


@dataclass
class Scenario:
    hosts: list[Host]
    regions: list[Region]
    backbones: list[Backbone]
    window: float | None
    flows: list[tuple[float, int, int, float]]  # (start, src index, dst index, bytes)
    cancels: list[tuple[float, int]]  # (time, flow index)


capacities = st.one_of(st.just(math.inf), st.sampled_from([1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0]))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    nreg = draw(st.integers(1, 3))
    regions = [Region(f"r{i}", draw(st.sampled_from([0.0, 0.001, 0.05, 0.2]))) for i in range(nreg)]
    backbones = [
        Backbone(f"r{i}", f"r{j}", draw(capacities), draw(st.sampled_from([0.0, 0.01, 0.1])))
        for i in range(nreg)
        for j in range(i + 1, nreg)
    ]
    nhosts = draw(st.integers(2, 7))
    hosts = [
        Host(f"h{i}", f"r{draw(st.integers(0, nreg - 1))}", draw(capacities), draw(capacities)) for i in range(nhosts)
    ]
    window = draw(st.sampled_from([None, 1.0, 4.0, 64.0]))
    flows = []
    for _ in range(draw(st.integers(1, 14))):
        src = draw(st.integers(0, nhosts - 1))
        dst = draw(st.integers(0, nhosts - 2))
        dst += dst >= src
        start = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5]))
        size = draw(st.sampled_from([0.0, 1.0, 7.0, 20.0, 100.0]))
        flows.append((start, src, dst, size))
    cancels = [(draw(st.sampled_from([0.3, 1.2, 3.0])), draw(st.integers(0, len(flows) - 1))) for _ in range(2)]
    cancels = draw(st.sampled_from([[], cancels]))
    return Scenario(hosts, regions, backbones, window, flows, sorted(cancels))


def simulate(sc: Scenario, check: bool) -> list[tuple[int, float, float]]:
    """Run a scenario event by event; with ``check``, verify the allocation after every event."""
    net = Network(sc.hosts, sc.regions, sc.backbones, window=sc.window)
    adds = sorted(enumerate(sc.flows), key=lambda x: (x[1][0], x[0]))
    cancels = list(sc.cancels)
    flows: dict[int, Flow] = {}
    moved: dict[int, float] = {}  # bytes integrated from the observed rates, independent of the model's books
    t = 0.0
    while True:
        t_next = min(
            net.next_event_time(),
            adds[0][1][0] if adds else math.inf,
            cancels[0][0] if cancels else math.inf,
        )
        if t_next == math.inf:
            break
        for f in net.active_flows():
            moved[f.id] = moved.get(f.id, 0.0) + f.rate * (t_next - t) if f.rate < math.inf else f.size
        t = t_next
        net.advance(t)
        while adds and adds[0][1][0] <= t:
            i, (_, s, d, size) = adds.pop(0)
            flows[i] = net.add_flow(t, sc.hosts[s].id, sc.hosts[d].id, size)
        while cancels and cancels[0][0] <= t:
            _, i = cancels.pop(0)
            if i in flows:
                net.cancel(t, flows[i])
        if check:
            check_allocation(net)
    for f in flows.values():
        assert f.state in ("done", "cancelled")
        if f.state == "done":
            assert f.done_at >= f.start + f.latency - 1e-12
            if f.size > 0 and f.rate < math.inf and f.id in moved:
                assert moved[f.id] == pytest.approx(f.size, rel=1e-6, abs=1e-6)
    if check:
        assert net.sharer.restarts == 0  # the incremental path handled every event itself
        total = sum(f.size - f.remaining for f in flows.values())
        assert sum(net.traffic.sent.values()) == pytest.approx(total)
        assert sum(net.traffic.received.values()) == pytest.approx(total)
        assert all(f.remaining == 0 for f in flows.values() if f.state == "done")
    return [(i, f.done_at, f.remaining) for i, f in sorted(flows.items())]


def check_allocation(net: Network) -> None:
    active = net.active_flows()
    load: dict[int, float] = {}
    peak: dict[int, float] = {}
    for f in active:
        for r in f.resources:
            load[r.index] = load.get(r.index, 0.0) + f.rate
            peak[r.index] = max(peak.get(r.index, 0.0), f.rate)
    for r in net.resources():
        assert load.get(r.index, 0.0) <= r.capacity * (1 + TOLERANCE) + 1e-12, r
        assert r.load == pytest.approx(load.get(r.index, 0.0), rel=1e-9, abs=1e-12)  # the model's books
    for f in active:
        assert f.rate <= f.cap * (1 + TOLERANCE)
        # Max-min: capped, or on a saturated resource where no flow runs faster (Bertsekas & Gallager).
        bottlenecked = f.rate == math.inf or f.rate >= f.cap * (1 - TOLERANCE)
        for r in f.resources:
            saturated = load[r.index] >= r.capacity * (1 - TOLERANCE)
            bottlenecked = bottlenecked or (saturated and f.rate >= peak[r.index] * (1 - TOLERANCE))
        assert bottlenecked, f
        assert has_bottleneck(f), f
    full = net.full_allocation()
    for f in active:
        assert f.rate == pytest.approx(full[f.id], rel=1e-6, abs=1e-9), f


@given(scenarios())
def test_every_allocation_is_feasible_max_min_and_equal_to_a_full_recomputation(sc: Scenario) -> None:
    simulate(sc, check=True)


@given(scenarios())
def test_same_scenario_same_results(sc: Scenario) -> None:
    assert simulate(sc, check=False) == simulate(sc, check=False)


def test_many_flows_on_shared_links_stay_max_min() -> None:
    """A denser case than hypothesis draws: 40 hosts, 300 flows, staggered starts, one shared seed."""
    import random

    rng = random.Random(5)
    hosts = [Host("seed", "r0", up=50.0)] + [
        Host(f"h{i}", f"r{i % 3}", up=rng.choice([2.0, 5.0, 10.0]), down=rng.choice([5.0, 20.0, math.inf]))
        for i in range(40)
    ]
    regions = [Region(f"r{i}", 0.01 * i) for i in range(3)]
    backbones = [Backbone("r0", "r1", 40.0, 0.02), Backbone("r1", "r2", 30.0, 0.02), Backbone("r0", "r2", 25.0, 0.05)]
    flows = []
    for _ in range(300):
        s, d = rng.sample(range(len(hosts)), 2)
        flows.append((rng.choice([0.0, 1.0, 2.0, 3.0]), s, d, rng.choice([5.0, 10.0, 40.0])))
    sc = Scenario(hosts, regions, backbones, 8.0, flows, [(1.5, 3), (2.2, 17)])
    assert simulate(sc, check=True) == simulate(sc, check=False)


def test_a_change_reaches_flows_beyond_the_saturated_resources_it_touches() -> None:
    """f leaves X's uplink; h grows and fills B's downlink, which was not saturated, so g must slow down.

    Recomputing only the flows linked to f through saturated resources ({h}) would give h 3 and leave g at 5.
    """
    net = Network([Host("A", up=10.0), Host("B", down=8.0), Host("X", up=4.0), Host("C")], window=None)
    g = net.add_flow(0.0, "A", "B", 1000.0)  # A's uplink and B's downlink
    k = net.add_flow(0.0, "A", "C", 1000.0)  # A's uplink
    h = net.add_flow(0.0, "X", "B", 1000.0)  # X's uplink and B's downlink
    f = net.add_flow(0.0, "X", "C", 2.0)  # X's uplink
    net.advance(0.0)
    assert (g.rate, k.rate, h.rate, f.rate) == (5.0, 5.0, 2.0, 2.0)  # B's downlink carries 7 of 8
    net.advance(net.next_event_time())
    assert f.state == "done" and f.done_at == 1.0
    assert (g.rate, k.rate, h.rate) == (4.0, 6.0, 4.0)


# ---------------------------------------------------------------- swarm-shaped workloads


@dataclass
class Swarm:
    hosts: list[Host]
    window: float | None
    steps: list[tuple[str, int, int, float]]  # ("add", src, dst, bytes) at the current time, or ("next", ...)


@st.composite
def swarms(draw: st.DrawFn) -> Swarm:
    """Hosts with equal or few distinct link speeds (ties), flows added in bursts as others complete."""
    n = draw(st.integers(3, 12))
    speeds = st.sampled_from([4.0, 8.0, 8.0, 12.0, math.inf])
    hosts = [Host(f"h{i}", "r", draw(speeds), draw(speeds)) for i in range(n)]
    steps: list[tuple[str, int, int, float]] = []
    for _ in range(draw(st.integers(1, 60))):
        if draw(st.booleans()):
            src = draw(st.integers(0, n - 1))
            dst = (src + draw(st.integers(1, n - 1))) % n
            steps.append(("add", src, dst, draw(st.sampled_from([1.0, 4.0, 4.0, 16.0]))))
        else:
            steps.append(("next", draw(st.integers(0, 3)), 0, 0.0))  # ... or cancel flow k of the active ones
    return Swarm(hosts, draw(st.sampled_from([None, 4.0])), steps)


def run_swarm(sw: Swarm, latency: float) -> list[tuple[int, float]]:
    net = Network(sw.hosts, [Region("r", latency)], window=sw.window)
    flows: list[Flow] = []
    t = 0.0
    for kind, a, b, size in sw.steps:
        if kind == "add":
            flows.append(net.add_flow(t, sw.hosts[a].id, sw.hosts[b].id, size))
            continue
        if a == 0 and net.active_flows():  # cancel the oldest active flow
            net.cancel(t, net.active_flows()[0])
        elif (t_next := net.next_event_time()) < math.inf:
            t = t_next
            net.advance(t)
        check_allocation(net)
    run_all(net)
    assert net.sharer.restarts == 0
    return [(f.id, f.done_at) for f in flows]


@given(swarms(), st.sampled_from([0.0, 0.001]))
def test_incremental_sharing_on_swarm_workloads_equals_a_full_recomputation(sw: Swarm, latency: float) -> None:
    assert run_swarm(sw, latency) == run_swarm(sw, latency)


def test_a_full_recomputation_leaves_books_the_incremental_sharing_continues_from() -> None:
    """``Sharer.recompute`` (the fallback) rebuilds every flow's bottleneck and every resource's sums."""
    import random

    rng = random.Random(3)
    hosts = [Host(f"h{i}", "r", up=rng.choice([5.0, 10.0]), down=rng.choice([5.0, 10.0, 20.0])) for i in range(12)]
    net = Network(hosts, [Region("r", 0.001)], window=None)
    for _ in range(80):
        s, d = rng.sample(range(12), 2)
        net.add_flow(rng.choice([0.0, 0.5, 1.0]), hosts[s].id, hosts[d].id, rng.choice([2.0, 5.0, 9.0]))
    for step in range(40):
        t = net.next_event_time()
        net.advance(t)
        if step % 7 == 3:
            before = {f.id: f.rate for f in net.active_flows()}
            net.sharer.recompute(t, sorted(net.active_flows(), key=lambda f: f.id))
            assert {f.id: f.rate for f in net.active_flows()} == pytest.approx(before, rel=1e-9)
        check_allocation(net)
    run_all(net)
    assert net.sharer.restarts == 0

"""SWIM + Lifeguard membership, driven over an in-memory network with a virtual clock."""

from __future__ import annotations

import heapq
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.membership import MAX_INCARNATION_JUMP, Membership
from patchswarm.protocol.membership_config import MembershipConfig, suspicion_bounds, suspicion_timeout
from patchswarm.protocol.membership_messages import (
    Ack,
    Gossip,
    MemberState,
    Nack,
    NodeInfo,
    Ping,
    PingReq,
    Send,
    Sync,
    Update,
)
from tests.support.membership_net import CFG, Net, check_indexes

ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


def converged(seed: int = 1, size: int = 8) -> Net:
    net = Net(seed, size)
    net.boot("n0", seeds=())
    for i in range(1, size):
        net.run(0.1)
        net.boot(f"n{i}", address_only=i % 2 == 1)
    net.run(10.0)
    assert_all_alive(net)
    return net


def assert_all_alive(net: Net) -> None:
    for k in net.live():
        m = net.nodes[k]
        assert [i.node_id for i in m.alive()] == [x for x in net.live() if x != k], k
        assert all(state is ALIVE for info, state in m.members() if info.node_id in net.live()), (k, m.members())


def test_cluster_of_8_from_one_seed_converges() -> None:
    net = converged()
    assert all(net.nodes[k].awareness == 0 for k in net.live())
    assert not [e for e in net.events if e[3] is not ALIVE]


def test_crashed_node_is_suspected_then_dead_everywhere_within_bound() -> None:
    net = converged()
    t0 = net.now
    net.crash("n5")
    bound = CFG.probe_interval * net.size + suspicion_bounds(CFG, net.size)[1] + 2 * CFG.probe_interval
    net.run(bound)
    lifeguard_bound = CFG.probe_interval * net.size + suspicion_bounds(CFG, net.size)[0] + 2 * CFG.probe_interval
    for k in net.live():
        seen = [(t, state) for t, obs, state in net.about("n5", since=t0) if obs == k]
        assert [state for _, state in seen] == [SUSPECT, DEAD], (k, seen)
        assert seen[1][0] <= t0 + bound
        assert seen[1][0] <= t0 + lifeguard_bound  # (this seed) the other probers' confirmations cut the wait
    net.run(CFG.dead_reclaim + 1)
    assert all(net.view(k, "n5") is None for k in net.live())  # reclaimed
    assert_all_alive(net)


def test_slow_node_refutes_suspicion_and_stays_alive() -> None:
    net = converged(seed=3)
    t0 = net.now
    net.extra_delay["n3"] = 1.5  # its messages arrive, but after any probe deadline
    net.run(15.0)
    del net.extra_delay["n3"]
    net.run(20.0)
    about = net.about("n3", since=t0)
    assert any(state is SUSPECT for _, _, state in about)  # it was suspected...
    assert not any(state >= DEAD for _, _, state in about)  # ...but never declared dead
    assert net.nodes["n3"].incarnation >= 1
    for k in net.live():
        if k != "n3":
            assert net.view(k, "n3") == (ALIVE, net.nodes["n3"].incarnation)
    assert_all_alive(net)


def test_indirect_probes_save_a_node_behind_a_one_way_cut() -> None:
    net = converged(seed=4)
    t0 = net.now
    net.cut.add(("n0", "n4"))  # n0 cannot reach n4, n4 reaches n0
    net.run(30.0)
    assert net.sent[("n0", "PingReq")] > 0 and net.sent[("n4", "PingReq")] > 0
    assert not [e for e in net.events if e[0] >= t0 and e[3] is not ALIVE]
    assert net.nodes["n0"].awareness == 0
    assert_all_alive(net)


def test_graceful_leave_is_left_everywhere_then_forgotten() -> None:
    net = converged(seed=5)
    t0 = net.now
    net.act("n6", lambda m: m.leave(net.now))
    assert net.nodes["n6"].local().state is LEFT
    net.run(3.0)
    net.crash("n6")
    net.run(10.0)
    assert [state for _, _, state in net.about("n6", since=t0)] == [LEFT] * (net.size - 1)
    for k in net.live():
        assert net.view(k, "n6") == (LEFT, 0)
        assert "n6" not in [i.node_id for i in net.nodes[k].alive()]
    net.run(CFG.dead_reclaim)
    assert all(net.view(k, "n6") is None for k in net.live())


def test_partition_heals_after_both_sides_declared_each_other_dead() -> None:
    net = converged(seed=8)
    left, right = {"n0", "n1", "n2", "n3"}, {"n4", "n5", "n6", "n7"}
    net.cut |= {(a, b) for a in left for b in right} | {(b, a) for a in left for b in right}
    net.run(25.0)
    assert all(net.view(a, b)[0] is DEAD for a in left for b in right)  # type: ignore[index]
    net.cut.clear()
    net.run(CFG.sync_interval + 5.0)  # one anti-entropy round reaches a presumed-dead member
    assert_all_alive(net)


def test_restarted_node_rejoins_alive_with_a_higher_incarnation() -> None:
    net = converged(seed=6)
    net.crash("n2")
    net.run(25.0)
    assert all(net.view(k, "n2") == (DEAD, 0) for k in net.live())
    net.boot("n2", seeds=("n0",))
    assert net.nodes["n2"].incarnation == 0
    net.run(10.0)
    assert net.nodes["n2"].incarnation >= 1  # refuted the DEAD it learned from the seed
    for k in net.live():
        if k != "n2":
            assert net.view(k, "n2") == (ALIVE, net.nodes["n2"].incarnation)
    assert_all_alive(net)


def test_awareness_rises_while_own_messages_are_lost_and_recovers() -> None:
    net = converged(seed=7)
    everyone = set(net.infos)
    net.cut |= {("n1", k) for k in everyone}
    net.run(4.0)
    assert net.nodes["n1"].awareness >= 2
    assert all(net.nodes[k].awareness == 0 for k in net.live() if k != "n1")  # helpers' Nacks clear them
    net.cut.clear()
    net.run(40.0)
    assert net.nodes["n1"].awareness == 0
    assert_all_alive(net)


def _lone_node(peers: int) -> tuple[Membership, list[NodeInfo]]:
    me = NodeInfo("me", "sim://me")
    m = Membership(me, CFG, random.Random(0), 0.0)
    infos = [NodeInfo(f"p{i}", f"sim://p{i}") for i in range(peers)]
    m.receive(0.0, infos[0], Gossip(tuple(Update(i, 0, ALIVE, i.node_id) for i in infos)))
    assert m.drain_events() == [(i, ALIVE) for i in infos]
    return m, infos


def _tick_until(m: Membership, kind: type) -> tuple[float, list[Send]]:
    """Tick at each successive deadline until the node sends a ``kind`` message."""
    for _ in range(100):
        t = m.next_deadline()
        sends = [s for s in m.tick(t) if isinstance(s.message, kind)]
        if sends:
            return t, sends
    raise AssertionError(f"no {kind.__name__} sent")


def _finish_probe(m: Membership, ping: Ping, started: float, answer: str) -> tuple[Ping, float]:
    """Take the outstanding probe ``ping`` to its end; ``answer``: "ack", "nack" or "none". Returns the next one."""
    t, reqs = _tick_until(m, PingReq)
    assert t - started == pytest.approx(CFG.probe_timeout * (1 + m.awareness))  # Lifeguard: slower when unhealthy
    assert len(reqs) == CFG.indirect_probes and all(r.to.node_id != ping.target_id for r in reqs)
    assert all(isinstance(r.message, PingReq) and r.message.seq == ping.seq for r in reqs)
    if answer == "ack":
        m.receive(t + 0.1, reqs[0].to, Ack(ping.seq, ping.target_id))
    elif answer == "nack":
        m.receive(t + 0.1, reqs[0].to, Nack(ping.seq, ping.target_id))
    t, pings = _tick_until(m, Ping)  # this probe ends, the next one starts
    assert len(pings) == 1 and isinstance(pings[0].message, Ping)
    return pings[0].message, t


def test_awareness_rule_failed_probe_without_nack_raises_and_ack_lowers() -> None:
    m, _ = _lone_node(8)
    t, pings = _tick_until(m, Ping)
    first = pings[0].message
    assert isinstance(first, Ping)
    ping, t = _finish_probe(m, first, t, "nack")
    assert m.awareness == 0  # a helper answered: the network around us works
    assert dict((i.node_id, s) for i, s in m.members())[first.target_id] is SUSPECT
    ping, t = _finish_probe(m, ping, t, "none")
    assert m.awareness == 1
    ping, t = _finish_probe(m, ping, t, "none")
    assert m.awareness == 2
    _finish_probe(m, ping, t, "ack")
    assert m.awareness == 1


def test_suspicion_timeout_formula() -> None:
    lo, hi = suspicion_bounds(CFG, 8)
    assert lo == pytest.approx(4.0 * math.log10(9)) and hi == pytest.approx(6.0 * lo)
    assert suspicion_timeout(0, 3, lo, hi) == hi
    assert suspicion_timeout(1, 3, lo, hi) == pytest.approx(hi - 0.5 * (hi - lo))  # log 2 / log 4
    assert suspicion_timeout(3, 3, lo, hi) == pytest.approx(lo)
    assert suspicion_timeout(9, 3, lo, hi) == lo
    assert suspicion_timeout(0, 0, lo, hi) == lo
    steps = [suspicion_timeout(c, 3, lo, hi) for c in range(4)]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == 4
    assert suspicion_bounds(CFG, 100)[0] > lo  # bigger clusters wait longer


@pytest.mark.parametrize(("suspectors", "dead"), [(1, False), (3, False), (4, True)])
def test_independent_confirmations_shorten_the_suspicion(suspectors: int, dead: bool) -> None:
    m, infos = _lone_node(7)
    target = infos[-1]
    for origin in infos[:suspectors]:
        m.receive(0.0, origin, Gossip((Update(target, 0, SUSPECT, origin.node_id),)))
    lo, _ = suspicion_bounds(CFG, 8)
    m.tick(lo + 0.01)  # 1 suspector + 3 confirmations make it the shortest timeout
    assert dict((i.node_id, s) for i, s in m.members())[target.node_id] is (DEAD if dead else SUSPECT)


def test_refutation_and_precedence_rules() -> None:
    m, infos = _lone_node(3)
    me = m.local().info
    m.receive(1.0, infos[0], Gossip((Update(me, 0, SUSPECT, "p0"),)))
    assert m.incarnation == 1 and m.awareness == 1 and m.local().state is ALIVE
    m.receive(1.0, infos[0], Gossip((Update(me, 5, DEAD, "p0"),)))
    assert m.incarnation == 6
    p1 = infos[1]
    m.receive(1.0, infos[0], Gossip((Update(p1, 2, ALIVE),)))
    m.receive(1.0, infos[0], Gossip((Update(p1, 1, DEAD),)))  # older: ignored
    m.receive(1.0, infos[0], Gossip((Update(p1, 2, SUSPECT),)))  # same incarnation, stronger: wins
    m.receive(1.0, infos[0], Gossip((Update(p1, 2, ALIVE),)))  # same incarnation, weaker: ignored
    assert dict((i.node_id, s) for i, s in m.members())["p1"] is SUSPECT
    m.receive(1.0, infos[0], Gossip((Update(p1, 3, ALIVE),)))  # refuted
    assert dict((i.node_id, s) for i, s in m.members())["p1"] is ALIVE
    m.receive(1.0, infos[0], Sync((Update(p1, 3, DEAD),), reply=False))  # pushed DEAD only makes it suspect
    assert dict((i.node_id, s) for i, s in m.members())["p1"] is SUSPECT


def test_incarnation_jumps_beyond_the_bound_are_ignored() -> None:
    # An insider forging "you are suspect at 2**63 - 1" must not push a node to an incarnation the
    # wire cannot carry (it could never refute again), nor pin another member DEAD for good.
    m, infos = _lone_node(3)
    me = m.local().info
    m.receive(1.0, infos[0], Gossip((Update(me, (1 << 63) - 1, SUSPECT, "p0"),)))
    assert m.incarnation == 0 and m.local().state is ALIVE
    m.receive(1.0, infos[0], Gossip((Update(me, MAX_INCARNATION_JUMP, SUSPECT, "p0"),)))
    assert m.incarnation == MAX_INCARNATION_JUMP + 1  # within the bound: refuted as usual
    p1 = infos[1]
    m.receive(1.0, infos[0], Gossip((Update(p1, (1 << 63) - 1, DEAD, "p0"),)))
    assert dict((i.node_id, s) for i, s in m.members())["p1"] is ALIVE


def _scenario(seed: int) -> list[tuple[float, str, str, MemberState]]:
    net = converged(seed=seed, size=6)
    net.crash("n3")
    net.run(20.0)
    net.boot("n3")
    net.run(10.0)
    return net.events


def test_same_seed_same_events() -> None:
    first = _scenario(11)
    assert first == _scenario(11)
    assert first != _scenario(12)


OPS = st.one_of(
    st.tuples(st.just("advance"), st.floats(0.05, 3.0)),
    st.tuples(st.just("crash"), st.integers(0, 4)),
    st.tuples(st.just("restart"), st.integers(0, 4)),
    st.tuples(st.just("drop"), st.integers(1, 30)),
    st.tuples(st.just("cut"), st.integers(0, 4)),
    st.tuples(st.just("slow"), st.integers(0, 4)),
    st.tuples(st.just("heal"), st.just(0)),
)
NEVER_RECLAIM = MembershipConfig(dead_reclaim=1e9)


def check_invariants(net: Net, own: dict[str, tuple[int, int]], views: dict[tuple[str, int, str], int]) -> None:
    """Each node sees itself ALIVE and not among its members; incarnations never go down."""
    for k in net.live():
        m = net.nodes[k]
        assert m.local().state is ALIVE and all(i.node_id != k for i, _ in m.members())
        boot, inc = own.get(k, (net.boots[k], 0))
        assert boot != net.boots[k] or m.incarnation >= inc
        own[k] = (net.boots[k], m.incarnation)
        known = {u.info.node_id: u.incarnation for u in m.known() if u.info.node_id != k}
        for obs, obs_boot, peer in list(views):
            if obs == k and peer not in known:
                del views[(obs, obs_boot, peer)]
        for peer, peer_inc in known.items():
            key = (k, net.boots[k], peer)
            assert peer_inc >= views.get(key, 0)
            views[key] = peer_inc


def lifecycle_step(net: Net, op: str, arg: float) -> bool:
    """Run an ``advance``, ``crash`` or ``restart`` op of OPS on ``net``; False for any other op."""
    node = f"n{int(arg)}"
    if op == "advance":
        net.run(arg)
    elif op == "crash":
        net.crash(node)
    elif op == "restart":
        if node in net.crashed:
            net.boot(node, seeds=("n0", "n1"))
    else:
        return False
    return True


@settings(max_examples=30)
@given(st.integers(0, 2**16), st.booleans(), st.lists(OPS, max_size=20))
def test_random_faults_never_break_invariants_and_the_cluster_heals(
    seed: int, reclaim: bool, ops: list[tuple[str, float]]
) -> None:
    net = Net(seed, 5, config=CFG if reclaim else NEVER_RECLAIM)
    for i in range(5):
        net.boot(f"n{i}", seeds=("n0",) if i else ())
    own: dict[str, tuple[int, int]] = {}
    views: dict[tuple[str, int, str], int] = {}
    for op, arg in ops:
        node = f"n{int(arg)}"
        if lifecycle_step(net, op, arg):
            pass  # advance, crash, restart
        elif op == "drop":
            del net.queue[: int(arg)]
            heapq.heapify(net.queue)
        elif op == "cut":
            net.cut |= {(node, k) for k in net.infos} | {(k, node) for k in net.infos}
        elif op == "slow":
            net.extra_delay[node] = 1.2
        elif op == "heal":
            net.cut.clear()
            net.extra_delay.clear()
        check_invariants(net, own, views)
    net.cut.clear()
    net.extra_delay.clear()
    for k in sorted(net.crashed):
        net.boot(k, seeds=tuple(sorted(set(net.infos) - {k})))
    for _ in range(20):
        net.run(3.0)
        check_invariants(net, own, views)
    if not reclaim:  # with forgetting, a long enough split stays split (see protocol/membership.py)
        assert_all_alive(net)


@settings(max_examples=20)
@given(st.integers(0, 2**16), st.lists(OPS, max_size=20))
def test_state_indexes_match_a_recomputation_under_random_faults(seed: int, ops: list[tuple[str, float]]) -> None:
    net = Net(seed, 5, config=CFG)
    for i in range(5):
        net.boot(f"n{i}", seeds=("n0",) if i else ())
    for op, arg in ops:
        lifecycle_step(net, op, arg)
        for k in net.live():
            check_indexes(net.nodes[k])
    net.run(60.0)  # past dead_reclaim: forgotten members leave every index
    for k in net.live():
        check_indexes(net.nodes[k])


@settings(max_examples=30)
@given(st.integers(0, 2**16), st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_piggyback_takes_the_least_sent_then_newest_updates(seed: int, batches: list[int]) -> None:
    m, infos = _lone_node(1)
    rng = random.Random(seed)
    for n, size in enumerate(batches):
        ups = tuple(Update(NodeInfo(f"q{rng.randrange(60)}", f"sim://{n}"), n + 1, ALIVE, "x") for _ in range(size))
        m.receive(float(n), infos[0], Gossip(ups))
        for _ in range(rng.randrange(4)):
            expected = sorted(m._queue.items(), key=lambda kv: (kv[1].transmits, -kv[1].order))
            want = [b.update for _, b in expected[: CFG.max_piggyback]]
            assert list(m._take()) == want
            check_indexes(m)


def test_random_picks_are_drawn_from_the_sorted_members_like_a_plain_sample() -> None:
    m, infos = _lone_node(300)
    for seed in range(20):
        m._rng = random.Random(seed)
        got = m._pick(3, m._usable)
        pool = sorted(infos, key=lambda i: i.node_id)
        assert got == random.Random(seed).sample(pool, 3)
        m._rng = random.Random(seed)
        skip = pool[seed].node_id
        assert m._pick(4, m._alive_ids, skip) == random.Random(seed).sample([i for i in pool if i.node_id != skip], 4)


def test_settle_drops_pending_broadcasts_but_keeps_members_and_events() -> None:
    """A warm start: the members a sync taught are old news (nothing to gossip round), but the driver
    still hears of them through ``drain_events``."""
    me = NodeInfo("me", "sim://me")
    m = Membership(me, CFG, random.Random(0), 0.0)
    others = tuple(Update(NodeInfo(f"p{i}", f"sim://p{i}"), 0, ALIVE, f"p{i}") for i in range(5))
    m.receive(0.0, others[0].info, Sync(others, reply=False))
    assert m.pending_broadcasts >= 5  # (and its own record)
    m.settle()
    assert m.pending_broadcasts == 0
    assert m.alive_count() == 5
    assert {info.node_id for info, state in m.drain_events() if state is ALIVE} == {f"p{i}" for i in range(5)}
    assert not any(isinstance(s.message, Gossip) for s in m.tick(CFG.gossip_interval))  # nothing queued to gossip


def test_full_membership_admits_no_stranger_past_its_ceiling() -> None:
    """A peer holding the cluster secret names members without end (a Sync of thousands of made-up
    hosts, again and again): full membership stops at ``max_full_members``, and members it already
    has stay."""
    me = NodeInfo("me", "sim://me")
    m = Membership(me, MembershipConfig(max_full_members=10), random.Random(0), 0.0)
    for burst in range(3):
        fake = tuple(Update(NodeInfo(f"f{burst}-{i}", f"sim://f{burst}-{i}"), 0, ALIVE, "evil") for i in range(50))
        m.receive(float(burst), fake[0].info, Sync(fake, reply=False))
        assert len(m.members()) <= 10
    assert m.alive_count() == 10
    with pytest.raises(ValueError):
        MembershipConfig(max_full_members=0)

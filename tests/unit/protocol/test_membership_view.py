"""The bounded membership view (``MembershipConfig.max_members``): a node keeps k members, not all."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.membership import HEARD_PER_MEMBER, QUEUE_PER_MEMBER, Membership
from patchswarm.protocol.membership_config import MembershipConfig, suspicion_bounds
from patchswarm.protocol.membership_messages import Gossip, MemberState, NodeInfo, Update
from tests.support.membership_net import Net, check_indexes

ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
K = 6
VIEW = MembershipConfig(max_members=K)


def info(i: int) -> NodeInfo:
    return NodeInfo(f"x{i:03d}", f"sim://x{i:03d}")


def lone(k: int = K) -> Membership:
    return Membership(NodeInfo("me", "sim://me"), MembershipConfig(max_members=k), random.Random(0), 0.0)


def hear(m: Membership, ids: list[int], now: float = 0.0, incarnation: int = 0, state: MemberState = ALIVE) -> None:
    """Deliver updates about ``ids`` from x999, 16 per message (as piggybacks travel)."""
    ups = [Update(info(i), incarnation, state, info(i).node_id) for i in ids]
    for at in range(0, len(ups), 16):
        m.receive(now, info(999), Gossip(tuple(ups[at : at + 16])))


def check_view(m: Membership) -> None:
    check_indexes(m)
    assert len(m._members) <= m._cfg.max_members
    assert m._ranks == sorted((x.rank, k) for k, x in m._members.items())
    assert all(x.rank == m._rank(x.info) for x in m._members.values())
    assert not set(m._heard) & set(m._members)
    assert all(x.fact == Update(x.info, x.incarnation, x.state, x.origin) for x in m._members.values())
    assert len(m._heard) <= HEARD_PER_MEMBER * m._cfg.max_members
    assert m.pending_broadcasts <= QUEUE_PER_MEMBER * m._cfg.max_members


def test_config_rejects_a_negative_view() -> None:
    with pytest.raises(ValueError, match="max_members"):
        MembershipConfig(max_members=-1)


@settings(max_examples=25)
@given(st.permutations(list(range(40))))
def test_the_view_is_the_lowest_ranked_members_heard_of_in_any_order(order: list[int]) -> None:
    m = lone()
    hear(m, order)
    check_view(m)
    heard = [info(i).node_id for i in range(40)] + ["x999"]
    expected = sorted(heard, key=lambda k: m._rank(NodeInfo(k, f"sim://{k}")))[:K]
    assert sorted(i.node_id for i in m.alive()) == sorted(expected)
    # joins are reported; losing a place in the view is not (the member is alive)
    events = m.drain_events()
    joined = {i.node_id for i, s in events if s is ALIVE}
    assert set(expected) <= joined
    assert all(s is ALIVE for _, s in events)


def test_facts_about_non_members_are_relayed_once_per_incarnation_and_state() -> None:
    m = lone()
    hear(m, list(range(40)))
    outsider = next(i for i in range(40) if info(i).node_id not in {x.node_id for x in m.alive()})
    m._queue.clear()
    m._queue_order.clear()
    hear(m, [outsider], now=1.0)
    assert m.pending_broadcasts == 0  # heard (and relayed) already at its first hearing
    hear(m, [outsider], now=1.0, state=SUSPECT)
    hear(m, [outsider], now=1.0, state=SUSPECT)
    assert m.pending_broadcasts == 1
    hear(m, [outsider], now=1.0, incarnation=1)
    queued = m._queue[info(outsider).node_id].update
    assert (queued.incarnation, queued.state) == (1, ALIVE)
    hear(m, [outsider], now=1.0, state=DEAD)  # older than what was relayed: dropped
    assert m._queue[info(outsider).node_id].update.incarnation == 1
    m.drain_events()
    hear(m, [outsider], now=1.0, incarnation=1, state=DEAD)  # news of its death: relayed and reported
    hear(m, [outsider], now=1.0, incarnation=1, state=DEAD)
    assert m.drain_events() == [(info(outsider), DEAD)]
    assert info(outsider).node_id not in {x.node_id for x in m.alive()}
    check_view(m)


def test_memory_stays_bounded_however_many_members_are_heard_of() -> None:
    m = lone(k=4)
    hear(m, list(range(400)))
    check_view(m)
    assert len(m.known()) == 5  # a Sync carries the view and self
    assert len(m.alive()) == 4


def test_full_membership_is_unchanged_by_default() -> None:
    m = Membership(NodeInfo("me", "sim://me"), MembershipConfig(), random.Random(0), 0.0)
    hear(m, list(range(40)))
    assert len(m.alive()) == 41
    assert not m._heard and not m._ranks


def bounded_net(seed: int, size: int) -> Net:
    net = Net(seed, size, config=VIEW)
    net.boot("n0", seeds=())
    for i in range(1, size):
        net.run(0.05)
        net.boot(f"n{i}", seeds=("n0",))
    net.run(20.0)
    return net


def test_a_bounded_cluster_stays_connected_and_every_node_is_watched() -> None:
    net = bounded_net(3, 24)
    holders: dict[str, int] = dict.fromkeys(net.live(), 0)
    for k in net.live():
        m = net.nodes[k]
        check_view(m)
        alive = m.alive()
        assert len(alive) == K
        assert all(s is ALIVE for _, s in m.members())
        for i in alive:
            holders[i.node_id] += 1
    # each node is in about K views (lowest ranks are per observer), so somebody probes it
    assert min(holders.values()) >= 1
    assert max(holders.values()) <= 4 * K


def test_a_crash_is_detected_by_the_views_holding_it_and_nobody_keeps_it_alive() -> None:
    net = bounded_net(5, 24)
    watchers = [k for k in net.live() if "n7" in {i.node_id for i in net.nodes[k].alive()}]
    assert watchers
    t0 = net.now
    net.crash("n7")
    net.run(net.size * VIEW.probe_interval + suspicion_bounds(VIEW, K + 1)[1] + 5.0)
    for k in watchers:
        assert [s for _, obs, s in net.about("n7", since=t0) if obs == k][-1] in (DEAD, LEFT), k
    for k in net.live():
        assert "n7" not in {i.node_id for i in net.nodes[k].alive()}, k
        check_view(net.nodes[k])


def test_the_join_seeds_keep_their_place() -> None:
    m = lone(k=4)
    m.join([NodeInfo("", info(5).addr)], 0.0)
    hear(m, list(range(400)))
    check_view(m)
    assert info(5) in m.alive()


def test_a_sync_of_a_huge_full_membership_fits_the_wire() -> None:
    from patchswarm.protocol.membership_messages import MAX_SYNC_MEMBERS, Sync
    from patchswarm.protocol.wire import Announcement, GossipFrame, decode_frame, encode_frame

    m = Membership(NodeInfo("me", "sim://me"), MembershipConfig(), random.Random(0), 0.0)
    hear(m, list(range(999)))
    for base in range(1000, 5000, 999):  # ids x000..x4999 (and x999, the sender)
        ups = [Update(NodeInfo(f"x{i:04d}", f"sim://x{i:04d}"), 0, ALIVE, "") for i in range(base, base + 999)]
        for at in range(0, len(ups), 16):
            m.receive(0.0, info(999), Gossip(tuple(ups[at : at + 16])))
    assert m.alive_count() > MAX_SYNC_MEMBERS
    sync = m._sync_to(info(999), reply=True).message
    assert isinstance(sync, Sync)
    ids = [u.info.node_id for u in sync.members]
    assert len(ids) == MAX_SYNC_MEMBERS and "me" in ids and ids == sorted(ids)
    frame = GossipFrame(NodeInfo("me", "sim://me"), Announcement("run", -1, -1), sync)
    assert decode_frame(b"s" * 32, encode_frame(b"s" * 32, frame)) == frame

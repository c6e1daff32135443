"""The live member list (protocol/peers.py): kept from membership events, and when it last changed."""

from __future__ import annotations

import math

from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.peers import LiveMembers


def test_members_join_move_and_leave() -> None:
    live = LiveMembers()
    for x in "abc":
        live.track(NodeInfo(x, f"sim://{x}"), MemberState.ALIVE, 1.0)
    live.track(NodeInfo("b", "sim://b2"), MemberState.SUSPECT, 2.0)  # still listed, at its new address
    assert len(live) == 3 and live.changed_at == 1.0
    b = live.get("b")
    assert b is not None and b.addr == "sim://b2"
    live.track(NodeInfo("a", "sim://a"), MemberState.DEAD, 3.0)
    assert "a" not in live and live.get("a") is None and live.changed_at == 3.0
    assert sorted(i.node_id for i in live.members) == ["b", "c"]
    assert all(live.members[at].node_id == x for x, at in live.index.items())
    live.track(NodeInfo("z", "sim://z"), MemberState.LEFT, 4.0)  # never listed: no change
    assert live.changed_at == 3.0


def test_changes_up_to_a_settle_are_old_news() -> None:
    live = LiveMembers()
    live.settle(5.0)
    live.track(NodeInfo("a", "sim://a"), MemberState.ALIVE, 5.0)
    assert live.changed_at == -math.inf
    live.track(NodeInfo("b", "sim://b"), MemberState.ALIVE, 6.0)
    assert live.changed_at == 6.0

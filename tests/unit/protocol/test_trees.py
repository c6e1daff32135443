"""Stripe trees: every node computes the same regular relay plan from the same members."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.trees import StripeTrees

ids = st.lists(st.text(alphabet="abcdefgh0123456789", min_size=1, max_size=6), min_size=1, max_size=120, unique=True)


@given(members=ids, fanout=st.integers(1, 8), key=st.binary(min_size=1, max_size=40))
def test_each_stripe_is_one_tree_of_every_member_rooted_at_the_seed(
    members: list[str], fanout: int, key: bytes
) -> None:
    trees = StripeTrees.build(key, members, fanout)
    n = len(members)
    parents = {m: trees.parents(m) for m in members}
    children = {m: trees.children(m) for m in members}
    for s in range(fanout):
        roots = [m for m in members if parents[m][s] is None]
        assert len(roots) == 1
        for m in members:
            depth, at = 0, m
            while (up := parents[at][s]) is not None:  # no cycles: every walk ends at the root
                assert m in children[up][s] or at != m
                at, depth = up, depth + 1
                assert depth <= n
            assert at == roots[0]
            # a fanout-ary tree laid out breadth first: depth at most log_fanout(n) (a chain for fanout 1)
            assert depth <= (n - 1 if fanout == 1 else math.ceil(math.log(n * (fanout - 1) + 1, fanout)))
        for m in members:
            assert len(children[m][s]) <= fanout
            for c in children[m][s]:
                assert parents[c][s] == m
    # Regular: a member relays one stripe in full, and at most a remainder of one more (when the
    # members do not divide evenly among the stripes), so its uplink carries at most 2 x fanout - 1 flows.
    for m in members:
        assert sum(len(c) for c in children[m]) <= max(fanout, 2 * fanout - 1)
        assert sum(1 for c in children[m] if len(c) == fanout) <= 1


@given(members=ids, fanout=st.integers(1, 6), key=st.binary(min_size=1, max_size=8), data=st.data())
def test_the_plan_depends_on_the_set_of_members_not_their_order(
    members: list[str], fanout: int, key: bytes, data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(members))
    a, b = StripeTrees.build(key, members, fanout), StripeTrees.build(key, [*shuffled, *members[:3]], fanout)
    assert a == b


def test_a_stripe_is_a_chunk_index_modulo_the_fanout_and_strangers_have_no_place() -> None:
    trees = StripeTrees.build(b"manifest", ["a", "b", "c"], 2)
    assert [trees.stripe(c) for c in range(5)] == [0, 1, 0, 1, 0]
    assert trees.parents("z") == () and trees.children("z") == ()
    assert StripeTrees.build(b"other", ["a", "b", "c"], 2) != trees  # another version, another plan
    with pytest.raises(ValueError):
        StripeTrees.build(b"k", ["a"], 0)

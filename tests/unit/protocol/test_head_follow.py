"""Following the head (protocol/head_follow.py), driven without asyncio."""

from __future__ import annotations

from patchswarm.protocol.head import Head
from patchswarm.protocol.head_follow import HEAD_WARN_INTERVAL, WARNED_MAX, HeadFollower


def _head(counter: int) -> Head:
    return Head("run", counter, b"m" * 32, counter, 0, 1, ())


def test_one_fetch_per_newer_counter() -> None:
    follow = HeadFollower()
    assert follow.fetch_for(3)
    assert not follow.fetch_for(3) and not follow.fetch_for(2)  # under way already
    assert follow.fetch_for(4)  # a newer one
    follow.fetch_ended(3)  # (not the one under way: nothing changes)
    assert follow.fetching == 4
    follow.fetch_ended(4)
    assert follow.fetching == -1 and follow.fetch_for(3)


def test_a_head_is_taken_unless_another_fetch_took_it_or_a_newer_one_meanwhile() -> None:
    follow = HeadFollower()
    assert not follow.accept(None, -1)
    assert follow.accept(_head(2), -1) and follow.counter == 2
    assert not follow.accept(_head(2), -1)  # started before 2 was taken: a duplicate
    assert follow.accept(_head(3), -1)  # started before, but newer
    assert not follow.fetch_for(3)


def test_a_seed_takes_its_board_head_as_it_is() -> None:
    follow = HeadFollower()
    assert follow.board_head(_head(5)) and not follow.board_head(_head(5))
    assert follow.board_head(_head(4)) and follow.counter == 4  # a board rewound: the seed follows it


def test_a_refusal_is_warned_of_once_a_minute() -> None:
    follow = HeadFollower()
    assert follow.warn("expired", 0.0)
    assert not follow.warn("expired", HEAD_WARN_INTERVAL - 1)
    assert follow.warn("other", 1.0)  # a new refusal is always told
    assert follow.warn("expired", HEAD_WARN_INTERVAL + 1)
    for i in range(2 * WARNED_MAX):
        follow.warn(f"refusal {i}", 100.0)
    assert len(follow.warned) <= WARNED_MAX

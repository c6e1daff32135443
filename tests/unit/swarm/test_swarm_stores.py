"""MemoryChunkStore: an LRU bounded in bytes that never evicts pinned chunks (or the one just put)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.swarm.stores import MemoryChunkStore


def test_least_recently_used_goes_first_and_pinned_chunks_stay() -> None:
    s = MemoryChunkStore(max_bytes=30)
    for k in (b"a", b"b", b"c"):
        s.put(k, b"x" * 10)
    assert s.get(b"a") is not None  # a is now the most recently used
    s.pinned.add(b"b")
    s.put(b"d", b"y" * 10)
    assert [k for k in (b"a", b"b", b"c", b"d") if k in s] == [b"a", b"b", b"d"]
    assert s.nbytes == 30
    s.put(b"big", b"z" * 25)  # over the bound even alone: kept (just put), everything unpinned older goes
    assert b"big" in s and b"b" in s and b"a" not in s and b"d" not in s
    assert s.nbytes == 35


@settings(max_examples=60)
@given(
    st.integers(0, 2**16), st.integers(1, 200), st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), max_size=80)
)
def test_matches_a_reference_lru(seed: int, bound: int, ops: list[tuple[int, int]]) -> None:
    rng = random.Random(seed)
    s = MemoryChunkStore(max_bytes=bound)
    ref: dict[bytes, int] = {}  # insertion/use order = LRU order
    for key, size in ops:
        k = bytes([key])
        if rng.random() < 0.2:
            (s.pinned.add if rng.random() < 0.5 else s.pinned.discard)(k)
        if rng.random() < 0.3:
            assert (s.get(k) is not None) == (k in ref)
            if k in ref:
                ref[k] = ref.pop(k)
            continue
        s.put(k, b"\0" * size)
        if k in ref:
            continue
        ref[k] = size
        total = sum(ref.values())
        for old in list(ref):
            if total <= bound:
                break
            if old not in s.pinned and old != k:
                total -= ref.pop(old)
        assert [x for x in ref] == [x for x in ref if x in s] and all(
            x in ref for x in map(lambda i: bytes([i]), range(31)) if x in s
        )
        assert s.nbytes == total


def test_trim_after_the_bound_shrinks_or_the_pins_go() -> None:
    s = MemoryChunkStore(max_bytes=100)
    for k in (b"a", b"b", b"c", b"d"):
        s.put(k, b"x" * 10)
    s.pinned.update({b"a", b"b"})  # a download in progress
    s.max_bytes = 10
    s.trim()
    assert [k for k in (b"a", b"b", b"c", b"d") if k in s] == [b"a", b"b"] and s.nbytes == 20
    s.pinned.clear()
    s.trim()
    assert [k for k in (b"a", b"b", b"c", b"d") if k in s] == [b"b"] and s.nbytes == 10

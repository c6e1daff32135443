from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.catalog import CatalogEntry, plan
from patchswarm.protocol.manifest import Kind


def entries(sizes: list[int], anchors: dict[int, int]) -> list[CatalogEntry]:
    out = [CatalogEntry(v, Kind.PATCH, v - 1, s, bytes([v % 256]) * 32) for v, s in enumerate(sizes, start=1)]
    out += [CatalogEntry(v, Kind.ANCHOR, None, s, bytes([255 - v % 256]) * 32) for v, s in anchors.items()]
    return out


def cost(path: list[CatalogEntry]) -> int:
    return sum(e.size for e in path)


def test_prefers_anchor_when_chain_is_longer() -> None:
    cat = entries([100] * 24, {0: 1000, 10: 1000, 20: 1000})
    first = plan(cat, 3, 24)[0]
    assert (first.version, first.kind) == (20, Kind.ANCHOR)
    assert [e.version for e in plan(cat, 15, 24)] == list(range(16, 25))
    assert plan(cat, 24, 24) == []
    assert plan(cat, None, 5)[0] == CatalogEntry(0, Kind.ANCHOR, None, 1000, bytes([255]) * 32)


def brute_force(cat: list[CatalogEntry], have: int | None, want: int) -> int | None:
    best: int | None = None
    for n in range(1, len(cat) + 1):
        for combo in itertools.permutations(cat, n):
            cur = have
            ok = True
            for e in combo:
                if e.kind == Kind.ANCHOR or e.base_version == cur:
                    cur = e.version
                else:
                    ok = False
                    break
            if ok and cur == want:
                c = cost(list(combo))
                best = c if best is None else min(best, c)
    return best


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    anchor_sizes=st.dictionaries(st.integers(0, 5), st.integers(1, 200), min_size=1, max_size=3),
    have=st.one_of(st.none(), st.integers(0, 5)),
)
def test_plan_is_byte_minimal(sizes: list[int], anchor_sizes: dict[int, int], have: int | None) -> None:
    want = len(sizes)
    anchors = {v: s for v, s in anchor_sizes.items() if v <= want}
    cat = entries(sizes, anchors)
    if have is not None and have > want:
        have = want
    expected = 0 if have == want else brute_force(cat, have, want)
    if expected is None:
        return
    path = plan(cat, have, want)
    assert cost(path) == expected
    cur = have
    for e in path:
        assert e.kind == Kind.ANCHOR or e.base_version == cur
        cur = e.version
    assert cur == want or (have == want and path == [])

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.catalog import CatalogEntry, CatchUpPlanner, plan
from patchswarm.protocol.errors import NoPathError
from patchswarm.protocol.manifest import Kind, Manifest
from tests.support import fuzz_targets as ft


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


# ---------------------------------------------------------------- versions a host cannot read


def test_skipped_entries_are_planned_around() -> None:
    cat = entries([100] * 8, {0: 1000, 4: 1000})
    assert [e.version for e in plan(cat, 1, 8)] == list(range(2, 9))
    skip = {cat[2].manifest_id}  # the patch 2 -> 3
    path = plan(cat, 1, 8, skip=skip)
    assert (path[0].version, path[0].kind) == (4, Kind.ANCHOR) and [e.version for e in path[1:]] == [5, 6, 7, 8]
    with pytest.raises(NoPathError):
        plan(cat, 1, 3, skip=skip)


def _manifest(version: int, fmt: int) -> Manifest:
    m = ft.versions()[0].manifest
    return dataclasses.replace(m, version=version, needs={"payload_format": fmt} if fmt > 1 else {})


def test_planner_learns_unreadable_versions_from_their_manifests() -> None:
    cat = entries([100] * 8, {0: 1000, 4: 1000})
    planner = CatchUpPlanner((1,))
    first = planner.plan(cat, 1, 8)[0]
    assert first.version == 2
    assert planner.readable(first, _manifest(2, 1)) is None
    third = cat[2]
    assert planner.readable(third, _manifest(3, 2)) == "version 3: patch payload format 2 (this build reads 1)"
    assert planner.plan(cat, 1, 8)[0].kind == Kind.ANCHOR  # around it, via the anchor of version 4
    assert third not in planner.plan(cat, None, 8)
    with pytest.raises(NoPathError, match=r"reaches version 3 from 2 that this build reads \(version 3: patch payload"):
        planner.plan(cat, 2, 3)
    # Once the catalog no longer lists it (retention), it is forgotten.
    planner.plan([e for e in cat if e != third], 4, 8)
    assert planner.unreadable == {}
    assert CatchUpPlanner((1, 2)).readable(third, _manifest(3, 2)) is None

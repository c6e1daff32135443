"""The changed byte ranges handed to a copy engine (daemon/engine_regions.py): every changed byte is
covered, regions are sorted, disjoint, word-aligned and bounded in number, whatever the patch."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.daemon.engine_driver import Region
from patchswarm.daemon.engine_regions import entry_regions, store_regions, whole_regions
from patchswarm.protocol.served import TensorSpec

Case = tuple[int, int, list[int], int, int]  # word width, words, changed words, merge gap, most ranges


@st.composite
def changes(draw: st.DrawFn) -> Case:
    width = draw(st.sampled_from([1, 2, 4]))
    words = draw(st.integers(1, 4000))
    positions = sorted(draw(st.sets(st.integers(0, words - 1), max_size=200)))
    gap = draw(st.integers(1, 64))
    max_ranges = draw(st.integers(1, 20))
    return width, words, positions, gap, max_ranges


def naive_runs(positions: list[int], width: int, gap: int) -> list[tuple[int, int]]:
    """Runs merged when the bytes skipped between two changed words are fewer than ``gap``, one word at a time."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        start, end = p * width, (p + 1) * width
        if runs and start - runs[-1][1] < gap:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


@settings(max_examples=300, deadline=None)
@given(changes())
def test_regions_cover_every_changed_byte_sorted_disjoint_and_bounded(case: Case) -> None:
    width, words, positions, gap, max_ranges = case
    nbytes = words * width
    got = entry_regions("w", width, nbytes, torch.tensor(positions, dtype=torch.int64), gap=gap, max_ranges=max_ranges)
    if not positions:
        assert got == ()
        return
    assert 1 <= len(got) <= max_ranges
    assert all(r.name == "w" and 0 <= r.start < r.end <= nbytes for r in got)
    assert all(r.start % width == 0 and r.end % width == 0 for r in got)
    assert all(a.end <= b.start for a, b in itertools.pairwise(got))  # sorted and disjoint
    covered = torch.zeros(nbytes, dtype=torch.bool)
    for r in got:
        covered[r.start : r.end] = True
    for p in positions:
        assert bool(covered[p * width : (p + 1) * width].all())
    runs = naive_runs(positions, width, gap)
    expected = [(0, nbytes)] if len(runs) > max_ranges else runs
    assert [(r.start, r.end) for r in got] == expected


def test_default_merge_gap_and_bound() -> None:
    # bf16 words: changes 16 KiB apart merge into one run; 64 KiB apart stay apart; too many: whole.
    near = torch.tensor([0, 8192, 16384], dtype=torch.int64)
    assert entry_regions("a", 2, 1 << 20, near) == (Region("a", 0, 32770),)
    far = torch.tensor([0, 32768 + 1], dtype=torch.int64)
    assert entry_regions("a", 2, 1 << 20, far) == (Region("a", 0, 2), Region("a", 65538, 65540))
    many = torch.arange(0, 100 * 70000, 70000, dtype=torch.int64)
    assert entry_regions("a", 1, 100 * 70000, many) == (Region("a", 0, 100 * 70000),)
    assert entry_regions("a", 2, 64, None) == (Region("a", 0, 64),)


def test_a_position_outside_the_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        entry_regions("a", 4, 16, torch.tensor([4]))
    with pytest.raises(ValueError, match="outside"):
        entry_regions("a", 4, 16, torch.tensor([-1, 2]))


def test_store_regions_join_the_updates_of_one_slot_and_whole_wins() -> None:
    specs = [TensorSpec("a", "BF16", (8,)), TensorSpec("b", "F32", (4,)), TensorSpec("c", "BF16", (2,))]
    got = store_regions(
        specs,
        [(1, torch.tensor([3])), (0, torch.tensor([5, 1])), (1, torch.tensor([0])), (2, None), (2, torch.tensor([0]))],
    )
    assert got == (Region("a", 2, 12), Region("b", 0, 16), Region("c", 0, 4))
    assert whole_regions(specs) == (Region("a", 0, 16), Region("b", 0, 16), Region("c", 0, 4))

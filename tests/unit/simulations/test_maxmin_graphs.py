"""The flow-graph shapes behind docs/bandwidth-study.md section 4, on the simulator's max-min allocator."""

from __future__ import annotations

import random

import pytest

from benchmarks.maxmin_graphs import placed_graph, random_graph, regular_graph, utilisation


def test_regular_graphs_fill_every_link_and_random_ones_do_not() -> None:
    rng = random.Random(3)
    n = 40
    for k in (1, 3):
        assert utilisation(n, regular_graph(n, k, rng)) == pytest.approx(1.0)
    # One flow per host to a random peer: some receive two or three, others none.
    assert utilisation(n, random_graph(n, 1, rng)) < 0.75
    four = utilisation(n, random_graph(n, 4, rng))
    assert 0.7 < four < 0.95


def test_requests_placed_only_below_the_senders_cap_fill_the_links() -> None:
    rng = random.Random(4)
    n = 40
    graph = placed_graph(n, 3, 3, rng)
    assert len(graph) >= 3 * n - 3  # a few requests may find no free sender at the very end
    assert utilisation(n, graph) >= 0.97
    # More requests than the senders take: every uplink full, the downlinks uneven.
    assert utilisation(n, placed_graph(n, 6, 4, rng)) < 1.0

"""Activations prepared (staged, journaled) before the engine's pause, then written or abandoned.

The daemon prepares while the engine serves (daemon/prepared.py): until the fenced write begins the
store must be untouched; an abandoned activation must remove its journal; a kill in between leaves
the journal the "journaled" crash point always left, which recovery rolls forward.  The real kill -9
runs are tests/system/test_faults_crash.py and test_daemon_crash.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from patchswarm.daemon import journal
from patchswarm.daemon.journal import journal_path
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.store_format import StoreError, StoreLayout, StoreState, StoreStateError
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from tests.support.rank_plans import ONE_WIDTH, split_plan, version_model
from tests.support.store_worker import SPECS, model, remove_segments, unique_name


@pytest.fixture
def store() -> Iterator[WeightStore]:
    n = unique_name("pp")
    s = WeightStore.create(n, StoreLayout.from_specs(SPECS))
    m = model(7, 1)
    s.load(m, 1, m.root())
    yield s
    s.close()
    remove_segments(n)


def test_prepare_touches_nothing_and_abandon_removes_the_journal(store: WeightStore, tmp_path: Path) -> None:
    before = store.header()
    p = store.prepare(2, model(7, 2).root(), diff_updates(model(7, 1), model(7, 2)), tmp_path)
    assert journal_path(tmp_path).exists()
    assert store.header() == before and store.read_model().bitwise_equal(model(7, 1))
    assert p.abandon() and not journal_path(tmp_path).exists()
    with pytest.raises(StoreError):  # (an abandoned activation is never written)
        store.finish(p)
    assert store.header() == before and store.read_model().bitwise_equal(model(7, 1))
    # The next activation goes through as if the abandoned one never was.
    assert store.activate(2, model(7, 2).root(), diff_updates(model(7, 1), model(7, 2)), tmp_path).changed > 0
    assert store.read_model().bitwise_equal(model(7, 2))


def test_finish_writes_and_a_finished_activation_cannot_be_abandoned(store: WeightStore, tmp_path: Path) -> None:
    ups = diff_updates(model(7, 1), model(7, 2))
    p = store.prepare(2, model(7, 2).root(), ups, tmp_path)
    stats = store.finish(p)
    assert stats.changed == sum(u.count for u in ups) and stats.journal_bytes > 0
    assert not p.abandon() and p.state == "claimed"
    h = store.header()
    assert (h.version, h.state, h.stable) == (2, StoreState.READY, True)
    assert store.read_model().bitwise_equal(model(7, 2)) and not journal_path(tmp_path).exists()


def test_a_store_that_moved_after_prepare_is_not_written(store: WeightStore, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    p = store.prepare(2, model(7, 2).root(), diff_updates(model(7, 1), model(7, 2)), tmp_path / "a")
    store.activate(3, model(7, 3).root(), diff_updates(model(7, 1), model(7, 3)), tmp_path / "b")
    with pytest.raises(StoreStateError):
        store.finish(p)
    assert not journal_path(tmp_path / "a").exists()
    assert store.header().version == 3 and store.read_model().bitwise_equal(model(7, 3))


def test_a_kill_between_prepare_and_write_rolls_forward(store: WeightStore, tmp_path: Path) -> None:
    store.prepare(2, model(7, 2).root(), diff_updates(model(7, 1), model(7, 2)), tmp_path)
    # (the daemon dies here, during the drain or the pause: the restart recovers from the journal)
    got = journal.recover(store, tmp_path)
    assert got.action == journal.Action.ROLLED_FORWARD and got.version == 2
    assert store.read_model().bitwise_equal(model(7, 2)) and not journal_path(tmp_path).exists()


def test_rank_stores_prepare_abandon_then_apply(tmp_path: Path) -> None:
    n = unique_name("pr")
    jd = tmp_path / "journal"
    jd.mkdir()
    rs = RankStores(n, 2, jd, engine_kind=False)
    try:
        rs.prepare(split_plan(ONE_WIDTH, 2), ONE_WIDTH)
        v1, v2 = version_model(5, 1, ONE_WIDTH), version_model(5, 2, ONE_WIDTH)
        rs.apply(1, v1, None)
        roots = rs.rank_roots()
        p = rs.prepare_apply(2, v2, diff_updates(v1, v2))
        assert p is not None and journal_path(jd).exists()
        assert rs.common_version() == 1 and rs.rank_roots() == roots  # nothing written yet
        assert p.abandon() and not journal_path(jd).exists()
        assert rs.common_version() == 1 and rs.rank_roots() == roots
        for k in range(2):
            s = rs.store(k)
            assert s is not None and s.root() == roots[k]
        # Prepared again and written: every rank at version 2, its root the one computed for it.
        again = rs.prepare_apply(2, v2, diff_updates(v1, v2))
        assert again is not None
        stats = rs.finish_apply(again)
        assert stats is not None and stats.changed > 0 and rs.common_version() == 2
        for k in range(2):
            s = rs.store(k)
            assert s is not None and s.root() == s.header().root == rs.rank_roots()[k]
        assert not journal_path(jd).exists()
    finally:
        rs.close()
        remove_segments(n)

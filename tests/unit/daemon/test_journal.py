"""Activation journal and crash recovery: the store ends at exactly the old or the new version.

Real crashes: tests/support/store_worker.py forks daemon processes that are SIGKILLed at each named
crash point, and at random moments; recovery then runs here, as a restarted daemon would.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.engine import EngineView, attach
from patchswarm.daemon.journal import (
    Action,
    Journal,
    RunUpdates,
    TornJournalError,
    journal_path,
    read_journal,
    read_journals,
    recover,
    write_journal,
    write_rank_journal,
)
from patchswarm.daemon.store_format import (
    StoreError,
    StoreLayout,
    StoreLayoutMismatch,
    StoreState,
    StoreVerifyError,
    TensorUpdate,
)
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from tests.support.store_worker import SPECS, model, remove_segments, unique_name

SEED = 11
REPO = Path(__file__).resolve().parents[3]


class Crash(Exception):
    pass


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("jr")
    yield n
    remove_segments(n)


@pytest.fixture
def store(name: str) -> Iterator[WeightStore]:
    s = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    m = model(SEED, 1)
    s.load(m, 1, m.root())
    yield s
    s.close()


def assert_holds(store: WeightStore, version: int) -> None:
    """The header names ``version`` and the contents are exactly that version, bit for bit."""
    h = store.header()
    m = model(SEED, version)
    assert (h.version, h.root, h.state, h.stable) == (version, m.root(), StoreState.READY, True)
    assert store.read_model().bitwise_equal(m)
    assert store.root() == m.root()


def raise_at(point: str) -> Callable[[str], None]:
    def fault(at: str) -> None:
        if at == point:
            raise Crash(at)

    return fault


# ---------------------------------------------------------------- the file


def test_journal_round_trip(tmp_path: Path) -> None:
    a, b = model(SEED, 1), model(SEED, 2)
    ups = diff_updates(a, b)
    big = TensorUpdate(9, torch.tensor([3, 1 << 33], dtype=torch.int64), torch.tensor([1, 2]), torch.tensor([5, 6]))
    size = write_journal(tmp_path, b"L" * 32, (1, b"a" * 32), (2, b"b" * 32), [*ups, big])
    assert size == journal_path(tmp_path).stat().st_size
    j = read_journal(tmp_path)
    assert j is not None
    assert (j.layout_hash, j.base, j.target) == (b"L" * 32, (1, b"a" * 32), (2, b"b" * 32))
    for want, got in zip([*ups, big], j.updates, strict=True):
        assert want.slot == got.slot
        assert (want.positions is None) == (got.positions is None)
        if want.positions is not None and got.positions is not None:
            assert torch.equal(want.positions, got.positions) and got.positions.dtype == torch.int64
        assert torch.equal(want.new, got.new) and torch.equal(want.old, got.old)
    assert read_journal(tmp_path / "none") is None


@pytest.mark.parametrize("far", [False, True], ids=["u32 positions", "a position past 2**32"])
def test_a_run_of_updates_is_journaled_as_its_updates_one_per_slot(tmp_path: Path, far: bool) -> None:
    # rank stores hand the journal each rank's updates as one run (protocol/layout_flat.py): the
    # file must be byte for byte the one the same updates given one per slot make
    gen = torch.Generator().manual_seed(3)
    slots, counts = [0, 2, 5], [4, 1, 7]
    pos = torch.cat([torch.randperm(50, generator=gen)[:n].sort().values for n in counts])
    if far:
        pos[-1] = (1 << 33) + 5
    new = torch.randint(-100, 100, (12,), dtype=torch.int16, generator=gen)
    old = torch.randint(-100, 100, (12,), dtype=torch.int16, generator=gen)
    run = RunUpdates(slots, counts, pos, new, old)
    per_slot = [
        TensorUpdate(s, p, n, o)
        for s, p, n, o in zip(slots, pos.split(counts), new.split(counts), old.split(counts), strict=True)
    ]
    other = [TensorUpdate(1, torch.tensor([2, 3]), torch.tensor([1, 2], dtype=torch.int16), new[:2])]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ends = ((1, b"a" * 32), (2, b"b" * 32))
    write_rank_journal(a, [Journal(b"L" * 32, *ends, [], run), Journal(b"M" * 32, *ends, other)])
    write_rank_journal(b, [Journal(b"L" * 32, *ends, per_slot), Journal(b"M" * 32, *ends, other)])
    assert journal_path(a).read_bytes() == journal_path(b).read_bytes()
    js = read_journals(a)
    assert js is not None
    assert [u.slot for u in js[0].updates] == slots
    got = torch.cat([u.positions for u in js[0].updates if u.positions is not None])
    assert torch.equal(got, pos)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_torn_journal_detected(tmp_path: Path, damage: str) -> None:
    a, b = model(SEED, 1), model(SEED, 2)
    write_journal(tmp_path, b"L" * 32, (1, a.root()), (2, b.root()), diff_updates(a, b))
    p = journal_path(tmp_path)
    data = bytearray(p.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 3] ^= 0x10
    else:
        data = bytearray()
    p.write_bytes(bytes(data))
    with pytest.raises(TornJournalError):
        read_journal(tmp_path)


# ---------------------------------------------------------------- recovery, in process


@pytest.mark.parametrize(
    ("point", "action", "version"),
    [
        ("journal_tmp", Action.CLEAN, 1),
        ("journaled", Action.ROLLED_FORWARD, 2),
        ("odd", Action.ROLLED_FORWARD, 2),
        ("mid_write", Action.ROLLED_FORWARD, 2),
        ("written", Action.ROLLED_FORWARD, 2),
        ("flipped", Action.ROLLED_FORWARD, 2),
    ],
)
def test_recover_after_abort_at_each_point(
    store: WeightStore, tmp_path: Path, point: str, action: Action, version: int
) -> None:
    b = model(SEED, 2)
    store.fault = raise_at(point)
    with pytest.raises(Crash):
        store.activate(2, b.root(), diff_updates(model(SEED, 1), b), tmp_path)
    store.fault = raise_at("")
    assert recover(store, tmp_path).action == action
    assert_holds(store, version)
    assert list(tmp_path.iterdir()) == []


def test_crash_inside_the_flip_rolls_forward(store: WeightStore, tmp_path: Path) -> None:
    """Killed between writing the state word and the final seq increment: READY but seq odd."""
    b = model(SEED, 2)
    store.fault = raise_at("written")
    with pytest.raises(Crash):
        store.activate(2, b.root(), diff_updates(model(SEED, 1), b), tmp_path)
    store.control.begin(StoreState.READY)  # the torn publish: state written, seq still odd
    assert not store.header().stable
    assert recover(store, tmp_path).action == Action.ROLLED_FORWARD
    assert_holds(store, 2)


def test_stale_journal_on_a_new_engine_buffer_is_dropped(name: str, tmp_path: Path) -> None:
    from patchswarm.daemon.engine import allocate

    s = WeightStore.create(name, StoreLayout.from_specs(SPECS), engine_buffer=True)
    e1 = allocate(s.attach_info(), "cpu")
    assert e1.handle is not None
    s.attach_buffer(e1.handle)
    a, b = model(SEED, 1), model(SEED, 2)
    s.load(a, 1, a.root())
    s.fault = raise_at("mid_write")
    with pytest.raises(Crash):
        s.activate(2, b.root(), diff_updates(a, b), tmp_path)
    e2 = allocate(s.attach_info(), "cpu")  # the engine restarted with a fresh buffer
    assert e2.handle is not None
    s.attach_buffer(e2.handle)
    assert recover(s, tmp_path).action == Action.NEEDS_LOAD
    assert not journal_path(tmp_path).exists()
    e1.close()
    e2.close()


def test_torn_journal_with_fence_closed_is_discarded(store: WeightStore, tmp_path: Path) -> None:
    b = model(SEED, 2)
    store.fault = raise_at("journaled")  # journal on disk, memory untouched
    with pytest.raises(Crash):
        store.activate(2, b.root(), diff_updates(model(SEED, 1), b), tmp_path)
    p = journal_path(tmp_path)
    p.write_bytes(p.read_bytes()[:-100])
    assert recover(store, tmp_path).action == Action.DISCARDED
    assert_holds(store, 1)
    assert not p.exists()


def test_torn_journal_with_fence_open_needs_load(store: WeightStore, tmp_path: Path) -> None:
    b = model(SEED, 2)
    store.fault = raise_at("mid_write")
    with pytest.raises(Crash):
        store.activate(2, b.root(), diff_updates(model(SEED, 1), b), tmp_path)
    p = journal_path(tmp_path)
    p.write_bytes(b"garbage")
    r = recover(store, tmp_path)
    assert r.action == Action.NEEDS_LOAD and r.version is None
    h = store.header()
    assert h.state == StoreState.FAILED and h.stable
    store.load(b, 2, b.root())
    assert_holds(store, 2)


def test_unverifiable_new_values_are_rolled_back(store: WeightStore, tmp_path: Path) -> None:
    """A journal whose new values do not produce its target root: the base is restored and verified."""
    a, b = model(SEED, 1), model(SEED, 2)
    ups = diff_updates(a, b)
    write_journal(tmp_path, store.layout.layout_hash, (1, a.root()), (2, model(SEED, 3).root()), ups)
    r = recover(store, tmp_path)
    assert (r.action, r.version) == (Action.ROLLED_BACK, 1)
    assert_holds(store, 1)


def test_neither_side_verifies_fails_the_store(store: WeightStore, tmp_path: Path) -> None:
    a, b = model(SEED, 1), model(SEED, 2)
    write_journal(tmp_path, store.layout.layout_hash, (1, bytes(32)), (2, bytes(32)), diff_updates(a, b))
    with pytest.raises(StoreVerifyError):
        recover(store, tmp_path)
    assert store.header().state == StoreState.FAILED
    assert not journal_path(tmp_path).exists()


def test_clean_store_with_corrupt_memory_fails_verification(store: WeightStore, tmp_path: Path) -> None:
    w = store.slot_words(0)
    w[5] = ~w[5]
    with pytest.raises(StoreVerifyError):
        recover(store, tmp_path)
    assert store.header().state == StoreState.FAILED
    assert recover(store, tmp_path, verify=False).action == Action.NEEDS_LOAD


def test_journal_for_another_layout_or_version_is_refused(store: WeightStore, tmp_path: Path) -> None:
    a, b = model(SEED, 1), model(SEED, 2)
    write_journal(tmp_path, b"x" * 32, (1, a.root()), (2, b.root()), diff_updates(a, b))
    with pytest.raises(StoreLayoutMismatch):
        recover(store, tmp_path)
    write_journal(tmp_path, store.layout.layout_hash, (5, a.root()), (6, b.root()), diff_updates(a, b))
    with pytest.raises(StoreError, match="holds 1"):
        recover(store, tmp_path)
    assert_holds(store, 1)


def test_empty_and_interrupted_load_need_a_load(name: str, tmp_path: Path) -> None:
    s = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    assert recover(s, tmp_path).action == Action.NEEDS_LOAD
    s.fault = raise_at("loading")
    m = model(SEED, 1)
    with pytest.raises(Crash):
        s.load(m, 1, m.root())
    assert s.header().state == StoreState.LOADING and not s.header().stable
    assert recover(s, tmp_path).action == Action.NEEDS_LOAD


# ---------------------------------------------------------------- real crashes (SIGKILL)


class Launcher:
    """tests/support/store_worker.py launcher: forks daemon children that get killed."""

    def __init__(self, name: str, jdir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.store_worker", "launcher", name, "/dev/shm", str(jdir), str(SEED)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.last = 0  # last version the child said it activated (or found)

    def send(self, line: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return int(self.expect("pid"))

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, f"launcher exited while waiting for {word!r}"
            key, _, rest = line.strip().partition(" ")
            if key in ("ready", "activated"):
                self.last = int(rest)
            if key == word:
                return rest

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


@pytest.fixture
def launcher(name: str, store: WeightStore, tmp_path: Path) -> Iterator[Launcher]:
    la = Launcher(name, tmp_path)
    yield la
    la.close()


def _engine(store: WeightStore) -> EngineView:
    return attach(store.attach_info())


@pytest.mark.parametrize(
    ("point", "version"),
    [("journal_tmp", 1), ("journaled", 2), ("odd", 2), ("mid_write", 2), ("written", 2), ("flipped", 2)],
)
def test_sigkill_at_each_point(
    launcher: Launcher, store: WeightStore, tmp_path: Path, point: str, version: int
) -> None:
    engine = _engine(store)  # an engine attached throughout: it keeps its mapping when the daemon dies
    launcher.send(f"go {point} 2")
    assert launcher.expect("dead") == "9"  # killed by SIGKILL
    assert engine.read_version() in ((1, model(SEED, 1).root()), (2, model(SEED, 2).root()), None)
    if point in ("odd", "mid_write", "written"):
        assert engine.read_version() is None  # mid-write: the engine is told no version
    r = recover(WeightStore.open(store.segment.name), tmp_path)
    assert r.version == version
    assert_holds(store, version)
    assert engine.read_version() == (version, model(SEED, version).root())
    engine.close()


def test_sigkill_during_first_load(launcher: Launcher, store: WeightStore, tmp_path: Path) -> None:
    launcher.send("load 3 loading")
    assert launcher.expect("dead") == "9"
    assert recover(store, tmp_path).action == Action.NEEDS_LOAD


def test_sigkill_at_random_moments(launcher: Launcher, store: WeightStore, tmp_path: Path) -> None:
    """20 daemons killed at random moments: after each, the store is exactly the old or the new version."""
    rng = random.Random(1234)
    engine = _engine(store)
    actions: dict[str, int] = {}
    # Kill moments are drawn over about two activations as long as one takes on this machine now
    # (a fixed window would fall entirely before the first write on a loaded machine).
    pid = launcher.send("go")
    launcher.expect("ready")
    t0 = time.monotonic()
    launcher.expect("activated")
    period = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    launcher.expect("dead")
    recover(WeightStore.open(store.segment.name), tmp_path)
    for _ in range(20):
        pid = launcher.send("go")
        launcher.expect("ready")
        before = launcher.last
        time.sleep(rng.uniform(0.0, 2 * period))
        os.kill(pid, signal.SIGKILL)
        launcher.expect("dead")
        after = launcher.last
        r = recover(WeightStore.open(store.segment.name), tmp_path)
        actions[r.action.value] = actions.get(r.action.value, 0) + 1
        v = store.header().version
        assert v in (after, after + 1), (before, after, v)
        assert_holds(store, v)
        assert engine.read_version() == (v, model(SEED, v).root())
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert store.header().version > 1
    print("recovery actions:", actions)
    engine.close()

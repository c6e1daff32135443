"""The version fence with asynchronous readers: a reader that launches its reads and never syncs.

The reader here is the CPU twin of a GPU engine (daemon/cpu_stream.py): its copy of the store
runs on a worker thread after ``fn`` returned.  The fence's old ``consistent`` (seq re-read as
soon as ``fn`` returns, no handshake) reports such a torn copy as consistent; the new one (read
lock, then ``sync`` before the second read) never does, and the writer waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.cpu_stream import CpuEvent, CpuStream
from patchswarm.daemon.engine import EngineView, FenceReader, Observed, attach
from patchswarm.daemon.fence_lock import ReadersStalled
from patchswarm.daemon.journal import journal_path
from patchswarm.daemon.store_format import OFF_WRITE_PENDING, StoreLayout
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel, TensorSpec
from tests.support.store_worker import remove_segments, unique_name

T = TypeVar("T")
BOUND_S = 30.0  # (a bound on waits that must end: a hang fails the test instead of blocking it)


def versions(n_words: int, sizes: list[int], seed: int) -> list[ServedModel]:
    """Version 1 (random words) and each next version with ``sizes[i]`` words changed."""
    g = torch.Generator().manual_seed(seed)
    spec = TensorSpec("w", "I32", (n_words,))
    cur = torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32, generator=g)
    out = [ServedModel([spec], [cur.view(torch.uint8).clone()])]
    for size in sizes:
        cur = cur.clone()
        pos = torch.randperm(n_words, generator=g)[:size]
        cur[pos] = torch.randint(-(2**31), 2**31 - 1, (size,), dtype=torch.int32, generator=g)
        out.append(ServedModel([spec], [cur.view(torch.uint8).clone()]))
    return out


@dataclass
class Rig:
    store: WeightStore
    view: EngineView
    models: list[ServedModel]  # models[k - 1] is version k
    journal: Path

    def activate(self, k: int) -> None:
        new = self.models[k - 1]
        self.store.activate(k, new.root(), diff_updates(self.models[k - 2], new), self.journal)

    def bytes_of(self, k: int) -> torch.Tensor:
        return self.models[k - 1].data[0]

    def pending(self) -> bool:
        return self.store.control.get(OFF_WRITE_PENDING) != 0


@contextlib.contextmanager
def rig(models: list[ServedModel], journal: Path) -> Iterator[Rig]:
    name = unique_name("fence")
    store = WeightStore.create(name, StoreLayout.from_specs(models[0].specs))
    try:
        store.load(models[0], 1, models[0].root())
        view = attach(store.attach_info())
        try:
            yield Rig(store, view, models, journal)
        finally:
            view.close()
    finally:
        store.close()
        remove_segments(name)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(1e-4)


def launch_copy(stream: CpuStream, src: torch.Tensor, *, hold: Callable[[], None], chunks: int = 2) -> torch.Tensor:
    """Queue a copy of ``src`` in ``chunks`` pieces, ``hold()`` after the first; return the (future) copy."""
    out = torch.empty_like(src)
    bounds = [src.numel() * i // chunks for i in range(chunks + 1)]

    def piece(i: int) -> None:
        out[bounds[i] : bounds[i + 1]].copy_(src[bounds[i] : bounds[i + 1]])
        if i == 0:
            hold()

    for i in range(chunks):
        stream.launch(lambda i=i: piece(i))  # type: ignore[misc]
    return out


def old_consistent(fence: FenceReader, fn: Callable[[], T]) -> tuple[T, int | None, bool]:
    """The fence's consistent() before this change: seq re-read as soon as fn returns, no lock."""
    start = fence.wait_stable()
    value = fn()
    return value, start.version, fence.control.seq() != start.seq


# ---------------------------------------------------------------- the CPU twin itself


def test_cpu_stream_runs_in_order_and_events_mark_points() -> None:
    stream, gate, seen = CpuStream(), threading.Event(), []
    stream.launch(lambda: gate.wait(BOUND_S))
    stream.launch(lambda: seen.append(1))
    ev = CpuEvent()
    ev.record(stream)
    stream.launch(lambda: seen.append(2))
    assert not ev.query() and not stream.query() and seen == []  # (the first work still waits on gate)
    gate.set()
    ev.synchronize()
    assert ev.query() and seen[:1] == [1]
    stream.synchronize()
    assert seen == [1, 2] and stream.query() and CpuEvent().query()
    stream.launch(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        stream.synchronize()
    stream.synchronize()  # (reported once)
    stream.close()


# ---------------------------------------------------------------- torn reads: old fence vs new


def test_old_consistent_reports_a_torn_async_read_as_consistent(tmp_path: Path) -> None:
    """The failure the new fence fixes: the copy the reader launched reads half of version 1 and
    half of version 2, and the old consistent() says nothing changed."""
    with rig(versions(1 << 14, [1 << 12, 1 << 12], 1), tmp_path) as r:
        stream, half, written = CpuStream(), threading.Event(), threading.Event()

        def hold() -> None:
            half.set()
            written.wait(BOUND_S)

        copy, version, changed = old_consistent(r.view.fence, lambda: launch_copy(stream, r.view.data, hold=hold))
        assert half.wait(BOUND_S)
        r.activate(2)  # (the old reader held nothing: the write goes ahead under its reads)
        written.set()
        stream.synchronize()
        assert (version, changed) == (1, False)
        assert not torch.equal(copy, r.bytes_of(1)) and not torch.equal(copy, r.bytes_of(2))  # torn
        # The same read under the new fence: a torn copy is impossible, the write waits for it.
        got = run_new_read_against_write(r, stream)
        assert got.version == 2 and not got.changed and torch.equal(got.value, r.bytes_of(2))
        stream.close()


def run_new_read_against_write(r: Rig, stream: CpuStream) -> Observed[torch.Tensor]:
    """A new-fence read whose launched copy is held until the writer (next version) waits for it."""
    k = r.view.read_version()
    assert k is not None
    writer = threading.Thread(target=r.activate, args=(k[0] + 1,))
    started = threading.Event()

    def hold() -> None:
        started.set()
        wait_until(r.pending, "the writer waits for the reader")

    def fn() -> torch.Tensor:
        return launch_copy(stream, r.view.data, hold=hold)

    def later() -> None:
        started.wait(BOUND_S)
        writer.start()

    threading.Thread(target=later).start()
    obs = r.view.fence.consistent(fn, sync=stream)
    writer.join(BOUND_S)
    assert not writer.is_alive() and r.view.read_version() is not None
    return obs


def test_new_consistent_holds_the_writer_until_the_launched_copy_ran(tmp_path: Path) -> None:
    with rig(versions(1 << 14, [1 << 12, 1 << 12], 2), tmp_path) as r:
        stream = CpuStream()
        obs = run_new_read_against_write(r, stream)
        assert (obs.version, obs.changed) == (1, False)
        assert torch.equal(obs.value, r.bytes_of(1))
        assert r.view.read_version() == (2, r.models[1].root())
        stream.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=4),
    delays=st.lists(st.floats(0, 2e-3), min_size=3, max_size=3),
    chunks=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_no_interleaving_yields_an_unseen_torn_read(
    tmp_path: Path, sizes: list[int], delays: list[float], chunks: int, seed: int
) -> None:
    """A reader launching delayed, chunked copies and never syncing, racing writes of any size:
    every read the new fence reports as unchanged is exactly the version it names."""
    start_delay, chunk_delay, write_delay = delays
    with rig(versions(1 << 12, sizes, seed), tmp_path) as r:
        stream, done = CpuStream(), threading.Event()

        def writes() -> None:
            try:
                for k in range(2, len(sizes) + 2):
                    time.sleep(write_delay)
                    r.activate(k)
            finally:
                done.set()

        def fn() -> torch.Tensor:
            stream.launch(lambda: time.sleep(start_delay))
            return launch_copy(stream, r.view.data, hold=lambda: time.sleep(chunk_delay), chunks=chunks)

        writer = threading.Thread(target=writes)
        writer.start()
        reads = 0
        while not done.is_set() or reads < 2:
            obs = r.view.fence.consistent(fn, sync=stream)
            reads += 1
            assert obs.version is not None
            if not obs.changed:
                assert torch.equal(obs.value, r.bytes_of(obs.version)), f"torn read reported as version {obs.version}"
        writer.join(BOUND_S)
        assert r.view.read_version() == (len(sizes) + 1, r.models[-1].root())
        stream.close()


# ---------------------------------------------------------------- the writer's side of the handshake


def test_a_reader_that_never_finishes_stalls_the_write_with_a_clear_error(tmp_path: Path) -> None:
    with rig(versions(1 << 12, [100], 3), tmp_path) as r:
        stream, release = CpuStream(), threading.Event()
        obs: list[object] = []
        reader = threading.Thread(
            target=lambda: obs.append(
                r.view.fence.consistent(lambda: stream.launch(lambda: release.wait(BOUND_S)), sync=stream)
            )
        )
        reader.start()
        wait_until(lambda: not stream.query(), "the reader launched its work")
        seq = r.store.control.seq()
        r.store.gate.wait_s = 0.05
        with pytest.raises(ReadersStalled, match=r"readers \(pid \d+\).*nothing was written"):
            r.activate(2)
        assert r.store.control.seq() == seq and r.view.read_version() == (1, r.models[0].root())
        assert torch.equal(r.view.data, r.bytes_of(1)) and not journal_path(tmp_path).exists()
        assert not r.pending()
        release.set()
        reader.join(BOUND_S)
        r.activate(2)  # (the activation retried once the reader let go)
        assert r.view.read_version() == (2, r.models[1].root())
        stream.close()


def test_readers_wait_while_a_writer_is_pending(tmp_path: Path) -> None:
    """No writer starvation: once a writer waits, a new read does not begin (it would hold the
    writer off again); it begins after the write, on the new version."""
    with rig(versions(1 << 12, [100], 4), tmp_path) as r:
        stream, release = CpuStream(), threading.Event()
        first = threading.Thread(
            target=lambda: r.view.fence.consistent(lambda: stream.launch(lambda: release.wait(BOUND_S)), sync=stream)
        )
        first.start()
        wait_until(lambda: not stream.query(), "the first reader launched its work")
        writer = threading.Thread(target=r.activate, args=(2,))
        writer.start()
        wait_until(r.pending, "the writer waits")
        second = FenceReader(r.view.fence.control, lock=r.view.fence.lock)
        with pytest.raises(TimeoutError):  # (refused while the writer is pending; a bounded wait)
            second.consistent(lambda: None, timeout=0.02)
        release.set()
        first.join(BOUND_S)
        writer.join(BOUND_S)
        assert second.consistent(lambda: None).version == 2
        stream.close()


def test_default_sync_is_a_no_op_on_host_data_and_sync_accepts_callables(tmp_path: Path) -> None:
    with rig(versions(256, [10], 5), tmp_path) as r:
        assert r.view.fence.device == torch.device("cpu")
        calls: list[int] = []
        obs = r.view.fence.consistent(lambda: 7, sync=lambda: calls.append(1))
        assert (obs.value, obs.version, obs.changed, calls) == (7, 1, False, [1])
        with pytest.raises(TypeError):
            r.view.fence.consistent(lambda: 7, sync=3)  # type: ignore[arg-type]
        stream, ran = CpuStream(), threading.Event()
        with pytest.raises(KeyError):  # fn raised: its launched work is still waited for
            r.view.fence.consistent(lambda: (stream.launch(ran.set), {}["x"]), sync=stream)
        assert ran.is_set()
        r.activate(2)  # (the reader let go of the lock although fn raised)
        stream.close()

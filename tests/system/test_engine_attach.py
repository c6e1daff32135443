"""Engines in other processes: zero-copy attach, in-place updates, the fence, engine-owned buffers."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from patchswarm.daemon.cuda_ipc import allocate_own_segment, export_handle, ref_counter_value, segment_violation
from patchswarm.daemon.engine import allocate, attach, export_buffer
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.journal import Action, recover
from patchswarm.daemon.store_format import StoreError, StoreLayout, StoreLayoutMismatch, StoreState, StoreStateError
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from tests.support.store_worker import SPECS, model, remove_segments, unique_name

REPO = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SEED = 5


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("en")
    yield n
    remove_segments(n)


class Engine:
    """tests/support/store_worker.py engine: attaches (or allocates) and answers commands on stdin."""

    def __init__(self, info: dict[str, Any], tmp: Path, device: str | None = None) -> None:
        f = tmp / f"info-{id(self)}.json"
        f.write_text(json.dumps(info))
        args = [sys.executable, "-m", "tests.support.store_worker", "engine", str(f), *([device] if device else [])]
        self.proc = subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.handle = self._read()["handle"]

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "engine process exited"
        return json.loads(line)

    def ask(self, cmd: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close_killed(self) -> None:
        """After a kill -9 test: close the pipes (or stop the engine if it still runs)."""
        if self.proc.poll() is None:
            self.close()
            return
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdout.close()


def test_attach_from_another_process_zero_copy_and_in_place(name: str, tmp_path: Path) -> None:
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    m1 = model(SEED, 1)
    store.load(m1, 1, m1.root())
    engine = Engine(store.attach_info(), tmp_path)
    try:
        assert engine.ask("zerocopy") is True
        assert engine.ask("version") == [1, m1.root().hex()]
        assert engine.ask("digest") == m1.root().hex()
        for k in (2, 3):  # updates in place are visible without re-attaching
            new = model(SEED, k)
            store.activate(k, new.root(), diff_updates(model(SEED, k - 1), new), tmp_path)
            assert engine.ask("version") == [k, new.root().hex()]
            assert engine.ask("digest") == new.root().hex()
    finally:
        engine.close()


def test_attach_checks_layout(name: str) -> None:
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    info = store.attach_info()
    info["layout"] = info["layout"][:-1]
    with pytest.raises(StoreLayoutMismatch):
        attach(info)


def test_fence_reader_process_during_many_activations(name: str, tmp_path: Path) -> None:
    """Every read the fence calls consistent hashes to the root it reported: no torn version is ever seen."""
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    m = model(SEED, 1)
    store.load(m, 1, m.root())
    last = 60
    info = tmp_path / "info.json"
    info.write_text(json.dumps(store.attach_info()))
    cmd = [sys.executable, "-m", "tests.support.store_worker", "reader", str(info), str(last)]
    reader = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "ready\n"
        for k in range(2, last + 1):
            new = model(SEED, k)
            store.activate(k, new.root(), diff_updates(m, new), tmp_path)
            m = new
        out, _ = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    summary = json.loads(out)
    assert reader.returncode == 0
    assert summary["bad"] == 0
    assert summary["checked"] > 0 and summary["versions"][-1] == last
    assert len(summary["versions"]) > 1  # it did read while versions changed
    print("reader:", summary)


def test_engine_owned_buffer_in_another_process(name: str, tmp_path: Path) -> None:
    """The GPU placement on its CPU twin: the engine process allocates, the daemon writes through the handle."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    engine = Engine(store.attach_info(), tmp_path, device="cpu")
    try:
        assert engine.handle["kind"] == "shm_buffer"
        store.attach_buffer(engine.handle)
        m1, m2 = model(SEED, 1), model(SEED, 2)
        assert engine.ask("version") is None
        store.load(m1, 1, m1.root())
        assert engine.ask("version") == [1, m1.root().hex()]
        store.activate(2, m2.root(), diff_updates(m1, m2), tmp_path)
        assert engine.ask("version") == [2, m2.root().hex()]
        assert engine.ask("digest") == m2.root().hex()
        assert engine.ask("zerocopy") is True
        # Daemon restart: re-attach by name, the stored handle is re-imported, contents re-verified.
        store.close()
        again = WeightStore.open(name, layout=lay)
        r = recover(again, tmp_path)
        assert (r.action, r.version) == (Action.CLEAN, 2)
        assert again.header().state == StoreState.READY
        assert engine.ask("version") == [2, m2.root().hex()]
    finally:
        engine.close()
    assert not list(Path("/dev/shm").glob(f"{name}.buf.*"))  # the engine removed its buffer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=CUDA)])
def test_buffer_of_a_killed_engine_is_let_go_unwritten(name: str, tmp_path: Path, device: str) -> None:
    """The exporter is watched: kill -9 the engine and the store drops its buffer (nothing written
    into it), goes EMPTY with the reason, and a restarted daemon does not re-import it either."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    engine = Engine(store.attach_info(), tmp_path, device=device)
    try:
        exporter = Exporter.of_pid(engine.proc.pid)
        assert exporter is not None
        store.attach_buffer(engine.handle, exporter=exporter)
        m1, m2 = model(SEED, 1), model(SEED, 2)
        store.load(m1, 1, m1.root())
        assert store.check_exporter() is None and engine.ask("version") == [1, m1.root().hex()]
        engine.proc.kill()
        engine.proc.wait(30)
        seq = store.header().seq
        why = store.check_exporter()
        assert why is not None and f"pid {engine.proc.pid}" in why and "died" in why
        assert store.data is None and store.buffer is None
        h = store.header()
        assert (h.state, h.version, h.buffer_id, h.seq) == (StoreState.EMPTY, 0, 0, seq + 2)
        assert store.attach_info()["buffer"] is None
        if device == "cpu":  # the CPU twin's orphaned segment is removed
            assert not list(Path("/dev/shm").glob(f"{name}.buf.*"))
        with pytest.raises(StoreStateError, match="died"):
            store.load(m2, 2, m2.root())
        with pytest.raises(StoreStateError, match="died"):
            store.activate(2, m2.root(), diff_updates(m1, m2), tmp_path)
        store.close()
        again = WeightStore.open(name, layout=lay)
        assert again.data is None and again.header().state == StoreState.EMPTY
    finally:
        engine.close_killed()


def test_restarted_daemon_does_not_import_a_dead_engines_buffer(name: str, tmp_path: Path) -> None:
    """The stored handle names its exporter (pid, start time): a daemon restarted after the engine
    died lets the handle go instead of mapping the orphaned buffer, and says why."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    engine = Engine(store.attach_info(), tmp_path, device="cpu")
    exporter = Exporter.of_pid(engine.proc.pid)
    assert exporter is not None
    store.attach_buffer(engine.handle, exporter=exporter)
    m1 = model(SEED, 1)
    store.load(m1, 1, m1.root())
    store.close()  # the daemon stops (or is killed) while the engine lives
    engine.proc.kill()
    engine.proc.wait(30)
    assert list(Path("/dev/shm").glob(f"{name}.buf.*"))  # the killed engine left its segment
    again = WeightStore.open(name, layout=lay)
    assert again.data is None and again.header().state == StoreState.EMPTY
    assert again.released_because is not None and f"pid {engine.proc.pid}" in again.released_because
    assert not list(Path("/dev/shm").glob(f"{name}.buf.*"))
    engine.close_killed()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_export_import(name: str, tmp_path: Path) -> None:
    """One CUDA IPC handle for the whole buffer: the engine allocates, the daemon writes on the GPU."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    engine = Engine(store.attach_info(), tmp_path, device="cuda:0")
    try:
        assert engine.handle["kind"] == "cuda_ipc"
        store.attach_buffer(engine.handle)
        assert store.data is not None and store.data.device.type == "cuda"
        m1, m2 = model(SEED, 1), model(SEED, 2)
        store.load(m1, 1, m1.root())
        stats = store.activate(2, m2.root(), diff_updates(m1, m2), tmp_path)
        assert stats.changed > 0
        assert engine.ask("version") == [2, m2.root().hex()]
        assert engine.ask("digest") == m2.root().hex()
        assert store.read_model().bitwise_equal(m2)
    finally:
        store.close()
        engine.close()


@CUDA
def test_cuda_buffer_is_the_whole_of_its_own_segment(name: str) -> None:
    """allocate gives the buffer a segment of its own (checked on the real allocator); a tensor of
    the shared pool, or part of a buffer, is refused at export with one line."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    dev = torch.device("cuda", 0)
    view = allocate(store.attach_info(), dev)
    try:
        assert view.handle is not None and view.handle["args"]["offset"] == 0
        assert segment_violation(view.data.data_ptr(), view.data.numel(), torch.cuda.memory_snapshot()) is None
        crowd = [torch.ones(1 << 20, dtype=torch.uint8, device=dev) for _ in range(3)]  # shared small/large pools
        for bad in (crowd[1], view.data[4096:], torch.empty(30 << 20, dtype=torch.uint8, device=dev)[: 25 << 20]):
            with pytest.raises(StoreError, match=r"daemon\.engine\.allocate"):
                export_buffer(bad, 9)
    finally:
        view.close()
        store.close()


IMPORTER = """
import json, os, signal, sys, torch
from patchswarm.daemon.cuda_ipc import import_handle
args, mode = json.loads(sys.argv[1]), sys.argv[2]
t = import_handle(args, 0)
t[int(sys.argv[3])] = 7
torch.cuda.synchronize()
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
del t
print("released", flush=True)
"""


@CUDA
def test_cuda_successive_importers_never_move_the_producers_ipc_count() -> None:
    """This process exports (the engine); daemons import, write, release, or are killed, one after
    the other: torch's counter for the share stays 0 (given back at export), never negative, and
    the engine's memory is freed when the engine frees it (nothing parked for a dead daemon)."""
    dev = torch.device("cuda", 0)
    own = allocate_own_segment(1, dev)
    counters: list[tuple[bytes, int]] = []
    args = export_handle(own.data, counters)
    assert len(counters) == 1 and ref_counter_value(*counters[0]) == 0
    for k, mode in enumerate(["release", "release", "kill", "release"]):
        out = subprocess.run([sys.executable, "-c", IMPORTER, json.dumps(args), mode, str(k)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == (-9 if mode == "kill" else 0), out.stderr[-2000:]
        assert ref_counter_value(*counters[0]) == 0
        assert int(own.data[k]) == 7  # the importer wrote into the engine's memory
    before, size = torch.cuda.memory_allocated(dev), own.data.numel()
    del own
    gc.collect()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated(dev) <= before - size  # freed, not parked in torch's IPC limbo

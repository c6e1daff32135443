"""The fence's readers' lock across processes: an engine killed (SIGKILL) while it holds the lock
inside ``FenceReader.consistent`` never blocks the daemon's writes; until it dies, the writer's
bound names it and writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from patchswarm.daemon.fence_lock import ReadersStalled
from patchswarm.daemon.journal import journal_path
from patchswarm.daemon.store_format import StoreLayout
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from tests.support.store_worker import SPECS, model, remove_segments, unique_name

REPO = Path(__file__).resolve().parents[2]
SEED = 9

# An engine that attaches, then stays inside one fenced read forever (a hung forward pass).
HOLDER = """
import json, sys, time
from patchswarm.daemon.engine import attach
view = attach(json.load(open(sys.argv[1])))
def hang():
    print("holding", flush=True)
    time.sleep(3600)
view.fence.consistent(hang)
"""


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("fr")
    yield n
    remove_segments(n)


def test_a_reader_killed_inside_its_read_never_blocks_the_writer(name: str, tmp_path: Path) -> None:
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    v1, v2, v3 = model(SEED, 1), model(SEED, 2), model(SEED, 3)
    store.load(v1, 1, v1.root())
    info = tmp_path / "info.json"
    info.write_text(json.dumps(store.attach_info()))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(info)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        # While it lives, the write waits for it, and past the bound says who holds the store.
        store.gate.wait_s = 0.2
        seq = store.control.seq()
        with pytest.raises(ReadersStalled, match=rf"pid {proc.pid}\b.*nothing was written"):
            store.activate(2, v2.root(), diff_updates(v1, v2), tmp_path)
        assert store.control.seq() == seq and store.read_model().bitwise_equal(v1)
        assert not journal_path(tmp_path).exists()
        # kill -9 inside its read: the kernel drops its lock, the next write goes ahead at once.
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        store.gate.wait_s = 10.0
        store.activate(2, v2.root(), diff_updates(v1, v2), tmp_path)
        store.activate(3, v3.root(), diff_updates(v2, v3), tmp_path)
        assert store.header().version == 3 and store.read_model().bitwise_equal(v3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        store.close()

"""One daemon per data directory: a second daemon started with the same config exits non-zero
with one line naming the data dir and the running daemon's pid, and touches nothing of it (its
API socket still answers, its store still holds the same verified version)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.engine import attach
from daemon.instance_lock import InstanceLock, InstanceLockedError
from tests.daemonkit import ROOT, make_daemon
from tests.swarmkit import Swarm


@pytest.mark.asyncio
async def test_second_daemon_on_the_same_data_dir_leaves_the_first_alone(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "host", tmp_path)
    try:
        d.start()
        before = await d.wait_version(1)
        assert d.proc is not None
        view = attach((await d.get("/v1/layout"))["attach"])
        socket_inode = os.stat(d.socket).st_ino
        second = subprocess.run(
            [sys.executable, "-m", "daemon.cli", "daemon", "--config", str(d.config)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ),
        )  # fmt: skip
        assert second.returncode != 0
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        data_dir = str(d.dir / "data")
        assert data_dir in lines[0] and f"pid {d.proc.pid}" in lines[0], lines[0]
        # The first one is untouched: same socket file, still answering, same version in its store.
        assert d.alive and os.stat(d.socket).st_ino == socket_inode
        after = await d.status()
        assert after is not None and (after["version"], after["root"], after["state"]) == (
            before["version"], before["root"], "idle",
        )  # fmt: skip
        assert view.read_version() == (1, sw.served[1].root())
        v2 = sw.publish()  # and it goes on following the run
        await d.wait_version(v2)
        assert view.read_version() == (v2, sw.served[v2].root())
        view.close()
        assert await d.stop() == 0
        # Stopped (or killed), it holds nothing: the next daemon on the data dir starts.
        d.start()
        await d.wait_version(v2)
    finally:
        d.cleanup()
        await sw.close()


def test_lock_is_released_on_close_and_names_its_holder(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path / "data")
    first.acquire()
    with pytest.raises(InstanceLockedError, match=rf"{tmp_path / 'data'}.*pid {os.getpid()}"):
        InstanceLock(tmp_path / "data").acquire()
    first.release()
    again = InstanceLock(tmp_path / "data")
    again.acquire()
    again.release()

"""Watching the engine that exported a buffer (daemon/exporter.py): real processes, real /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.daemon.exporter import Exporter, parse_stat, peer_pid, proc_start


def test_parse_stat_takes_fields_after_the_last_parenthesis() -> None:
    tail = " ".join(str(i) for i in range(4, 53))  # fields 4..52
    assert parse_stat(f"123 (python) S {tail}") == 22
    assert parse_stat(f"123 (a) b (c) S {tail}") == 22  # a command name with spaces and parentheses
    assert parse_stat(f"123 (x) Z {tail}") is None  # a zombie holds no memory
    assert parse_stat("123 (x) S 1 2") is None
    assert parse_stat("") is None


def test_exporter_of_a_child_that_is_killed() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ex = Exporter.of_pid(child.pid)
        assert ex is not None and ex.alive()
        assert ex.start == proc_start(child.pid)
        assert Exporter.from_json(ex.to_json()) == ex
        assert not Exporter(child.pid, ex.start + 1).alive()  # same pid, another process (pid reuse)
        child.kill()
        child.wait(30)
        assert not ex.alive()
        assert not Exporter(child.pid, ex.start).alive()  # without a pidfd: /proc says it is gone
        assert Exporter.of_pid(child.pid) is None
        ex.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_exporter_json_is_validated() -> None:
    for bad in (None, [], {}, {"pid": "1", "start": 2}, {"pid": 0, "start": 2}, {"pid": 5, "start": -1},
                {"pid": True, "start": 1}, {"pid": 1 << 40, "start": 1}):  # fmt: skip
        assert Exporter.from_json(bad) is None


def test_peer_pid_is_the_connecting_process(tmp_path: Path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_pid(a) == os.getpid()
    with socket.socket(socket.AF_INET) as s:
        assert peer_pid(s) is None
    assert peer_pid(None) is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_own_process_is_alive() -> None:
    ex = Exporter.of_pid(os.getpid())
    assert ex is not None and ex.alive()
    ex.close()

"""The swarm as separate OS processes (`patchswarm seed --run` + `patchswarm node`) on loopback."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.boards import free_port
from tests.support.swarmkit import RUN, SECRET, Swarm

NODES = 4


class Proc:
    """A child process whose JSON lines are collected by a reader thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "patchswarm.daemon.cli", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.versions: dict[int, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))

    def wait_event(self, event: str, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    raise AssertionError(f"process exited: {self.p.stderr.read() if self.p.stderr else ''}") from None
                continue
            if msg.get("event") == "version":
                self.versions[int(msg["version"])] = str(msg["root"])  # type: ignore[call-overload]
            if msg.get("event") == event:
                return msg
        raise AssertionError(f"no {event!r} within {timeout}s")

    def wait_version(self, version: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while version not in self.versions:
            self.wait_event("version", max(0.1, deadline - time.monotonic()))
        return self.versions[version]

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(timeout=20)
        finally:
            for f in (self.p.stdout, self.p.stderr):
                if f:
                    f.close()
        return rc


@pytest.mark.slow
def test_seed_and_nodes_as_processes_converge_bitwise(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    (tmp_path / "secret").write_bytes(SECRET)
    s.root.save(tmp_path / "root.key")
    common = ["--run", RUN, "--secret-file", "secret"]
    seed_port = free_port()
    seed = Proc(
        ["seed", "--board", str(s.board.root), "--listen", f"127.0.0.1:{seed_port}", "--name", "seed", *common]
        + ["--max-uploads", "8", "--upload-queue", "6", "--copy-window", "1.5"],
        tmp_path,
    )
    procs: list[Proc] = []
    try:
        seed_url = str(seed.wait_event("listening", 60)["url"])
        for i in range(NODES):
            procs.append(
                Proc(
                    ["node", "--listen", f"127.0.0.1:{free_port()}", "--name", f"p{i}", "--trust", "root.key.pub"]
                    + ["--bootstrap", seed_url, "--seed-url", seed_url, "--print-root", *common],
                    tmp_path,
                )
            )
        for v in (1, 2, 3):
            if v > 1:
                s.publish(scale=5e-4)
            expected = s.served[v].root().hex()
            for p in procs:
                assert p.wait_version(v, 90) == expected
    finally:
        rcs = [p.stop() for p in procs] + [seed.stop()]
    assert rcs == [0] * (NODES + 1)


@pytest.mark.parametrize("secret", ["", "short"])
def test_node_refuses_a_missing_or_weak_cluster_secret(tmp_path: Path, secret: str) -> None:
    s = Swarm(tmp_path)
    s.root.save(tmp_path / "root.key")
    (tmp_path / "secret").write_text(secret)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "patchswarm.daemon.cli",
            "node",
            "--listen",
            "127.0.0.1:0",
            "--run",
            RUN,
            "--trust",
            "root.key.pub",
        ]
        + ["--secret-file", "secret"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cluster secret" in r.stderr and "Traceback" not in r.stderr


def test_upload_flags_reach_the_node_config_and_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from patchswarm.daemon.cli import build_parser
    from patchswarm.daemon.swarm_cli import _config

    monkeypatch.setenv("PATCHSWARM_CLUSTER_SECRET", SECRET.decode())
    parser = build_parser()
    seed = parser.parse_args(["seed", "--board", "b", "--run", RUN, "--max-uploads", "8", "--upload-queue", "6"])
    cfg = _config(seed, is_seed=True, listen="127.0.0.1:1")
    # A trainer seed's flags tune the seed's own fields; the rest keep their defaults.
    assert (cfg.seed_max_uploads, cfg.seed_upload_queue, cfg.seed_copy_window) == (8, 6, 2.0)
    seed = parser.parse_args(["seed", "--board", "b", "--run", RUN, "--copy-window", "0.5", "--object-copies", "0"])
    cfg = _config(seed, is_seed=True, listen="x")
    assert (cfg.seed_copy_window, cfg.seed_object_copies) == (0.5, 0)
    node = parser.parse_args(["node", "--listen", "127.0.0.1:1", "--run", RUN, "--trust", "t", "--max-uploads", "3"])
    cfg = _config(node, is_seed=False, listen="127.0.0.1:1")
    assert (cfg.max_uploads, cfg.upload_queue, cfg.seed_max_uploads) == (3, 2, 6)
    for bad, why in (("-1", "outside 0..1024"), ("many", "not a whole number")):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["node", "--listen", "127.0.0.1:1", "--run", RUN, "--trust", "t", "--max-uploads", bad])
        assert info.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["node", "--listen", "127.0.0.1:1", "--run", RUN, "--trust", "t", "--copy-window", "1"]
        )  # a seed's

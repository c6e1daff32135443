"""The swarm as separate OS processes (`patchswarm seed --run` + `patchswarm node`) on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.boards import free_port
from tests.support.cli_procs import Proc
from tests.support.swarmkit import RUN, SECRET, Swarm

NODES = 4


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

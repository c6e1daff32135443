"""``patchswarm simulate --workers N`` and ``--ray local``: the sweep points elsewhere, the same results.csv."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
SMALL = ROOT / "simulations" / "scenarios" / "small.toml"
# Three points, each with every strategy: enough for two workers to finish them out of order.
SWEEP = ("--sweep", "hosts.count=4,8,6")


def simulate(out: Path, *args: str) -> Path:
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "simulate", str(SMALL), "--out", str(out), "--seed", "5",
         *SWEEP, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate(tmp_path_factory.mktemp("one") / "out")


@pytest.mark.slow
def test_two_workers_write_the_same_results_as_one_process(in_process: Path, tmp_path: Path) -> None:
    two = simulate(tmp_path / "two", "--workers", "2")
    assert (two / "results.csv").read_bytes() == (in_process / "results.csv").read_bytes()
    summary = json.loads((two / "summary.json").read_text())
    assert [p["index"] for p in summary["points"]] == [0, 1, 2]  # in sweep order
    assert " --workers 2 --sweep " in summary["command"]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'patchswarm[ray]')"
)
def test_a_local_ray_instance_writes_the_same_results_as_one_process(in_process: Path, tmp_path: Path) -> None:
    on_ray = simulate(tmp_path / "ray", "--ray", "local")
    assert (on_ray / "results.csv").read_bytes() == (in_process / "results.csv").read_bytes()
    assert " --ray local --sweep " in json.loads((on_ray / "summary.json").read_text())["command"]

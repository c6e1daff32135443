"""``patchswarm simulate``: the real console entry on small.toml, its outputs, determinism, and the strategies."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.daemon.cli import main
from patchswarm.simulations.scenario import churn_schedule, layout, parse_text
from patchswarm.simulations.strategies import bound, central

ROOT = Path(__file__).parents[2]
SMALL = ROOT / "simulations" / "scenarios" / "small.toml"
STRATEGIES = {"checkpoint", "central", "swarm"}
PNG = b"\x89PNG\r\n\x1a\n"


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "simulate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """small.toml twice with the same seed."""
    outs = [tmp_path_factory.mktemp("study") / "out" for _ in range(2)]
    for out in outs:
        r = simulate(str(SMALL), "--out", str(out), "--seed", "3")
        assert r.returncode == 0, r.stderr
    return outs


def rows(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_every_output_is_written_and_well_formed(runs: list[Path]) -> None:
    out = runs[0]
    table = rows(out)
    # one row per host per version per strategy
    assert len(table) == 12 * 2 * 3
    assert {r["strategy"] for r in table} == STRATEGIES
    assert {(r["host"], r["version"]) for r in table if r["strategy"] == "swarm"} == {
        (f"lan-{i:05d}", v) for i in range(12) for v in ("1", "2")
    }
    for r in table:
        t = float(r["completion_s"])
        assert 0 < t < math.inf
        got = float(r["from_seed_bytes"]) + float(r["from_peers_bytes"])
        size = 2e9 if r["strategy"] == "checkpoint" else 100e6
        assert got == pytest.approx(size)  # every host took the whole payload of each version, once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"].startswith("patchswarm simulate ")
    assert summary["build"] == "interpreted"  # the suite runs the source; make native's build says "native (...)"
    [point] = summary["points"]
    assert point["seed"] == 3 and point["hosts"] == 12
    assert set(point["strategies"]) == STRATEGIES
    for m in point["strategies"].values():
        assert m["time_to_all_s"] >= m["p99_s"] >= m["p50_s"] > 0
        assert m["incomplete"] == 0 and m["events"] > 0 and m["wall_s"] >= 0
        assert m["ratio_to_bound"] == pytest.approx(m["time_to_all_s"] / point["bound_s"])
    report = (out / "report.md").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["cdf-00.png"]
    for name in pngs:
        assert (out / name).read_bytes().startswith(PNG)
        assert f"]({name})" in report
    assert "| patch, swarm |" in report and "Bound:" in report


def test_the_same_seed_gives_identical_results(runs: list[Path]) -> None:
    a, b = ((out / "results.csv").read_bytes() for out in runs)
    assert a == b


def test_no_swarm_beats_the_bound_and_the_swarm_spares_the_seed(runs: list[Path]) -> None:
    point = json.loads((runs[0] / "summary.json").read_text())["points"][0]
    m = point["strategies"]
    for v, tta in enumerate(m["swarm"]["time_to_all_by_version_s"], 1):
        assert tta >= point["bound_s"], f"version {v}"
    assert m["swarm"]["ratio_to_bound"] >= 1
    # N = 12 >= 8: the central seed sends every host a copy; the swarm's seed about one.
    assert m["swarm"]["seed_egress_bytes"] < m["central"]["seed_egress_bytes"] / 4
    assert m["central"]["seed_egress_bytes"] == pytest.approx(12 * 2 * 100e6)
    assert m["swarm"]["time_to_all_s"] < m["central"]["time_to_all_s"] < m["checkpoint"]["time_to_all_s"]


def test_a_sweep_gives_one_point_per_value_and_plots_against_it(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    r = simulate(str(SMALL), "--out", str(out), "--sweep", "hosts.count=8,16", "--sweep", "run.strategies=['central']")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [p["params"] for p in summary["points"]] == [
        {"hosts.count": 8, "run.strategies": ["central"]},
        {"hosts.count": 16, "run.strategies": ["central"]},
    ]
    assert [set(p["strategies"]) for p in summary["points"]] == [{"central"}, {"central"}]
    assert {p.name for p in out.glob("*.png")} == {
        "cdf-00.png",
        "cdf-01.png",
        "time_to_all_vs_hosts.count.png",
        "seed_egress_vs_hosts.count.png",
    }
    # the store's uplink is shared by all: twice the hosts, twice the time (version 1: nothing queued before it)
    t8, t16 = (p["strategies"]["central"]["time_to_all_by_version_s"][0] for p in summary["points"])
    assert t16 == pytest.approx(2 * t8, rel=0.01)
    assert len(rows(out)) == (8 + 16) * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "hosts.count=8,0"], "hosts.count: must be an integer in [1, 10000], got 0"),
        (["--sweep", "hosts.colour=1"], "hosts.colour: not a sweepable key"),
        (["--sweep", "hosts.count"], "--sweep: expected KEY=V1,V2,..."),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    assert main(["simulate", str(SMALL), "--out", str(out), *args]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"patchswarm simulate: error: {message}" or message in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_missing_scenario_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o")]) == 1
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- the central strategies, by hand


def test_central_store_shares_its_uplink_max_min() -> None:
    # 4 hosts, a 100 MB/s store, 100 MB: each gets 25 MB/s -> 4 s, plus the request and the reply latency.
    s = parse_text(
        """
        [hosts]
        count = 4
        [seed]
        uplink = 1e8
        [[regions]]
        name = "r"
        share = 1.0
        latency = "1ms"
        [payload]
        patch_size = 1e8
        checkpoint_size = 4e8
        chunk_size = 1e6
        [network]
        window = 0
        """
    )
    lay = layout(s)
    patch = central(s, lay, (), "central")
    assert patch.times() == pytest.approx([4.002] * 4)
    assert patch.seed_egress == 4e8
    full = central(s, lay, (), "checkpoint")
    assert full.times() == pytest.approx([16.002] * 4)
    assert bound(s, lay) == pytest.approx(1.0)  # F / u_seed: the hosts' links are unlimited


def test_central_resumes_whole_chunks_after_a_crash() -> None:
    s = parse_text(
        """
        [hosts]
        count = 2
        [seed]
        uplink = 1e8
        [[regions]]
        name = "r"
        share = 1.0
        latency = 0
        [payload]
        patch_size = 1e8
        chunk_size = 1e7
        [churn]
        crash_rate = 1.0
        rejoin_after = 1.0
        window = 1.0
        """
    )
    lay = layout(s)
    churn = churn_schedule(s, lay.peers)
    assert sorted(e.up for e in churn) == [False, False, True, True]
    r = central(s, lay, churn, "central")
    assert all(0 < t < math.inf for t in r.times())
    # resuming loses at most one partial chunk per crash: the store sends < 2 patches + 2 chunks
    assert 2e8 <= r.seed_egress < 2e8 + 2e7
    assert all(o.from_seed >= 1e8 for o in r.outcomes)

"""The real-latency testbed, CI-sized: 2 regions x 3 hosts, a 2 MB patch, 40 ms between the regions.

A correctness check of the testbed (benchmarks/latency_testbed.py), not a speed assertion: the delay line
delivers the configured RTT, the tbf uplinks hold the configured rate, every host of every system ends with
the published bytes (patchswarm's state roots, the downloaded files' SHA-256), and no namespace is left.
Needs root (network namespaces, tc, /dev/net/tun); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import swarm_bench as sb
from benchmarks.latency_net import can_run, namespaces
from benchmarks.latency_testbed import accepted, summary

ROOT = Path(__file__).resolve().parents[2]
RTT_MS = 40.0
RATE = 2e6


def _libtorrent() -> bool:
    try:
        import libtorrent  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_ci_sized_testbed_delivers_the_rtt_and_every_system_converges_bitwise(tmp_path: Path) -> None:
    why = can_run()
    if why:
        pytest.skip(why)
    systems = ["patchswarm", "central"] + (["libtorrent"] if _libtorrent() else [])
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "benchmarks.latency_testbed", "--regions", "2", "--hosts", "3"]
    argv += ["--rtt", f"{RTT_MS:g}", "--rate", f"{RATE:g}", "--size-mb", "2", "--settle", "1", "--verify"]
    argv += ["--systems", ",".join(systems), "--repeat", "1", "--sim-seeds", "1", "--json", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            p.terminate()  # the testbed removes its namespaces on SIGTERM
            p.communicate(timeout=60)
    assert p.returncode == 0, stderr[-4000:]
    assert not [ns for ns in namespaces() if ns.startswith(f"lt{p.pid}-")], "namespaces left behind"
    doc = json.loads(out.read_text())

    rows = {r["pair"]: r for r in doc["calibration"]["rtt"]}
    assert set(rows) == {"r0-r0", "r0-r1", "r1-r1"}
    cross = rows["r0-r1"]
    # The delay line adds the configured RTT: never noticeably less, and the median within 5% or 2 ms
    # (what is left is the kernel's path and the relay's wake-ups on a shared machine).
    assert cross["configured_ms"] == RTT_MS
    assert cross["min_ms"] >= RTT_MS - 2.0, cross
    assert abs(cross["median_ms"] - RTT_MS) <= max(2.0, 0.05 * RTT_MS), cross
    for pair in ("r0-r0", "r1-r1"):  # inside a region nothing is delayed
        assert rows[pair]["median_ms"] < 5.0, rows[pair]
    # The tbf uplink: one TCP flow cannot beat the configured rate (a 15% margin for the measurement).
    for name, rate in doc["calibration"]["bulk"].items():
        assert 0.2 * RATE < rate <= 1.15 * RATE, (name, rate)

    results = {r["name"].split()[0]: r for r in doc["results"]}
    assert set(results) == {"patchswarm", "central", *(["libtorrent"] if "libtorrent" in systems else [])}
    for name, r in results.items():
        assert r["time_to_all"] is not None, f"{name} did not reach every host"
        assert len(r["per_node"]) == 6
        checks = r["extra"]["roots_ok" if name == "patchswarm" else "sha256_ok"]
        assert checks == [True] * 6, (name, checks)
    assert doc["relay"]["packets"] > 0 and doc["relay"]["dropped"] == 0
    assert "| patchswarm |" in stdout


def test_median_and_range_of_the_runs() -> None:
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summary([4.0, 1.0, 2.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0, "n": 4}


def test_a_run_that_waited_for_the_cpu_or_filled_the_cores_is_rejected() -> None:
    """The acceptance rule reads the run's measured CPU and run-queue wait (no root needed)."""
    import argparse

    args = argparse.Namespace(max_wait=0.25, max_cpu=0.6)
    cores = os.cpu_count() or 1

    def run(cpu: float, wait: float, wall: float = 10.0, done: bool = True) -> sb.Result:
        extra = {"wall": wall, "cpu_wait_s": wait, "relay_cpu_s": 1.0, "relay_wait_s": 0.0}
        return sb.Result("patchswarm", 1, 6, 1e6, 1.0, wall if done else None, 1, cpu - 1.0, 0.0, 1.0, extra=extra)

    assert accepted(run(2.0, 0.4), args) == (True, "")  # waited 0.4 s for 2 CPU-s: 20%
    ok, why = accepted(run(2.0, 0.6), args)
    assert not ok and "CPU wait" in why
    ok, why = accepted(run(0.61 * 10.0 * cores + 0.1, 0.0), args)
    assert not ok and "of the cores" in why
    assert accepted(run(2.0, 0.0, done=False), args) == (False, "did not finish")

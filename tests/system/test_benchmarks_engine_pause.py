"""benchmarks/engine_pause_bench.py, tiny: a smoke test of the script (real engine process, real store,
real driver), not a speed assertion; and its arithmetic for the latency a stream saw added."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engine_pause_bench import PARTS, stream_delays

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_every_part_of_each_update(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [sys.executable, "-m", "benchmarks.engine_pause_bench", "--mb", "0.5", "--hidden", "64", "--updates", "3"]
    argv += ["--stream-updates", "2", "--stream-tokens", "200", "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pause / memcpy" in proc.stdout and "latency added per update" in proc.stdout
    (r,) = json.loads(out.read_text())["sizes"]
    numel = r["served_bytes"] // 2
    assert 0 < r["changed"] <= math.ceil(numel * 0.005)  # (duplicate positions and zeroed rows change less)
    assert len(r["stream_added_s"]) == 2 and r["stream_chunks"] >= 8 + 2 * 4
    for phase in ("idle", "streaming"):
        rows = r[phase]
        for k in ("pause", *PARTS, "activate_other"):
            assert rows[k]["min"] <= rows[k]["median"] <= rows[k]["max"], (phase, k)
        assert all(rows[k]["min"] >= 0 for k in ("pause", *PARTS))


def test_the_latency_added_is_the_gap_around_an_update_less_the_usual_gaps() -> None:
    # Chunks every 10 ms; one update from 35 to 62 ms: chunk 40 is held until 70 (one chunk inside the window
    # would count), the next after it resumes at 80.  Gap across the update: 30 -> 70 = 40 ms, one usual gap
    # accounted for: 30 ms added.
    arrivals = [0.0, 0.010, 0.020, 0.030, 0.070, 0.080, 0.090, 0.100]
    base, added = stream_delays([{"start": 0.035, "end": 0.062}], arrivals)
    assert base == pytest.approx(0.010)
    assert added == [pytest.approx(0.030)]
    # A chunk that lands between the pause call and resume (the step in flight finishing) is accounted for.
    arrivals = [0.0, 0.010, 0.020, 0.030, 0.038, 0.070, 0.080, 0.090]
    base, added = stream_delays([{"start": 0.035, "end": 0.062}], arrivals)
    assert added == [pytest.approx((0.070 - 0.030) - 2 * 0.010)]

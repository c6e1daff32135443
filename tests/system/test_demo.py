"""``make demo`` end to end with tiny settings: a trainer, a seed, two daemons and ``patchswarm engine
transformers`` behind host 1's sidecar, as separate processes; it exits 0 (every host bitwise the
trainer's) and its table shows the engine's answer for every published version."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.daemonkit import ROOT

pytest.importorskip("transformers")


@pytest.mark.slow
def test_demo_runs_and_answers_every_version() -> None:
    steps = 2
    env = dict(os.environ, COLUMNS="250", TERM="dumb")  # a wide table: no cell wrapped
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.demo", "--steps", str(steps), "--hosts", "2", "--preset", "tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=500, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "every host matched the trainer bitwise" in r.stdout
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 9 and cells[0].isdigit():  # the final table: version ... answer, log p, logits hash
            rows[int(cells[0])] = cells
    assert sorted(rows) == list(range(1, steps + 2)), r.stdout[-4000:]  # the warm-up's version, then each step's
    for v, cells in rows.items():
        assert cells[5] == "2/2 identical", (v, cells)
        assert re.fullmatch(r"'.+'", cells[6]), (v, cells)  # an answer text
        assert re.fullmatch(r"-?\d+\.\d{6}", cells[7]), (v, cells)
        assert re.fullmatch(r"[0-9a-f]{8}", cells[8]), (v, cells)

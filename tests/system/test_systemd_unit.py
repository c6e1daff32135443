"""The packaged systemd unit passes `systemd-analyze verify` and rates "OK" or better for security."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[2] / "packaging/systemd/patchswarm.service"
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (make test installs it)")


def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this environment's entry point (verify checks it exists)."""
    exe = Path(sys.executable).with_name("patchswarm")
    text = UNIT.read_text().replace("/opt/patchswarm/.venv/bin/patchswarm", str(exe))
    out = tmp_path / "patchswarm.service"
    out.write_text(text)
    return out


def test_verify(tmp_path: Path) -> None:
    r = subprocess.run([str(ANALYZE), "verify", "--man=no", str(unit_copy(tmp_path))], capture_output=True, text=True)
    problems = [line for line in r.stderr.splitlines() if "patchswarm.service" in line]
    assert r.returncode == 0 and not problems, r.stderr


def test_security_rating_ok_or_better(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(ANALYZE), "security", "--offline=true", "--no-pager", str(unit_copy(tmp_path))],
        capture_output=True,
        text=True,
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert m.group(2) in ("SAFE", "OK"), m.group(0)
    print(m.group(0))


def test_unit_essentials() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectory=patchswarm", "User=patchswarm"):
        assert line in text

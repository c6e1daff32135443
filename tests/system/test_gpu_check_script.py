"""benchmarks/gpu_check.sh's own logic, without a GPU: the plan (--dry-run), failing fast, the time
budget, and the junit check that fails a run whose CUDA tests skipped (benchmarks/gpu_junit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks.gpu_junit import problems

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip


def test_dry_run_plan_is_cheap_first_and_checks_every_pytest_step() -> None:
    out = run("--dry-run", PYTHON=sys.executable)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    names = [ln.split()[1].rstrip(":") for ln in lines if ln.startswith(("step ", "check "))]
    assert lines[0].startswith("preflight:")
    assert names == ["cuda_quick", "cuda_quick_skips", "codec_digest", "format2", "cuda_system", "cuda_system_skips",
                     "activation", "tp_ranks", "tp_ranks_skips", "publish", "engines"]  # fmt: skip
    limits = [int(ln.split("limit=")[1].split("s ")[0]) for ln in lines if "limit=" in ln]
    assert all(limit <= 360 for limit in limits)
    assert all("--junitxml" in ln for ln in lines if "-m pytest" in ln)
    assert "not without_cuda" in out.stdout  # the no-CUDA tests would skip on a GPU: not selected


def test_unknown_argument_and_missing_packages_fail_fast(tmp_path: Path) -> None:
    out = run("--bogus")
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr
    # A Python without the project's dependencies (the system one): preflight stops everything.
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    res = run("--tiny", PYTHON=str(bare), OUT=str(tmp_path / "out"))
    assert res.returncode == 2, res.stdout + res.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "preflight: missing Python packages" in summary and "nothing else run" in summary
    assert "cuda_quick" not in summary


def test_a_spent_budget_skips_the_rest_and_fails(tmp_path: Path) -> None:
    out = run("--tiny", PYTHON=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_BUDGET_S="1")
    assert out.returncode == 1, out.stdout + out.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    steps = ("cuda_quick", "codec_digest", "format2", "cuda_system", "activation", "tp_ranks", "publish", "engines")
    for name in steps:
        assert f"{name}: skipped (the 1 s budget is spent)" in summary


def test_junit_check_fails_on_a_skipped_test(tmp_path: Path) -> None:
    tests = tmp_path / "test_demo.py"
    tests.write_text(
        textwrap.dedent("""
        import pytest
        def test_ran():
            pass
        @pytest.mark.skip(reason="needs CUDA")
        def test_cuda_thing():
            pass
    """)
    )
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={xml}"],
                   cwd=tmp_path, capture_output=True, timeout=120)  # fmt: skip
    found = problems([str(xml)])
    assert len(found) == 1 and "skipped" in found[0] and "test_cuda_thing" in found[0] and "needs CUDA" in found[0]
    cli = subprocess.run([sys.executable, "-m", "benchmarks.gpu_junit", str(xml)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 1 and "test_cuda_thing" in cli.stdout
    tests.write_text("def test_ran():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={xml}"],
                   cwd=tmp_path, capture_output=True, timeout=120)  # fmt: skip
    assert problems([str(xml)]) == []
    empty = tmp_path / "empty.xml"
    empty.write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    assert problems([str(empty)]) == [f"{empty}: no test ran"]
    (tmp_path / "bad.xml").write_text("<testsuites")
    assert "not a readable JUnit XML file" in problems([str(tmp_path / "bad.xml")])[0]
    assert "not a readable" in problems([str(tmp_path / "missing.xml")])[0]

"""The native build (``make native``: the hot modules compiled by mypyc, simulations/build.py) runs
the same simulations as the source, event for event; only its speed differs
(docs/simulation.md#the-native-build).

``make test`` compiles it first; without a C compiler or Python's headers there is no build, and
after an edit a plain ``pytest`` finds the build older than the source: these tests are skipped
with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.simulations.build import NATIVE_MODULES, PACKAGES

ROOT = Path(__file__).parents[2]
NATIVE = ROOT / "build" / "native"
SMALL = ROOT / "simulations" / "scenarios" / "small.toml"


def _why_not() -> str | None:
    """Why these tests cannot run: no build, or a build older than the source (edited since ``make native``)."""
    if not (NATIVE / ".built").exists():
        return "no native build (make native needs a C compiler and Python.h)"
    for package in PACKAGES:
        src = sorted(p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py"))
        copy = NATIVE / "patchswarm"  # (the build copies each package folder to patchswarm/<package>)
        if src != sorted(p.relative_to(copy) for p in (copy / package).rglob("*.py")):
            return f"build/native has other {package}/ files than the source: run make native"
        for rel in src:
            if (ROOT / rel).read_bytes() != (copy / rel).read_bytes():
                return f"build/native is older than {rel}: run make native"
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def run(native: bool, *args: str) -> str:
    """``python [-P] ARGS`` from the repository root, on the native build or on the source."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    flags: list[str] = []
    if native:
        env["PYTHONPATH"] = f"{NATIVE}{os.pathsep}{ROOT}"  # the build first; the root after it for benchmarks/
        flags = ["-P"]  # the source tree in the working directory must not shadow the build
    r = subprocess.run([sys.executable, *flags, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_native_build_is_compiled() -> None:
    """Every module simulations.build lists loads from a C extension on the build, and none on the source."""
    code = (
        "import importlib\n"
        "from patchswarm.simulations.build import NATIVE_MODULES, compiled_modules\n"
        "for m in NATIVE_MODULES: importlib.import_module(m.removesuffix('.py').replace('/', '.'))\n"
        "print(len(compiled_modules()))"
    )
    assert run(True, "-c", code).strip() == str(len(NATIVE_MODULES))
    assert run(False, "-c", code).strip() == "0"


def test_a_study_gives_the_same_results_csv(tmp_path: Path) -> None:
    """small.toml (three strategies, two versions): byte-identical results.csv from both builds."""
    files = {}
    for native in (False, True):
        out = tmp_path / ("native" if native else "source")
        run(native, "-m", "patchswarm.daemon.cli", "simulate", str(SMALL), "--out", str(out), "--seed", "5")
        files[native] = (out / "results.csv").read_bytes()
        build = (out / "summary.json").read_text()
        assert ('"build": "native (' in build) == native
    assert files[True] == files[False]


@pytest.mark.slow
def test_a_swarm_run_has_the_same_events_requests_and_times() -> None:
    """60 real nodes, 100 MB in 4 MiB chunks: every figure but the CPU, wall and memory ones agree."""
    args = ["-m", "benchmarks.sim_bench", "swarm", "--hosts", "60", "--patch-mb", "100", "--chunk-mib", "4"]
    outs = {native: run(native, *args) for native in (False, True)}
    machine = re.compile(r"wall [\d.]+ s \(cpu [\d.]+ s\)|\(\d+/s wall\)|peak RSS [\d.]+ GB, .*$", re.M)
    same = {native: machine.sub("", text) for native, text in outs.items()}
    assert "native (" in outs[True] and "interpreted" in outs[False]
    assert "60/60 hosts" in same[False]
    assert same[True] == same[False]

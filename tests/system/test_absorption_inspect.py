"""The absorption study's changed fractions and patch bytes agree with what `patchswarm diff` writes
and `patchswarm inspect` reports for the same versions on disk (real CLI processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.absorption_study import main


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("absorption")
    args = ["--preset", "tiny", "--archs", "llama", "--regimes", "sft", "--optimizers", "adamw"]
    assert main([*args, "--steps", "2", "--state-steps", "2", "--out", str(d), "--dump", str(d)]) == 0
    [run] = json.loads((d / "absorption.json").read_text())["runs"]
    return d, run


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_changed_fractions_and_bytes_equal_those_inspect_reports(dumped: tuple[Path, dict[str, Any]], fmt: str) -> None:
    tmp_path, run = dumped
    study = run["formats"][fmt]
    versions = tmp_path / "llama-sft-adamw" / fmt
    pairs = {  # (base, target): (changed fraction, patch bytes) the study reports
        (1, 2): (study["changed"][1], study["patch"][1]),
        (0, 2): (study["catchup_changed"][1], study["catchup_patch"][1]),  # a catch-up patch
    }
    for (a, b), (fraction, nbytes) in pairs.items():
        patch = tmp_path / f"{fmt}-{a}-{b}.psw"
        r = cli(
            "diff", str(versions / f"v{a:04d}.safetensors"), str(versions / f"v{b:04d}.safetensors"), "-o", str(patch),
            "--version", str(b), "--base-version", str(a), cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        r = cli("inspect", "--json", str(patch), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["elements"] == study["numel"]
        assert info["changed"] > 0
        assert info["changed_fraction"] == pytest.approx(fraction, rel=1e-5)
        assert info["encoded_bytes"] == nbytes
        assert info["served_bytes"] == study["full_bytes"]

"""simulations/build.py without the compiler: the copy it makes and the date of its stamp (make's
freshness check; tests/system/test_native_build.py covers the compiled build itself)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from patchswarm.simulations import build


def test_the_stamp_is_dated_when_the_copy_began(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source edited while mypyc runs must be newer than the stamp, or make calls the stale copy current."""
    edited_during: list[float] = []

    def fake_mypyc(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert Path(kwargs["cwd"], "patchswarm", "protocol", "scheduler.py").exists()  # the copy is there to compile
        time.sleep(0.05)
        edited_during.append(time.time())  # what an editor's save would be dated
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", fake_mypyc)
    dest = tmp_path / "native"
    (dest / "stale").mkdir(parents=True)  # a file from an older build must go
    before = time.time()
    build.build(dest)
    stamp = os.stat(dest / ".built").st_mtime
    assert before - 1 <= stamp < edited_during[0]
    assert not (dest / "stale").exists()
    assert sorted(p.name for p in dest.iterdir()) == [".built", "patchswarm"]  # the package, as installed
    assert sorted(p.name for p in (dest / "patchswarm").iterdir()) == sorted([*build.PACKAGES, "__init__.py"])

"""protocol/files.write_atomic: the one way patchswarm writes a file others read, whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patchswarm.protocol.files import write_atomic


def test_data_replaces_the_file_whole_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    write_atomic(target, b"old")
    write_atomic(target, memoryview(b"new bytes"), mode=0o600)
    assert target.read_bytes() == b"new bytes"
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]  # no temporary left behind


def test_a_failing_fill_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    write_atomic(target, b"the old model")

    def fill(tmp: str) -> None:
        Path(tmp).write_bytes(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(target, fill=fill)
    assert target.read_bytes() == b"the old model"
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_fill_writes_through_its_path(tmp_path: Path) -> None:
    target = tmp_path / "out"
    write_atomic(target, fill=lambda tmp: Path(tmp).write_bytes(b"filled"))
    assert target.read_bytes() == b"filled"


def test_data_or_fill_exactly_one(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x")
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x", b"a", fill=lambda tmp: None)

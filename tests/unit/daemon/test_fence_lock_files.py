"""The readers' lock file (daemon/fence_lock.py) as another local user or a broken operator leaves it in
/dev/shm: a FIFO (whose plain open would hang), a directory, a file another user made first (a root daemon
would chmod it and leave it theirs).  Each is one StoreError line naming the file; nothing hangs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patchswarm.daemon.fence_lock import ReadGate, WriteGate
from patchswarm.daemon.store_format import StoreError


def test_a_fifo_at_the_locks_name_is_refused_without_hanging(tmp_path: Path) -> None:
    path = tmp_path / "store.readers"
    os.mkfifo(path, 0o666)
    with pytest.raises(StoreError, match="not a regular file"):
        ReadGate.open(path)
    with pytest.raises(StoreError, match="not a regular file"):
        WriteGate(path)


def test_a_directory_at_the_locks_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.readers"
    path.mkdir()
    with pytest.raises(StoreError, match="readers' lock"):
        WriteGate(path)
    with pytest.raises(StoreError, match="not a regular file"):
        ReadGate.open(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_lock_another_user_made_first_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.readers"
    path.touch()
    os.chmod(path, 0o666)
    os.chown(path, 54321, 54321)
    with pytest.raises(StoreError, match="belongs to uid 54321") as err:
        WriteGate(path)
    assert "\n" not in str(err.value)
    assert path.stat().st_uid == 54321 and path.stat().st_mode & 0o777 == 0o666  # nothing changed


def test_the_daemons_own_lock_is_taken(tmp_path: Path) -> None:
    gate = WriteGate(tmp_path / "store.readers")
    try:
        reader = ReadGate.open(tmp_path / "store.readers")
        assert reader is not None
        reader.close()
    finally:
        gate.close()

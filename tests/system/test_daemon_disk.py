"""A full data directory: refused at start-up with a clear error; during activation, the journal
write fails before memory is touched, the engine keeps the old version, and the daemon catches up
once there is room again."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from patchswarm.daemon.engine import attach
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import Swarm


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root and tmpfs mounts to make a small disk")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.asyncio
async def test_full_data_dir(tmp_path: Path, tiny_fs: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk completely
        while True:
            os.write(fd, b"\0" * 1024)
    except OSError:
        pass
    finally:
        os.close(fd)
    d = make_daemon(sw, "disk", tmp_path, data_dir=f'"{tiny_fs / "data"}"')
    try:
        d.start()
        assert d.proc is not None
        assert d.proc.wait(60) == 1
        assert "data.dir" in d.log.read_text() and "full" in d.log.read_text()
        filler.unlink()
        d.start()
        await d.wait_version(1)
        view = attach((await d.get("/v1/layout"))["attach"])
        v = sw.publish(scale=2e-3)  # a big change: its journal does not fit in 16 KiB
        for _ in range(600):
            st = await d.status()
            if (st is not None and st["state"] == "error") or (st and st["reason"]):
                break
            await asyncio.sleep(0.1)
        assert st is not None and "space" in (st["reason"] or "").lower(), st
        assert view.read_version() == (1, sw.served[1].root())  # the engine still serves version 1, intact
        subprocess.run(["mount", "-o", "remount,size=16m", str(tiny_fs)], check=True)
        await d.wait_version(v)
        assert view.read_version() == (v, sw.served[v].root())
        view.close()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()

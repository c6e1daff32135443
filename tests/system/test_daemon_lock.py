"""One daemon per data directory, API socket and store: a second daemon started with the same
config, or a copy that shares only the socket or only the store, exits non-zero with one line
naming what is taken (and the running daemon's pid where known), and touches nothing of the first
(its API socket still answers, its store still holds the same verified version)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from patchswarm.daemon.api import SocketInUseError, make_api_app, serve_unix
from patchswarm.daemon.engine import attach
from patchswarm.daemon.instance_lock import InstanceLock, InstanceLockedError
from patchswarm.daemon.status import Status
from tests.support.daemonkit import ROOT, Daemon, make_daemon
from tests.support.swarmkit import Swarm


@pytest.mark.asyncio
async def test_second_daemon_on_the_same_data_dir_leaves_the_first_alone(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "host", tmp_path)
    try:
        d.start()
        before = await d.wait_version(1)
        assert d.proc is not None
        view = attach((await d.get("/v1/layout"))["attach"])
        socket_inode = os.stat(d.socket).st_ino
        second = subprocess.run(
            [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(d.config)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ),
        )  # fmt: skip
        assert second.returncode != 0
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        data_dir = str(d.dir / "data")
        assert data_dir in lines[0] and f"pid {d.proc.pid}" in lines[0], lines[0]
        # The first one is untouched: same socket file, still answering, same version in its store.
        assert d.alive and os.stat(d.socket).st_ino == socket_inode
        after = await d.status()
        assert after is not None and (after["version"], after["root"], after["state"]) == (
            before["version"], before["root"], "idle",
        )  # fmt: skip
        assert view.read_version() == (1, sw.served[1].root())
        v2 = sw.publish()  # and it goes on following the run
        await d.wait_version(v2)
        assert view.read_version() == (v2, sw.served[v2].root())
        view.close()
        assert await d.stop() == 0
        # Stopped (or killed), it holds nothing: the next daemon on the data dir starts.
        d.start()
        await d.wait_version(v2)
    finally:
        d.cleanup()
        await sw.close()


def test_lock_is_released_on_close_and_names_its_holder(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path / "data")
    first.acquire()
    with pytest.raises(InstanceLockedError, match=rf"{tmp_path / 'data'}.*pid {os.getpid()}"):
        InstanceLock(tmp_path / "data").acquire()
    first.release()
    again = InstanceLock(tmp_path / "data")
    again.acquire()
    again.release()


def run_second(config: Path) -> tuple[int, list[str], str]:
    """A second daemon, run to its end: (exit code, its error lines (not its JSON log records), its stderr)."""
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip() and line[0] != "{"], r.stderr


async def assert_untouched(d: Daemon, before: dict[str, object], socket_inode: int) -> None:
    assert d.alive and os.stat(d.socket).st_ino == socket_inode
    after = await d.status()
    assert after is not None and (after["version"], after["root"], after["state"]) == (
        before["version"], before["root"], "idle",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_copied_config_sharing_the_socket_or_the_store_is_refused(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "host", tmp_path)
    try:
        d.start()
        before = await d.wait_version(1)
        assert d.proc is not None
        view = attach((await d.get("/v1/layout"))["attach"])
        socket_inode = os.stat(d.socket).st_ino
        # Its own data.dir and store, the first one's socket: refused, naming api.socket.
        same_socket = make_daemon(sw, "copy-socket", tmp_path, socket=f'"{d.socket}"')
        rc, lines, err = run_second(same_socket.config)
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert "api.socket" in lines[0] and d.socket in lines[0], lines[0]
        await assert_untouched(d, before, socket_inode)  # the socket survives the second one's exit
        # Its own data.dir and socket, the first one's store: refused, naming store.name and the holder.
        same_store = make_daemon(sw, "copy-store", tmp_path)
        same_store.config.write_text(same_store.config.read_text().replace(same_store.store, d.store))
        rc, lines, err = run_second(same_store.config)
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert "store.name" in lines[0] and d.store in lines[0] and f"pid {d.proc.pid}" in lines[0], lines[0]
        assert not os.path.exists(same_store.socket)  # refused before it served anything
        await assert_untouched(d, before, socket_inode)
        assert view.read_version() == (1, sw.served[1].root())  # the store was not written
        v2 = sw.publish()  # and the first goes on following the run
        await d.wait_version(v2)
        assert view.read_version() == (v2, sw.served[v2].root())
        view.close()
        assert await d.stop() == 0
        # Stopped, it holds nothing: its stale socket is replaced and the store is free for the next one.
        d.start()
        await d.wait_version(v2)
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.asyncio
async def test_a_daemon_stopping_leaves_a_socket_it_did_not_bind(tmp_path: Path) -> None:
    """A removed socket re-bound by another daemon is that daemon's: the first, stopping, keeps off it."""
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    first = make_daemon(sw, "first", tmp_path)
    second = make_daemon(sw, "second", tmp_path, socket=f'"{first.socket}"')
    second.socket = first.socket
    try:
        first.start()
        await first.wait_version(1)
        os.unlink(first.socket)  # (say, an operator's cleanup)
        second.start()
        await second.wait_version(1)  # (its socket is at the same path)
        inode = os.stat(second.socket).st_ino
        assert await first.stop() == 0
        assert os.stat(second.socket).st_ino == inode
        st = await second.status()
        assert st is not None and st["node"] == "second", st
        assert await second.stop() == 0
        assert not os.path.exists(second.socket)  # its own socket it does remove
    finally:
        first.cleanup()
        second.cleanup()
        await sw.close()


def api_app() -> aiohttp.web.Application:
    return make_api_app(Status("host", "run"), lambda: None, lambda: b"")


async def answers(path: Path) -> bool:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path))) as s,
        s.get("http://d/v1/status", timeout=aiohttp.ClientTimeout(total=10)) as r,
    ):
        return r.status == 200


@pytest.mark.asyncio
async def test_only_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening: what a killed daemon leaves (connection refused)
    dead.close()
    runner = await serve_unix(api_app(), path)
    try:
        assert await answers(path)
        inode = os.stat(path).st_ino
        with pytest.raises(SocketInUseError, match=rf"api.socket: {path} is in use"):
            await serve_unix(api_app(), path)
        assert os.stat(path).st_ino == inode and await answers(path)
    finally:
        await runner.cleanup()
    other = tmp_path / "notes.txt"  # api.socket pointed at a file by mistake: kept
    other.write_text("keep")
    with pytest.raises(SocketInUseError, match="not a socket"):
        await serve_unix(api_app(), other)
    assert other.read_text() == "keep"

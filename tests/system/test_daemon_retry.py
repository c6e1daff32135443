"""Transient activation failures, through real daemon processes: the journal directory briefly
unwritable, the process out of file descriptors (EMFILE), a store too small for the model.

While the cause lasts the daemon reports it in its status, retries with bounded backoff and keeps
the engine on the version it serves; once the cause is gone it reaches the head by itself, without
a restart.  Throughout, a peer asking the daemon for a manifest gets one that verifies, or a 404:
never an empty or malformed one (a retried catch-up used to cache an empty manifest and serve it).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import blake3
import pytest

from patchswarm.daemon.engine import attach
from patchswarm.protocol.board_names import HEAD_TAG, head_rel, manifest_rel
from patchswarm.protocol.head import Head
from patchswarm.protocol.manifest import SignedManifest
from patchswarm.protocol.signed import Envelope
from tests.support.boards import free_port
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.faultkit import wait_status
from tests.support.swarmkit import RUN, Swarm


class ManifestWatch:
    """A peer asking the daemon for every manifest the board's head names, again and again."""

    def __init__(self, sw: Swarm, port: int) -> None:
        self.sw, self.url = sw, f"http://127.0.0.1:{port}/swarm/v1/board/"
        self.bad: list[str] = []
        self.served = 0  # answers that verified

    def manifests(self) -> list[str]:
        data = self.sw.board.read(head_rel(RUN))
        if data is None:
            return []
        head = Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)
        return [manifest_rel(e.manifest_id) for e in head.catalog]

    async def check_once(self, s: aiohttp.ClientSession) -> None:
        for rel in self.manifests():
            try:
                async with s.get(self.url + rel, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    status, body = r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError):
                continue  # (EMFILE: the daemon cannot accept; not an answer)
            if status == 404:
                continue
            try:
                signed = SignedManifest.from_bytes(body)
                assert status == 200 and blake3.blake3(signed.body).hexdigest() == rel.removeprefix("manifests/")
                self.served += 1
            except Exception as e:  # anything else served is the defect
                self.bad.append(f"{rel}: HTTP {status}, {len(body)} bytes: {e}")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ManifestWatch]:
        async def loop() -> None:
            async with aiohttp.ClientSession() as s:
                while True:
                    await self.check_once(s)
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert not self.bad, self.bad[:5]


def retries_logged(d: Daemon, cause: str = "") -> int:
    return sum(1 for line in d.log.read_text().splitlines() if "catch-up failed" in line and cause in line)


async def until_logged(d: Daemon, cause: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while retries_logged(d, cause) < count:
        assert time.monotonic() < deadline, d.log.read_text()[-3000:]
        await asyncio.sleep(0.1)


async def daemon_at_v1(sw: Swarm, tmp: Path, **overrides: str) -> tuple[Daemon, int]:
    sw.publish()
    await sw.start_seed()
    port = free_port()
    d = make_daemon(sw, "host", tmp, listen=f'"127.0.0.1:{port}"', **overrides)
    d.start()
    return d, port


@pytest.mark.asyncio
async def test_journal_directory_briefly_unwritable(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    d, port = await daemon_at_v1(sw, tmp_path)
    try:
        await d.wait_version(1)
        view = attach((await d.get("/v1/layout"))["attach"])
        journal = d.dir / "data" / "journal"
        async with ManifestWatch(sw, port).running() as watch:
            # Unwritable even for root: the journal's path is briefly a file, not a directory.
            journal.rename(journal.with_name("journal.away"))
            journal.write_bytes(b"")
            v2 = sw.publish()
            st = await wait_status(d, lambda s: s["state"] == "error" and "journal" in (s["reason"] or ""))
            assert st["version"] == 1 and st["target"] == v2
            await until_logged(d, "activation journal", 3)  # retried, failing for the same cause
            st = await wait_status(d, lambda s: "retrying: " in (s["reason"] or ""))  # and it says so
            assert st["state"] == "error" and "activation journal" in st["reason"], st
            assert view.read_version() == (1, sw.served[1].root())  # the engine still serves version 1
            journal.unlink()
            journal.with_name("journal.away").rename(journal)
            await d.wait_version(v2)  # by itself: no restart
            assert view.read_version() == (v2, sw.served[v2].root())
            v3 = sw.publish()  # and it goes on following the run
            await d.wait_version(v3)
            async with aiohttp.ClientSession() as s:
                await watch.check_once(s)
        assert watch.served > 0
        view.close()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


def prlimit_nofile(pid: int, soft: int) -> None:
    """Set the soft limit only (the hard one stays: raising it back needs no privilege)."""
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={soft}:"], check=True)


@pytest.mark.asyncio
async def test_out_of_file_descriptors(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    d, port = await daemon_at_v1(sw, tmp_path)
    try:
        await d.wait_version(1)
        assert d.proc is not None
        view = attach((await d.get("/v1/layout"))["attach"])
        async with ManifestWatch(sw, port).running() as watch:
            # Below what it holds: every new descriptor is EMFILE (its pooled connections still fetch).
            prlimit_nofile(d.proc.pid, 8)
            v2 = sw.publish()
            await until_logged(d, "Too many open files", 2)  # (its API cannot accept either: read the log)
            assert view.read_version() == (1, sw.served[1].root())
            prlimit_nofile(d.proc.pid, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            await d.wait_version(v2)  # by itself: no restart
            assert view.read_version() == (v2, sw.served[v2].root())
        assert watch.served > 0
        view.close()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.asyncio
async def test_store_too_small(tmp_path: Path) -> None:
    """A host store's size is configuration (store.size), so the cause goes with a restart; an engine's
    too-small buffer is refused at registration and a right one loads (test_daemon_engine_store)."""
    sw = Swarm(tmp_path)
    d, port = await daemon_at_v1(sw, tmp_path, store_size="65536")
    try:
        async with ManifestWatch(sw, port).running() as watch:
            st = await wait_status(d, lambda s: s["state"] == "error" and "store.size" in (s["reason"] or ""))
            assert st["version"] is None and st["target"] == 1
            await until_logged(d, "the model needs", 2)  # retried, with backoff; the daemon keeps answering
            assert (await d.status()) is not None
            assert await d.stop() == 0
            d.config.write_text(d.config.read_text().replace("size = 65536", "size = 0"))
            d.start()
            await d.wait_version(1)
            view = attach((await d.get("/v1/layout"))["attach"])
            assert view.read_version() == (1, sw.served[1].root())
            view.close()
        assert watch.served > 0
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()

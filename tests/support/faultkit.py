"""Fault injection for tests and benchmarks on loopback: a real seed process that can be stopped
and restarted on its address, daemons with their own environment (fault point, rate limits,
faked clock), TCP proxies that partition the fleet into regions, and the engine-side checks
(fence + contents) that prove nothing torn or unverified is ever visible."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3

from patchswarm.daemon.engine import EngineView
from patchswarm.protocol.served import ServedModel, state_root
from tests.support.boards import free_port
from tests.support.daemonkit import ROOT, Daemon, make_daemon
from tests.support.swarmkit import RUN, SECRET, Swarm

FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


# ---------------------------------------------------------------- processes


class SeedProc:
    """``patchswarm seed --run`` as a process on a fixed port, so a restart keeps its address."""

    def __init__(self, sw: Swarm, tmp: Path, advertise: str | None = None, board: Path | None = None) -> None:
        self.board = board or sw.board.root
        self.tmp = tmp
        self.port = free_port()
        self.advertise = advertise
        self.log = tmp / "seed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        (tmp / "secret").write_bytes(SECRET)

    @property
    def url(self) -> str:
        return self.advertise or f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        args = ["seed", "--board", str(self.board), "--listen", f"127.0.0.1:{self.port}", "--name", "seed"]
        args += ["--run", RUN, "--secret-file", str(self.tmp / "secret")]
        if self.advertise:
            args += ["--advertise", self.advertise]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=ROOT, stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout
        while '"listening"' not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"seed did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.log.write_text("")  # the next start waits for its own "listening" line

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@dataclass
class EnvDaemon(Daemon):
    """A fleet daemon: a fixed listen port, and the port peers reach it on behind a Partition proxy."""

    listen_port: int = 0
    proxy_port: int = 0  # where peers reach it when it runs behind a Partition proxy (0: none)


def fleet_daemon(
    sw: Swarm, seed_url: str, name: str, tmp: Path, *, proxied: bool = False, env: dict[str, str] | None = None
) -> EnvDaemon:
    """A daemon of a fleet whose seed is ``seed_url`` (a process or a proxy in front of one).

    ``proxied``: the daemon listens on a fixed port and advertises a proxy's port instead (see
    :class:`Partition`); the proxy's port is in ``env["PATCHSWARM_NODE_ADVERTISE"]``.
    """
    shim = SimpleNamespace(seed=SimpleNamespace(url=seed_url), root=sw.root)
    listen = free_port() if proxied else 0
    base = make_daemon(shim, name, tmp, listen=f'"127.0.0.1:{listen}"')  # type: ignore[arg-type]
    d = EnvDaemon(base.name, base.dir, base.config, base.store, base.socket, env=dict(env or {}), listen_port=listen)
    if proxied:
        d.proxy_port = free_port()
        d.env["PATCHSWARM_NODE_ADVERTISE"] = f"http://127.0.0.1:{d.proxy_port}"
    return d


async def wait_all(daemons: Iterable[Daemon], version: int, timeout: float = 90) -> None:
    await asyncio.gather(*(d.wait_version(version, timeout) for d in daemons))


async def wait_status(d: Daemon, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = await d.status()
        if st is not None and pred(st):
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"{d.name}: status never matched: {st}; log: {d.log.read_text()[-2000:]}")


# ---------------------------------------------------------------- engine-side checks


def contents_root(view: EngineView) -> bytes:
    """The state root of the bytes the engine would read now (whatever the fence says)."""
    digests = [
        blake3.blake3(view.data[s.offset : s.offset + s.nbytes].numpy().data).digest() for s in view.layout.slots
    ]
    return state_root([s.spec for s in view.layout.slots], digests)


def engine_sees(view: EngineView, served: dict[int, ServedModel], stable_within: float = 2.0) -> int | None:
    """What an engine reading now would be told it serves, checked: a stable fence whose version is a
    published one, whose root is that version's, and whose bytes hash to that root.  None: no
    version is exposed (mid-write or empty), which an engine must treat as "do not attribute".
    A fence left odd by a daemon killed mid-write stays odd until the next start: after
    ``stable_within`` seconds that is "mid-write" too (never an endless wait)."""
    for _ in range(1000):
        try:
            obs = view.fence.consistent(lambda: contents_root(view), timeout=stable_within)
        except TimeoutError:
            return None
        if obs.changed:
            continue  # the daemon wrote meanwhile: read again
        if obs.version is None:
            return None
        expected = served.get(obs.version)
        assert expected is not None, f"the fence shows version {obs.version}, which was never published"
        assert obs.root == expected.root(), f"the fence root of version {obs.version} is not the published one"
        assert obs.value == obs.root, f"torn: the bytes under version {obs.version} do not hash to its root"
        return obs.version
    raise AssertionError("the fence never stayed stable for one read")


class FenceWatcher(threading.Thread):
    """An engine reading the store the whole time: every stable observation must be a published
    version with matching contents, and the version never goes below one already served."""

    def __init__(self, view: EngineView, served: dict[int, ServedModel]) -> None:
        super().__init__(daemon=True)
        self.view, self.served = view, served
        self.halt = threading.Event()
        self.observations = 0
        self.seen: set[int] = set()
        self.errors: list[str] = []
        self.highest = 0

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                v = engine_sees(self.view, self.served)
            except AssertionError as e:
                self.errors.append(str(e))
                continue
            if v is None:
                continue
            self.observations += 1
            if v < self.highest:
                self.errors.append(f"version went back from {self.highest} to {v}")
            self.highest = max(self.highest, v)
            self.seen.add(v)
            time.sleep(0.002)  # leave the CPU to the daemons

    def finish(self) -> None:
        self.halt.set()
        self.join(30)
        assert not self.errors, self.errors[:5]


# ---------------------------------------------------------------- partitions


def _socket_inode(local_port: int, remote_port: int) -> str | None:
    """The inode of the loopback TCP socket local_port -> remote_port (from /proc/net/tcp)."""
    with contextlib.suppress(OSError), open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            lp, rp = int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16)
            if lp == local_port and rp == remote_port:
                return parts[9]
    return None


def _owner(inode: str, pids: Iterable[int]) -> int | None:
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
    return None


class Partition:
    """Regions of a loopback fleet, enforced by one TCP proxy in front of every node.

    Every node advertises its proxy, so all peer traffic crosses one.  A proxy finds which
    process opened each incoming connection (/proc, as ``ss -p`` does) and, while the fleet is
    split, refuses and cuts connections between processes of different regions, in both
    directions: a node of region A can neither reach nor be reached from region B.
    """

    def __init__(self) -> None:
        self.region_of_pid: dict[int, str] = {}
        self.split = False
        self.proxies: list[TcpProxy] = []
        self.refused = 0

    def place(self, pid: int, region: str) -> None:
        self.region_of_pid[pid] = region

    def allowed(self, src: str | None, dst: str) -> bool:
        return not self.split or src == dst

    def cut(self) -> None:
        self.split = True
        for p in self.proxies:
            p.enforce()

    def heal(self) -> None:
        self.split = False

    async def proxy(self, listen_port: int, target_port: int, region: str) -> TcpProxy:
        p = TcpProxy(self, listen_port, target_port, region)
        await p.start()
        self.proxies.append(p)
        return p

    async def close(self) -> None:
        for p in self.proxies:
            await p.close()


class TcpProxy:
    def __init__(self, partition: Partition, listen_port: int, target_port: int, region: str) -> None:
        self.partition = partition
        self.listen_port, self.target_port, self.region = listen_port, target_port, region
        self.server: asyncio.Server | None = None
        self.links: dict[asyncio.StreamWriter, tuple[str | None, asyncio.StreamWriter]] = {}

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)

    def _source_region(self, peer_port: int) -> str | None:
        inode = _socket_inode(peer_port, self.listen_port)
        pid = _owner(inode, list(self.partition.region_of_pid)) if inode else None
        return None if pid is None else self.partition.region_of_pid[pid]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = self._source_region(writer.get_extra_info("peername")[1])
        if not self.partition.allowed(src, self.region):
            self.partition.refused += 1
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.links[writer] = (src, up_w)
        try:
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))
        finally:
            self.links.pop(writer, None)
            for w in (writer, up_w):
                w.close()

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            w.close()

    def enforce(self) -> None:
        """Cut the connections the partition no longer allows (kept-alive ones included)."""
        for down, (src, up) in list(self.links.items()):
            if not self.partition.allowed(src, self.region):
                down.close()
                up.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for down, (_src, up) in list(self.links.items()):
                down.close()
                up.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


# ---------------------------------------------------------------- clocks


def faketime_lib() -> str | None:
    found = [p for p in FAKETIME_LIBS if Path(p).exists()]
    return found[0] if found else None


class SkewedClock:
    """libfaketime on one daemon, with an offset that can change while it runs (a file it rereads).

    Only the wall clock moves (expiry checks read it); monotonic timers stay real."""

    def __init__(self, tmp: Path) -> None:
        lib = faketime_lib()
        if lib is None or shutil.which("faketime") is None:
            import pytest

            pytest.skip("libfaketime is not installed (apt-get install faketime; `make system-deps` should add it)")
        self.file = tmp / "faketime-offset"
        self.set(0)
        self.env = {
            "LD_PRELOAD": lib,
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def set(self, seconds: int) -> None:
        self.file.write_text(f"{seconds:+d}\n")


# ---------------------------------------------------------------- the crash loop


ACTIVATION_POINTS = ("journaled", "odd", "mid_write", "written", "flipped")  # daemon/weightstore.py
PHASES = ("fetching", "staging", "activating", "random")


@dataclass
class CrashReport:
    kills: dict[str, int] = field(default_factory=dict)  # where each kill landed
    recoveries: dict[str, int] = field(default_factory=dict)  # how each restart found the store
    violations: list[str] = field(default_factory=list)
    engine_reads: int = 0
    versions_served: list[int] = field(default_factory=list)

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class CrashLoop:
    """kill -9 of one rollout daemon, again and again, at points spread over every phase of taking a
    version (fetching, staging, each step of activating, and at random times including start-up
    and recovery), while a new version is published for each kill and an engine reads the store.

    After each kill and restart: the store is re-verified by the daemon (its recovery), the version
    the engine is shown is a published one whose bytes hash to its root, and it never goes back
    below a version the engine already served.  Violations are collected, not raised, so the
    benchmark can count them; the test asserts there are none.
    """

    def __init__(self, sw: Swarm, tmp: Path, seed: int, fetch_rate: str = "150KB") -> None:
        import random

        self.sw, self.tmp, self.rng = sw, tmp, random.Random(seed)
        self.fetch_rate = fetch_rate
        self.report = CrashReport()
        self.daemon: EnvDaemon | None = None
        self.view: EngineView | None = None
        self.watcher: FenceWatcher | None = None

    async def __aenter__(self) -> CrashLoop:
        from patchswarm.daemon.engine import attach

        self.sw.publish()
        seed = await self.sw.start_seed()
        self.daemon = fleet_daemon(self.sw, seed.url, "crashy", self.tmp)
        self.daemon.start()
        await self.daemon.wait_version(1)
        self.view = attach((await self.daemon.get("/v1/layout"))["attach"])
        self.watcher = FenceWatcher(self.view, self.sw.served)
        self.watcher.start()
        assert await self.daemon.stop() == 0  # each kill_once starts it
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.watcher is not None:
            self.watcher.halt.set()
            self.watcher.join(30)
        if self.view is not None:
            self.view.close()
        if self.daemon is not None:
            self.daemon.cleanup()
        await self.sw.close()

    async def _await_exit(self, timeout: float = 90) -> int | None:
        d = self.daemon
        assert d is not None and d.proc is not None
        deadline = time.monotonic() + timeout
        while d.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return d.proc.poll()

    async def _check_restart(self) -> None:
        """The restarted daemon's first answer: what recovery left must be a whole, published version."""
        d, view, served = self.daemon, self.view, self.sw.served
        assert d is not None and view is not None and self.watcher is not None
        before = self.watcher.highest
        deadline = time.monotonic() + 60
        st = None
        while st is None and d.alive and time.monotonic() < deadline:
            st = await d.status()
            await asyncio.sleep(0.02)
        if st is None:
            return  # killed (the "random" phase) or crashed by its fault point before the API came up
        try:
            seen = engine_sees(view, served)
        except AssertionError as e:
            self.report.violations.append(f"after restart: {e}")
            return
        if seen is not None and seen < before:
            self.report.violations.append(f"after restart the engine is shown {seen}, it already served {before}")
        if st["version"] is not None and st["state"] != "error" and st["version"] not in served:
            self.report.violations.append(f"the daemon reports version {st['version']}, never published")

    async def kill_once(self, phase: str) -> str:
        """One kill in ``phase``; returns where it landed (e.g. "activating:odd", "fetching")."""
        d = self.daemon
        assert d is not None
        if phase in ("staging", "activating"):
            point = "staging" if phase == "staging" else self.rng.choice(ACTIVATION_POINTS)
            d.start(PATCHSWARM_FAULT_AT=point)
            self.sw.publish(scale=3e-4)
            await self._check_restart()
            rc = await self._await_exit()
            if rc != -signal.SIGKILL:
                self.report.violations.append(f"no crash at {point} (rc {rc}): {d.log.read_text()[-1500:]}")
                if rc is None:
                    d.kill()
            where = point if phase == "staging" else f"activating:{point}"
        else:
            d.start(PATCHSWARM_SWARM_DOWNLOAD_RATE=self.fetch_rate)
            self.sw.publish(scale=3e-4)
            if phase == "fetching":
                await self._check_restart()
                last = await wait_status(d, lambda s: s["state"] == "fetching", timeout=90)
                await asyncio.sleep(self.rng.uniform(0, 0.15))
            else:
                # Anywhere from process start (recovery included) to the version landing: half of
                # these during start-up, half once the API answers.
                last = None
                if self.rng.random() < 0.5:
                    await self._check_restart()
                    last = await d.status()
                stop_at = time.monotonic() + self.rng.uniform(0.2, 2.0)
                while time.monotonic() < stop_at and d.alive:
                    last = await d.status() or last
                    await asyncio.sleep(0.02)
            now = await d.status() if d.alive else None
            d.kill()
            state = (now or last or {"state": "starting"})["state"]
            where = state if phase == "fetching" else f"random:{state}"
        self.report.count(self.report.kills, where)
        self._count_recoveries()
        return where

    def _count_recoveries(self) -> None:
        """Read how the last start found the store, from its JSON log ("store re-attached ... (action)")."""
        assert self.daemon is not None
        lines = self.daemon.log.read_text().splitlines()
        self.daemon.log.write_text("")
        for line in lines:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                msg = json.loads(line)["msg"]
                if msg.startswith("store re-attached"):
                    self.report.count(self.report.recoveries, msg.rsplit("(", 1)[-1].rstrip(")"))
                elif msg.startswith(("store recovery failed", "store contents do not verify")):
                    # Safe (the engine is shown no version until a full reload) but a crash must not
                    # leave a store its journal cannot restore: count it as a violation.
                    self.report.count(self.report.recoveries, "failed verification: reloaded")
                    self.report.violations.append(f"after a kill the store did not recover: {msg}")

    async def finish(self) -> int:
        """Start clean and converge to the head; the engine must see it, bitwise."""
        d, view = self.daemon, self.view
        assert d is not None and view is not None and self.watcher is not None
        d.start()
        await self._check_restart()
        head = max(self.sw.served)
        await d.wait_version(head, timeout=120)
        self._count_recoveries()
        if engine_sees(view, self.sw.served) != head:
            self.report.violations.append("the engine does not see the head after convergence")
        self.watcher.halt.set()
        self.watcher.join(30)
        self.report.violations += self.watcher.errors
        self.report.engine_reads = self.watcher.observations
        self.report.versions_served = sorted(self.watcher.seen)
        if await d.stop() != 0:
            self.report.violations.append("the daemon did not stop cleanly after convergence")
        return head

"""Rollout daemons as real processes for tests: config files, start/stop, API queries."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.swarmkit import RUN, SECRET, Swarm

ROOT = Path(__file__).parents[2]


@dataclass
class Daemon:
    name: str
    dir: Path
    config: Path
    store: str
    socket: str
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.dir / "daemon.log"

    def start(self, **extra_env: str) -> None:
        """Start the process; ``extra_env`` (and ``env``) add to this process's environment (config
        overrides, PATCHSWARM_FAULT_AT, faketime)."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(self.config)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **extra_env},
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    async def stop(self) -> int:
        """SIGTERM and wait, off the event loop: the test's own in-process nodes (the seed) must
        keep answering, or the daemon's goodbye to them waits out its timeout."""
        return await asyncio.to_thread(self.terminate)

    async def status(self) -> dict[str, Any] | None:
        try:
            async with (
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket)) as s,
                s.get("http://d/v1/status", timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                data: dict[str, Any] = await r.json()
                return data
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def get(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket)) as s,
            s.get(f"http://d{path}", timeout=aiohttp.ClientTimeout(total=30)) as r,
        ):
            return await r.json()

    async def wait_version(self, version: int, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.status()
            if st is not None and st["version"] == version and st["state"] == "idle":
                return st
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not at version {version}: {st}; log: {self.log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)

    def cleanup(self) -> None:
        """End of a test: kill the process if it still runs, remove its shared memory."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        self.destroy_store()

    def destroy_store(self) -> None:
        from patchswarm.daemon.store_format import StoreError
        from patchswarm.daemon.weightstore import WeightStore

        try:
            WeightStore.open(self.store).destroy()
        except (StoreError, OSError):
            pass
        with contextlib.suppress(OSError):  # the daemon's store lock (no daemon holds it any more)
            os.unlink(f"/dev/shm/{self.store}.lock")


def make_daemon(sw: Swarm, name: str, tmp: Path, extra: str = "", **overrides: str) -> Daemon:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    (tmp / "secret").write_bytes(SECRET)
    if not (tmp / "root.key.pub").exists():
        sw.root.save(tmp / "root.key")
    assert sw.seed is not None
    store = f"ps-test-{uuid.uuid4().hex[:12]}"
    sock = str(d / "api.sock")
    values = {
        "listen": '"127.0.0.1:0"',
        "store_size": "0",
        "data_dir": f'"{d / "data"}"',
        "socket": f'"{sock}"',
    } | overrides
    text = f"""
[node]
name = "{name}"
listen = {values["listen"]}
[swarm]
run_id = "{RUN}"
bootstrap = ["{sw.seed.url}"]
seed_urls = ["{sw.seed.url}"]
cluster_secret_file = "{tmp / "secret"}"
[trust]
root = "{tmp / "root.key.pub"}"
[store]
name = "{store}"
size = {values["store_size"]}
[api]
socket = {values["socket"]}
[data]
dir = {values["data_dir"]}
[log]
format = "json"
{extra}
"""
    cfg = d / "daemon.toml"
    cfg.write_text(text)
    return Daemon(name, d, cfg, store, sock)


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")

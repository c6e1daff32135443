"""Engine-allocated weight stores end to end: a real daemon process (store.kind engine-shm, or cuda)
and the reference engine process that allocates the buffer and registers it (POST /v1/store).

The engine's buffer is its own memory: the daemon loads and patches it in place inside the fence,
the engine sees each version without reloading, and a kill -9 of the daemon mid-activation leaves
the engine serving; the restarted daemon re-imports the buffer, finishes the activation and
re-verifies, and no reader ever sees a torn version.  The CUDA variants run where CUDA is present.

Daemons are stopped from a worker thread (``asyncio.to_thread(d.terminate)``): the seed runs on
this test's event loop, and a daemon's graceful exit says goodbye to it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.cuda_ipc import allocate_own_segment
from patchswarm.daemon.engine import EngineView, SharedSegment, allocate, attach, export_buffer
from patchswarm.daemon.engine_client import DaemonClient
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.rollout import AWAITING_ENGINE, FAULT_ENV
from patchswarm.daemon.status import Status
from patchswarm.daemon.store_format import StoreError
from patchswarm.daemon.trajectory import generate
from patchswarm.protocol.served import ServedModel, bytes_digest, state_root
from patchswarm.protocol.trust import Certificate
from tests.support.boards import free_port
from tests.support.daemonkit import ROOT, Daemon, make_daemon
from tests.support.openapi import check
from tests.support.store_worker import remove_segments
from tests.support.swarmkit import RUN, Swarm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param("cpu", id="engine-shm"), pytest.param("cuda:0", id="cuda", marks=CUDA)]


def kind_of(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "engine-shm"


def engine_daemon(sw: Swarm, tmp: Path, device: str) -> Daemon:
    d = make_daemon(sw, "host", tmp)
    d.config.write_text(d.config.read_text().replace("[store]\n", f'[store]\nkind = "{kind_of(device)}"\n', 1))
    return d


class Trainer:
    """Publishes versions of the reference engine's model (daemon.trajectory 'tiny', bf16 as is)."""

    def __init__(self, sw: Swarm, steps: int) -> None:
        self.traj = generate("tiny", steps=steps)
        now = int(time.time() * 1000)
        cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
        self.pub = Publisher(sw.board, sw.trainer, run_id=RUN, served_format="as_is", certificate=cert,
                             chunk_size=16 << 10)  # fmt: skip
        self.roots: dict[int, bytes] = {}

    def publish(self) -> int:
        k = len(self.roots)
        self.pub.publish(self.traj.bf16[k])
        self.roots[self.pub.version] = ServedModel.from_tensors(self.traj.bf16[k]).root()
        return self.pub.version


class EngineProc:
    """``python -m daemon.refengine --daemon-socket ...``: allocates, registers, serves over HTTP."""

    def __init__(self, d: Daemon, device: str, tmp: Path) -> None:
        self.port = free_port()
        self.log = tmp / "engine.log"
        args = [sys.executable, "-m", "patchswarm.daemon.refengine", "--listen", f"127.0.0.1:{self.port}",
                "--daemon-socket", d.socket, "--device", device, "--engine-name", "e1", "--wait", "120"]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, f"http://127.0.0.1:{self.port}{path}", json=body, timeout=aiohttp.ClientTimeout(60)) as r,
        ):
            return r.status, await r.json()

    async def wait_version(self, version: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"engine exited: {self.log.read_text()[-3000:]}"
            try:
                code, health = await self.call("GET", "/health")
                if code == 200 and health["version"] == version:
                    return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"engine not at version {version}: {self.log.read_text()[-3000:]}"
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


class Reader(threading.Thread):
    """A second engine-side reader: every stable observation's bytes must hash to the root the fence shows."""

    def __init__(self, view: EngineView, roots: dict[int, bytes]) -> None:
        super().__init__(daemon=True)
        self.view, self.roots = view, roots
        self.stop = threading.Event()
        self.seen: set[int] = set()
        self.errors: list[str] = []

    def contents_root(self) -> bytes:
        data = self.view.data
        digests = [bytes_digest(data[s.offset : s.offset + s.nbytes]) for s in self.view.layout.slots]
        return state_root(self.view.layout.specs, digests)

    def run(self) -> None:
        while not self.stop.is_set():
            obs = self.view.fence.consistent(self.contents_root)
            if obs.changed or obs.version is None:
                continue
            if obs.value != obs.root or obs.root != self.roots.get(obs.version):
                self.errors.append(f"version {obs.version}: contents do not match the version the fence shows")
            self.seen.add(obs.version)
            time.sleep(0.01)


async def wait_status(d: Daemon, pred: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = await d.status()
        if st is not None and pred(st):
            return st
        assert d.proc is not None and d.proc.poll() is None, f"daemon exited: {d.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"daemon never {what}: {st}; {d.log.read_text()[-3000:]}"
        await asyncio.sleep(0.1)


async def post(d: Daemon, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=d.socket)) as s,
        s.post(f"http://d{path}", json=body) as r,
    ):
        return r.status, await r.json()


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("device", DEVICES)
async def test_engine_allocated_store_survives_daemon_kill_9(device: str, tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    trainer = Trainer(sw, steps=3)
    trainer.publish()
    await sw.start_seed()
    d = engine_daemon(sw, tmp_path, device)
    d.start()
    engine = reader = None
    try:
        # The daemon holds version 1 but has nowhere to load it: it says it waits for the engine.
        st = await wait_status(d, lambda s: s["target"] == 1 and s["reason"] == AWAITING_ENGINE, "waited")
        assert st["version"] is None and st["state"] == "idle"
        info = (await d.get("/v1/layout"))["attach"]
        assert info["kind"] == "engine_buffer" and info["buffer"] is None

        engine = EngineProc(d, device, tmp_path)
        await engine.wait_version(1)
        st = await d.wait_version(1)
        assert st["reason"] is None and st["root"] == trainer.roots[1].hex()
        info = (await d.get("/v1/layout"))["attach"]
        assert info["buffer"]["kind"] == ("cuda_ipc" if device != "cpu" else "shm_buffer")
        if device == "cpu":
            assert Path(f"/dev/shm/{info['buffer']['name']}").exists()  # the engine's own segment
        view = attach(info)  # this process maps the engine's buffer too
        assert view.read_version() == (1, trainer.roots[1])
        reader = Reader(view, trainer.roots)
        reader.start()

        # A new version lands in the engine's memory in place: same engine process, no reload.
        trainer.publish()
        await d.wait_version(2)
        await engine.wait_version(2)
        code, out = await engine.call("POST", "/generate", {"prompt": [2, 5, 6], "max_tokens": 3})
        assert code == 200 and out["engine_version"] == {"before": 2, "after": 2}

        # kill -9 in the middle of the next activation (fence odd, values half written).
        assert await asyncio.to_thread(d.terminate) == 0
        os.environ[FAULT_ENV] = "mid_write"
        try:
            d.start()
        finally:
            del os.environ[FAULT_ENV]
        await d.wait_version(2)
        trainer.publish()
        assert d.proc is not None
        for _ in range(1200):
            if d.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert d.proc.returncode == -9, f"daemon did not crash: {d.log.read_text()[-2000:]}"
        assert view.read_version() is None  # mid-write: nobody may report a version
        code, out = await engine.call("POST", "/generate", {"prompt": [2, 5, 6], "max_tokens": 2})
        assert code == 200 and len(out["tokens"]) == 2  # the engine kept serving (version unknown: -1)
        assert out["engine_version"]["before"] == -1

        # The restarted daemon re-imports the engine's buffer, rolls the journal forward, re-verifies.
        d.start()
        await d.wait_version(3)
        await engine.wait_version(3)
        assert "store re-attached at version 3 (rolled_forward)" in d.log.read_text()
        assert view.read_version() == (3, trainer.roots[3])
        await wait_status(d, lambda s: s["acks"].get("e1") == 3, "heard the engine acknowledge version 3")

        # A clean restart re-verifies without writing: the fence does not move, nothing is reloaded.
        seq = view.fence.seq()
        assert await asyncio.to_thread(d.terminate) == 0
        d.start()
        await d.wait_version(3)
        assert "store re-attached at version 3 (clean)" in d.log.read_text()
        assert view.fence.seq() == seq
        assert d.log.read_text().count("registered buffer") == 1
        assert engine.proc.poll() is None
        reader.stop.set()
        reader.join(30)
        assert not reader.errors, reader.errors[:5]
        assert {1, 2, 3} <= reader.seen
        view.close()
        assert await asyncio.to_thread(d.terminate) == 0
        engine.stop()
        assert engine.proc.returncode == 0
        assert not list(Path("/dev/shm").glob(f"{d.store}.buf.*"))  # the engine removed its buffer
    finally:
        if reader is not None:
            reader.stop.set()
        if engine is not None:
            engine.stop()
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("device", DEVICES)
async def test_daemon_notices_a_killed_engine_and_writes_nothing_more(device: str, tmp_path: Path) -> None:
    """kill -9 of the engine: the daemon lets its buffer go (the CPU twin's orphaned segment removed),
    reports no version and why, writes nothing more into it, and loads the next engine's buffer."""
    sw = Swarm(tmp_path)
    trainer = Trainer(sw, steps=2)
    trainer.publish()
    await sw.start_seed()
    d = engine_daemon(sw, tmp_path, device)
    d.start()
    engines: list[EngineProc] = []
    try:
        await wait_status(d, lambda s: s["reason"] == AWAITING_ENGINE, "waited")
        engines.append(EngineProc(d, device, tmp_path))
        await engines[0].wait_version(1)
        await d.wait_version(1)
        info = (await d.get("/v1/layout"))["attach"]
        pid = engines[0].proc.pid
        engines[0].proc.kill()
        engines[0].proc.wait(30)
        st = await wait_status(d, lambda s: "died" in (s["reason"] or ""), "noticed the engine died")
        assert f"the engine (pid {pid}) that registered buffer" in st["reason"] and AWAITING_ENGINE in st["reason"]
        assert st["version"] is None and st["state"] == "idle"
        assert (await d.get("/v1/layout"))["attach"]["buffer"] is None
        if device == "cpu":
            assert not Path(f"/dev/shm/{info['buffer']['name']}").exists()
        # A new version meanwhile waits in the shadow: nothing is written anywhere.
        trainer.publish()
        await wait_status(d, lambda s: s["target"] == 2 and AWAITING_ENGINE in (s["reason"] or ""), "held version 2")
        assert "died" in d.log.read_text()
        # The next engine registers a new buffer and gets the version the daemon holds.
        engines.append(EngineProc(d, device, tmp_path))
        await engines[1].wait_version(2)
        st = await d.wait_version(2)
        assert st["reason"] is None and st["root"] == trainer.roots[2].hex()
        assert await asyncio.to_thread(d.terminate) == 0
    finally:
        for e in engines:
            e.stop()
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


def fake_handle(store: str, nbytes: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "shm_buffer", "name": f"{store}.buf.fake", "nbytes": nbytes, "buffer_id": 7} | extra


@pytest.mark.asyncio
@pytest.mark.parametrize("device", DEVICES)
async def test_bad_registrations_get_a_clear_4xx_and_lose_nothing(device: str, tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    trainer = Trainer(sw, steps=1)
    trainer.publish()
    await sw.start_seed()
    d = engine_daemon(sw, tmp_path, device)
    d.start()
    keep: list[Any] = []
    try:
        await wait_status(d, lambda s: s["reason"] == AWAITING_ENGINE and s["target"] == 1, "waited")
        layout = await d.get("/v1/layout")
        info = layout["attach"]
        nbytes, lay_hash = info["nbytes"], info["layout_hash"]

        async def refused(body: Any, status: int, error: str, match: str) -> None:
            code, answer = await post(d, "/v1/store", body)
            check("/v1/store", "post", code, answer)
            assert (code, answer["error"]) == (status, error), answer
            assert re.search(match, answer["message"]), answer["message"]

        await refused({"engine": ""}, 400, "BadRequest", "engine must be")
        await refused({"engine": "e", "layout_hash": lay_hash}, 400, "BadRequest", "buffer")
        if device == "cpu":
            small = SharedSegment.create(f"{d.store}.buf.small", 4096)
            keep.append(small)
            good_kind = fake_handle(d.store, nbytes)
            await refused({"engine": "e", "layout_hash": "00" * 32, "buffer": good_kind}, 422, "LayoutMismatch",
                          "GET /v1/layout")  # fmt: skip
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": fake_handle(d.store, 100)}, 422,
                          "BufferTooSmall", f"holds 100 bytes, the layout needs {nbytes}")  # fmt: skip
            # It claims enough bytes, but the segment behind the name is smaller.
            lying = fake_handle(d.store, nbytes, name=small.name)
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": lying}, 422, "BufferTooSmall", "4096")
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": fake_handle(d.store, nbytes)}, 422,
                          "BadHandle", "no shared memory")  # fmt: skip
            outside = fake_handle(d.store, nbytes, name="some-other-segment")
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": outside}, 422, "BadHandle", ".buf.<id>")
            # Names that climb out of /dev/shm, or name a directory there: 422, never a 500 (outside review).
            escaping = fake_handle(d.store, nbytes, name=f"{d.store}.buf./../etc")
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": escaping}, 422, "BadHandle", "")
            os.mkdir(f"/dev/shm/{d.store}.buf.dir")
            try:
                a_dir = fake_handle(d.store, nbytes, name=f"{d.store}.buf.dir")
                await refused({"engine": "e", "layout_hash": lay_hash, "buffer": a_dir}, 422, "BadHandle", "")
            finally:
                os.rmdir(f"/dev/shm/{d.store}.buf.dir")
            cuda_like = {"kind": "cuda_ipc", "args": {}, "device_uuid": "x", "nbytes": nbytes, "buffer_id": 3}
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": cuda_like}, 422, "KindMismatch",
                          "register a shm_buffer")  # fmt: skip
        else:
            own = allocate_own_segment(1, torch.device(device))
            keep.append(own)
            short = export_buffer(own.data, 5) | {"nbytes": 100}  # a real handle that claims too few bytes
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": short}, 422,
                          "BufferTooSmall", "holds 100 bytes")  # fmt: skip
            with pytest.raises(StoreError, match="refusing to export"):  # a block of the shared allocator
                export_buffer(torch.zeros(100, dtype=torch.uint8, device=device), 6)
            await refused({"engine": "e", "layout_hash": lay_hash, "buffer": fake_handle(d.store, nbytes)}, 422,
                          "KindMismatch", "register a cuda_ipc")  # fmt: skip
        # Nothing was lost: the daemon still waits, and a good registration loads version 1.
        st = await d.status()
        assert st is not None and st["reason"] == AWAITING_ENGINE and st["version"] is None
        view = allocate(info, device)
        keep.append(view)
        assert view.handle is not None
        good = view.handle
        view.handle = good | {"nbytes": 100}  # the engine-side client turns a refusal into a StoreError
        with pytest.raises(StoreError, match=r"\(422 BufferTooSmall\).*holds 100 bytes"):
            await asyncio.to_thread(DaemonClient(d.socket).register, view, "e1")
        view.handle = good
        body = {"engine": "e1", "layout_hash": view.layout.layout_hash.hex(), "buffer": view.handle}
        code, answer = await post(d, "/v1/store", body)
        check("/v1/store", "post", code, answer)
        assert code in (200, 202) and answer["buffer_id"] == view.handle["buffer_id"]
        await d.wait_version(1)
        assert view.read_version() == (1, trainer.roots[1])
        seq = view.fence.seq()
        code, answer = await post(d, "/v1/store", body)  # the same buffer again: nothing to do
        check("/v1/store", "post", code, answer)
        assert (code, answer["state"], answer["version"]) == (200, "ready", 1)
        assert view.fence.seq() == seq
        assert await asyncio.to_thread(d.terminate) == 0
    finally:
        d.cleanup()
        for k in keep:
            if isinstance(k, EngineView):
                k.close()
            elif isinstance(k, SharedSegment):
                k.unlink()
                k.close()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.asyncio
async def test_store_registration_on_a_daemon_without_engine_stores(tmp_path: Path) -> None:
    """A shm store is the daemon's own: a registration is refused with 409, in the spec's shape."""
    app = make_api_app(Status("h", "r"), lambda: None, lambda: b"")
    runner = await serve_unix(app, tmp_path / "api.sock")
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / "api.sock"))) as s,
            s.post("http://d/v1/store", json={"engine": "e"}) as r,
        ):
            body = await r.json()
            check("/v1/store", "post", r.status, body)
            assert r.status == 409 and body["error"] == "NotEngineStore"
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a daemon without CUDA gives")
async def test_cuda_store_without_cuda_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    await sw.start_seed()
    try:
        d = make_daemon(sw, "host", tmp_path)
        text = d.config.read_text().replace("[store]\n", '[store]\nkind = "cuda"\ndevice = "cuda:0"\n', 1)
        d.config.write_text(text)
        cmd = [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(d.config)]
        out = await asyncio.to_thread(subprocess.run, cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr
        assert "store.kind: 'cuda' needs CUDA in the daemon's process" in out.stderr
        assert not Path(d.socket).exists()
    finally:
        await sw.close()

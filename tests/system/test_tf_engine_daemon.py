"""The transformers engine as an operator runs it: a Llama trained a few AdamW steps, each step published; a
rollout daemon (sidecar, commit_mode in_place, export.dir, ``engine.kind = "zero-copy"``: it commits each
version through the engine's /patchswarm/v1/commit) and ``patchswarm engine transformers`` as separate
processes.  After each version the engine's logits for fixed prompts are bitwise those of a fresh
``from_pretrained`` of the version the daemon exported; a request pinned to the next version gets 409
until it lands, then runs on it and says so."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.support.boards import free_port
from tests.support.daemonkit import ROOT, make_daemon
from tests.support.hf_models import Training
from tests.support.swarmkit import Swarm
from tests.support.tf_checkpoints import start_engine_cli

transformers = pytest.importorskip("transformers")

PROMPTS = [[104, 101, 108, 108, 111], [7, 300, 511, 2], [259, 120, 121, 257, 260]]


async def wait_for(predicate: Any, what: str, timeout_s: float = 120.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = await predicate()
        if got:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_engine_serves_each_trained_version_bitwise_behind_the_sidecar(tmp_path: Path) -> None:
    training = Training(tmp_path)
    sw = Swarm(tmp_path)
    export = tmp_path / "export"

    def publish(step: int) -> None:
        training.publish(sw.pub, step)

    publish(1)
    engine_dir = training.engine_dir(tmp_path / "engine")  # (float32 config: the engine serves the store's bf16)

    await sw.start_seed()
    engine_port, sidecar_port = free_port(), free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{sidecar_port}"\n'
        f'upstream = "http://127.0.0.1:{engine_port}"\ncommit_mode = "in_place"\n'
        f'[export]\ndir = "{export}"\n[engine]\nkind = "zero-copy"\n'
    )
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    d.start()
    log = tmp_path / "engine.log"
    proc: subprocess.Popen[bytes] | None = None
    engine, sidecar = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{sidecar_port}"
    try:
        # The store holds version 1 before the engine runs: not served (no engine acknowledged it yet).
        st = await wait_for(lambda: _status_at(d, 1), "the daemon to write version 1")
        assert st["served_version"] is None and st["state"] == "error", st
        proc = start_engine_cli(engine_dir, d.socket, engine_port, log, "--fence-wait", "30")
        async with aiohttp.ClientSession() as http:

            async def health() -> Any:
                assert proc is not None and proc.poll() is None, log.read_text()[-2000:]
                try:
                    async with http.get(f"{engine}/health") as r:
                        return await r.json()
                except aiohttp.ClientError:
                    return None

            await wait_for(health, "the engine to start")
            await wait_for(lambda: _status_at(d, 1, served=True), "the daemon's commit of v1 to the engine")
            for version in (1, 2, 3):
                if version > 1:
                    pinned = {"prompt": "hi", "max_tokens": 2, "weight_version": {"exact_version": version}}
                    async with http.post(f"{sidecar}/v1/completions", json=pinned) as r:
                        assert r.status == 409 and (await r.json())["error"] == "WeightVersionNotReady"
                    publish(version)

                    async def landed(pinned: dict[str, Any] = pinned) -> Any:
                        async with http.post(f"{sidecar}/v1/completions", json=pinned) as r:
                            if r.status == 409:
                                return None
                            assert r.status == 200, await r.text()
                            return await r.json()

                    out = await wait_for(landed, f"version {version} through the sidecar")
                    assert out["weight_version"] == {"start": version, "end": version}
                await wait_for(
                    lambda v=version: _exported(export, v), f"export of v{version}"
                )  # the daemon's own checkpoint of the version
                ref = transformers.AutoModelForCausalLM.from_pretrained(export / f"v{version}")
                assert ref.dtype == torch.bfloat16
                for ids in PROMPTS:
                    async with http.post(f"{engine}/patchswarm/v1/logits", json={"prompt": ids}) as r:
                        got = await r.json()
                    assert got["version"] == version
                    with torch.inference_mode():
                        want = ref(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    assert torch.equal(torch.tensor(got["logits"]), want), (version, ids)
                body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
                async with http.post(f"{sidecar}/v1/completions", json=body) as r:
                    out = await r.json()
                    assert r.status == 200 and out["weight_version"] == {"start": version, "end": version}
                    assert r.headers["X-Weight-Version-Start"] == str(version)

                async def served(v: int = version) -> bool:
                    async with http.get(f"{engine}/patchswarm/v1/version") as r:
                        return bool((await r.json())["version"] == v)

                await wait_for(served, f"the engine to serve v{version}")

                async def acked(v: int = version) -> bool:
                    st = await d.status()
                    return st is not None and (st.get("acks") or {}).get("transformers") == v

                await wait_for(acked, f"the daemon to hear the engine's ack of v{version}")
                st = await d.status()
                assert st is not None and st["served_version"] == version and st["state"] == "idle", st
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0, log.read_text()[-2000:]
        assert "transformers engine serving" in log.read_text()
        assert "engine paused for activation" in d.log.read_text()  # in_place: through the engine's routes
        assert await d.stop() == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        d.cleanup()
        await sw.close()


async def _status_at(d: Any, version: int, *, served: bool = False) -> Any:
    """The daemon's status once its store (``served``: its engine) is at ``version``; None before."""
    st = await d.status()
    if st is None or st["version"] != version or (served and st["served_version"] != version):
        return None
    return st


async def _exported(export: Path, version: int) -> bool:
    cur = export / "current"
    return cur.is_symlink() and os.readlink(cur) == f"v{version}" and (export / f"v{version}" / "config.json").exists()


def test_cli_refuses_bad_engine_input_in_one_line(tmp_path: Path) -> None:
    """A checkpoint without config.json, a device that is not one, a daemon socket nobody listens on."""
    (tmp_path / "ck").mkdir()
    cases = [
        (["--checkpoint", str(tmp_path / "ck")], "has no config.json"),
        (["--checkpoint", str(tmp_path), "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    ]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases.append((["--checkpoint", str(tmp_path), "--daemon", str(tmp_path / "none.sock"), "--wait", "0"], "--daemon"))
    for args, why in cases:
        r = subprocess.run(
            [sys.executable, "-m", "patchswarm.daemon.cli", "engine", "transformers", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )  # fmt: skip
        lines = r.stderr.strip().splitlines()
        assert r.returncode in (1, 2) and len(lines) == 1 and why in lines[0], r.stderr


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_daemon_killed_mid_write_makes_requests_fail_never_read_torn(tmp_path: Path) -> None:
    """kill -9 of the daemon in the middle of writing version 2 (its fence odd, the engine paused): requests
    wait their bounds and fail 503; a restarted daemon recovers, and the engine serves bitwise again."""
    training = Training(tmp_path)
    sw = Swarm(tmp_path)

    def publish(step: int) -> None:
        training.publish(sw.pub, step)

    publish(1)
    engine_dir = training.engine_dir(tmp_path / "engine")
    await sw.start_seed()
    engine_port, sidecar_port = free_port(), free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{sidecar_port}"\n'
        f'upstream = "http://127.0.0.1:{engine_port}"\ncommit_mode = "in_place"\n'
    )
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    d.start(PATCHSWARM_FAULT_AT="mid_write")
    log = tmp_path / "engine.log"
    proc: subprocess.Popen[bytes] | None = None
    engine = f"http://127.0.0.1:{engine_port}"
    try:
        await d.wait_version(1)
        proc = start_engine_cli(engine_dir, d.socket, engine_port, log, "--fence-wait", "1", "--pause-limit", "1")
        async with aiohttp.ClientSession() as http:

            async def version() -> Any:
                assert proc is not None and proc.poll() is None, log.read_text()[-2000:]
                try:
                    async with http.get(f"{engine}/patchswarm/v1/version") as r:
                        return (await r.json())["version"]
                except aiohttp.ClientError:
                    return None

            assert await wait_for(version, "the engine to serve v1") == 1
            publish(2)

            async def daemon_dead() -> bool:
                return not d.alive

            await wait_for(daemon_dead, "the daemon to die mid-write")
            assert d.proc is not None and d.proc.returncode == -signal.SIGKILL
            torn = [("/v1/completions", {"prompt": "hi", "max_tokens": 3}), ("/patchswarm/v1/logits", {"prompt": [1]})]
            for route, body in torn:
                async with http.post(f"{engine}{route}", json=body) as r:
                    assert r.status == 503, await r.text()
                    assert (await r.json())["error"]["type"] == "service_unavailable"
            assert await version() == 1  # never reported the half-written version

            d.start()  # recovery (the journal), then version 2 again
            await d.wait_version(2, timeout=120)
            assert await wait_for(lambda: _is(version, 2), "the engine to serve v2")
            copy.deepcopy(training.model).to(torch.bfloat16).save_pretrained(
                tmp_path / "v2-bf16"
            )  # the version, as served
            ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v2-bf16")
            for ids in PROMPTS:
                async with http.post(f"{engine}/patchswarm/v1/logits", json={"prompt": ids}) as r:
                    got = await r.json()
                assert got["version"] == 2
                with torch.inference_mode():
                    want = ref(input_ids=torch.tensor([ids])).logits[0, -1].float()
                assert torch.equal(torch.tensor(got["logits"]), want), ids
        assert await d.stop() == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        d.cleanup()
        await sw.close()


async def _is(get: Any, value: int) -> bool:
    return bool(await get() == value)

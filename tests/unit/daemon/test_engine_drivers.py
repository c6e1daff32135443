"""The daemon's engine drivers (daemon/engine_drivers.py) and their config keys, against the reference
engine's real HTTP routes (daemon/refengine.py): a commit is acknowledged only once the engine's
fence reads the version, a refusal or an unreachable engine is one EngineError line."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from patchswarm.daemon.config import ConfigError, from_mapping
from patchswarm.daemon.engine_driver import Activation, EngineError
from patchswarm.daemon.engine_drivers import NoEngine, ZeroCopyEngine, copies_regions, make_driver
from patchswarm.daemon.ref_sources import StaticSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.sidecar import serve_app
from tests.support.boards import free_port
from tests.support.tinylm import random_export

MINIMAL = {
    "swarm": {"run_id": "run-1", "cluster_secret_file": "/etc/patchswarm/secret"},
    "trust": {"root": "/etc/patchswarm/root.pub"},
}


def test_engine_keys_default_to_no_engine_on_the_sidecars_upstream() -> None:
    cfg = from_mapping(MINIMAL, {})
    assert (cfg["engine.kind"], cfg["engine.url"], cfg["engine.flush_cache"], cfg["engine.commit_timeout"]) == (
        "none",
        None,
        True,
        30.0,
    )
    assert isinstance(make_driver(cfg, lambda: 3), NoEngine)
    raw = {**MINIMAL, "engine": {"kind": "zero-copy", "flush_cache": False, "commit_timeout": "2s"}}
    cfg = from_mapping(raw, {"PATCHSWARM_ENGINE_URL": "http://127.0.0.1:9/"})
    driver = make_driver(cfg, lambda: None)
    assert isinstance(driver, ZeroCopyEngine) and driver.commit_timeout_s == 2.0 and not cfg["engine.flush_cache"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kind", "triton", r"engine\.kind: expected one of none, zero-copy, vllm, sglang"),
        ("url", "ftp://x", r"engine\.url: expected an http"),
        ("flush_cache", "maybe", r"engine\.flush_cache: expected true or false"),
        ("commit_timeout", "soon", r"engine\.commit_timeout: expected a duration"),
    ],
)
def test_bad_engine_keys_are_one_line(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping({**MINIMAL, "engine": {key: value}}, {})


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_copy_engines_attach_through_the_daemons_socket(kind: str) -> None:
    cfg = from_mapping({**MINIMAL, "engine": {"kind": kind, "pause_mode": "retract"}, "store": {"ranks": 2,
                        "plan": "llama"}, "api": {"socket": "/run/x/api.sock"}}, {})  # fmt: skip
    driver: Any = make_driver(cfg, lambda: None)
    assert driver.name == kind and driver.ranks == 2
    assert json.loads(driver.attach_spec) == {"socket": "/run/x/api.sock", "ranks": 2, "engine": kind, "wait_s": 60}
    if kind == "sglang":
        assert driver.pause_mode == "retract"


@pytest.mark.asyncio
async def test_no_engine_serves_the_stores_version() -> None:
    driver = NoEngine(lambda: 7, "http://127.0.0.1:9")
    assert await driver.served_version() == 7
    assert await driver.commit(Activation(8, 7, False)) == 8
    await driver.close()


@pytest.mark.asyncio
async def test_zero_copy_commit_is_acknowledged_only_at_the_version_the_fence_reads() -> None:
    source = StaticSource(random_export(1), version=4)
    engine = await start_engine(source)
    driver = ZeroCopyEngine(engine.url, commit_timeout_s=5.0)
    try:
        assert await driver.served_version() is None  # (nothing committed yet)
        assert await driver.commit(Activation(4, None, True)) == 4
        assert await driver.served_version() == 4
        with pytest.raises(EngineError, match=r"engine\.url /patchswarm/v1/commit at .* answered 409: VersionMismatch"):
            await driver.commit(Activation(5, 4, False))
        assert await driver.served_version() == 4  # a refused commit leaves the engine where it was
        await driver.pause()
        await driver.resume()
        async with aiohttp.ClientSession() as s:
            for body in ({"version": -1}, {"version": "5"}, {"version": 5, "flush_cache": 1}, {"version": 5, "x": 1}):
                async with s.post(engine.url + "/patchswarm/v1/commit", json=body) as r:
                    assert r.status == 400, body
    finally:
        await driver.close()
        await engine.close()


@pytest.mark.asyncio
async def test_an_unreachable_or_confused_engine_is_one_error_line() -> None:
    gone = ZeroCopyEngine(f"http://127.0.0.1:{free_port()}")
    line = r"engine\.url /patchswarm/v1/version at http://127\.0\.0\.1:\d+: cannot connect"
    with pytest.raises(EngineError, match=line):
        await gone.served_version()
    await gone.close()

    async def odd(request: web.Request) -> web.Response:
        return web.Response(text="x" * 100_000 if request.method == "GET" else '{"version": 99}')

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", odd)
    server = await serve_app(app, "127.0.0.1", 0)
    driver = ZeroCopyEngine(server.url)
    try:
        with pytest.raises(EngineError, match="answered over 65536 bytes"):
            await driver.served_version()
        with pytest.raises(EngineError, match="acknowledged 99, not version 3"):
            await driver.commit(Activation(3, None, True))
    finally:
        await driver.close()
        await server.close()


def test_regions_are_built_only_for_engines_that_copy() -> None:
    assert not copies_regions(NoEngine(lambda: None, "http://127.0.0.1:9"))
    assert not copies_regions(ZeroCopyEngine("http://127.0.0.1:9"))
    assert copies_regions(object())  # (a driver that says nothing: its engine may copy)


@pytest.mark.asyncio
async def test_a_commit_past_engine_commit_timeout_is_an_error() -> None:
    never = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await never.wait()  # (an engine that never answers the commit)
        return web.json_response({"version": 1})

    app = web.Application()
    app.router.add_post("/patchswarm/v1/commit", slow)
    server = await serve_app(app, "127.0.0.1", 0)
    driver = ZeroCopyEngine(server.url, commit_timeout_s=0.2)
    try:
        with pytest.raises(EngineError, match=r"engine\.url /patchswarm/v1/commit at .*: timed out"):
            await driver.commit(Activation(1, None, True))
    finally:
        never.set()
        await driver.close()
        await server.close()

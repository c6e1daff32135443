"""The sidecar fails closed: only its allow list (daemon/sidecar_routes.py) reaches the engine.

Requests go over raw sockets so the engine-side check sees exactly the path a client sent (an HTTP
client library would resolve ``..`` and decode ``%70`` before sending); the engine is a catch-all that
records every path it is asked for, so "never reached the engine" is checked, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.cli import main
from patchswarm.daemon.config import ConfigError, load_config
from patchswarm.daemon.sidecar import RunningServer, make_sidecar_app, serve_app, start_sidecar
from patchswarm.daemon.sidecar_gate import VersionGate
from patchswarm.daemon.sidecar_routes import (
    CONTROL_ROUTES,
    CONTROL_WORDS,
    DEFAULT_PREFIXES,
    DEFAULT_ROUTES,
    MAX_EXTRA_ROUTES,
    normalize,
    route_words,
)
from tests.support.recording_engine import RecordingEngine

EXTRA = ["/v1/messages", "/custom/*"]  # the operator's routes in these tests


@dataclass
class Rig:
    engine: RecordingEngine
    sidecar: RunningServer
    gate: VersionGate


@asynccontextmanager
async def rig(allow_routes: list[str] | None = None) -> AsyncIterator[Rig]:
    engine = RecordingEngine()
    upstream = await serve_app(engine.app())
    gate = VersionGate(applied=1)
    sidecar = await start_sidecar(upstream.url, gate, allow_routes=allow_routes or [])
    try:
        yield Rig(engine, sidecar, gate)
    finally:
        await sidecar.close()
        await upstream.close()


def raw_request(port: int, method: str, target: str, body: bytes = b"{}") -> tuple[int, Any]:
    """``method target`` sent byte for byte; (status, JSON body or None)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    return int(status_line.split()[1]), parsed


async def request(r: Rig, method: str, target: str) -> tuple[int, Any]:
    return await asyncio.to_thread(raw_request, r.sidecar.port, method, target)


def on_the_list(path: str, extra: list[str]) -> bool:
    """The allow list, stated apart from RoutePolicy so a bug there shows."""
    clean = normalize(path)
    exact = DEFAULT_ROUTES | {r for r in extra if not r.endswith("/*")}
    prefixes = DEFAULT_PREFIXES | {r[:-2] for r in extra if r.endswith("/*")}
    if clean in CONTROL_ROUTES:
        return False
    return clean in exact or any(clean.startswith(p + "/") for p in prefixes)


# ---------------------------------------------------------------- routes over real HTTP


@pytest.mark.asyncio
async def test_every_allowed_route_reaches_the_engine_as_sent() -> None:
    async with rig() as r:
        subpaths = ["/v1/models/Qwen/Qwen3-8B", "/v1/models/org%2Fname", "/v1/responses/resp_1/cancel"]
        variants = ["/v1/completions/", "//v1//chat/completions", "/v1/x/../embeddings", "/generate?x=1"]
        for path in [*sorted(DEFAULT_ROUTES), *subpaths, *variants]:
            for method in ("GET", "POST"):
                before = len(r.engine.seen)
                status, body = await request(r, method, path)
                assert status == 200, (method, path, body)
                assert len(r.engine.seen) == before + 1, path
                got_method, got_path = r.engine.seen[-1][:2]
                assert got_method == method and normalize(got_path) == normalize(unquote(path.split("?")[0]))
        assert r.gate.in_flight == 0


NOT_SERVED = [
    "/", "/metrics", "/get_server_info", "/v1/files", "/v1/batches", "/load", "/v1/completionsX", "/V1/completions",
    "/generate_from_file", "/v1/models/..", "/v1/completions/../files", "/v1/models/..%2F..%2Ffiles",
    "/v1/%2e%2e/v1/files", "/%2e%2e/metrics", "/v1/responses%2F..%2F..%2Fmetrics", "/custom", "/v1/messages",
    # a listed route spelled with escapes: the raw path must be on the list too (fails closed)
    "/v1/%63ompletions", "/%67enerate",
]  # fmt: skip
CONTROL_VARIANTS = [
    "/pause_generation", "//pause_generation/", "/x/../pause_generation", "/%70ause_generation",
    "/v1/models/%2e%2e/%2e%2e/pause", "/v1/models/..%2F..%2Fcollective_rpc", "/generate/../update_weights_from_disk",
    "/v1/../v1/load_lora_adapter", "/patchswarm/v1/commit", "/patchswarm/v1/./commit?version=9",
]  # fmt: skip


@pytest.mark.asyncio
async def test_paths_off_the_list_are_404_and_control_routes_403_and_neither_reaches_the_engine() -> None:
    async with rig() as r:
        for path in NOT_SERVED:
            for method in ("GET", "POST"):
                status, body = await request(r, method, path)
                assert status == 404, (method, path, body)
                assert set(body) == {"error", "detail"} and body["error"] == "RouteNotServed", body
                assert "not served by the sidecar" in body["detail"] and "sidecar.allow_routes" in body["detail"]
        status, body = await request(r, "POST", "/v1/%63ompletions")  # the form that failed is named
        assert body["detail"].startswith("route /v1/%63ompletions is not served by the sidecar"), body
        for path in CONTROL_VARIANTS:
            status, body = await request(r, "POST", path)
            assert status == 403 and body["error"] == "EngineControlRoute", (path, body)
        assert r.engine.seen == [] and r.gate.in_flight == 0
        status, body = await request(r, "GET", "/_patchswarm/version")  # the sidecar's own route
        assert status == 200 and body["applied_version"] == 1


@pytest.mark.asyncio
async def test_the_operators_routes_are_forwarded_and_control_routes_still_refused() -> None:
    async with rig(EXTRA) as r:
        for path in ("/v1/messages", "/custom/a", "/custom/a/b?c=d", "/custom/x/../y"):
            status, body = await request(r, "POST", path)
            assert status == 200 and body["engine_saw"] == normalize(unquote(path.split("?")[0])), (path, body)
        assert len(r.engine.seen) == 4
        for path, code in (
            ("/custom", 404),
            ("/custom/..", 404),
            ("/custom/../pause", 403),
            ("/custom/%2e%2e/sleep", 403),
        ):
            assert (await request(r, "POST", path))[0] == code, path
        assert len(r.engine.seen) == 4


@pytest.mark.parametrize(
    ("routes", "why"),
    [
        (["/pause_generation"], "control route /pause_generation"),
        (["/patchswarm/*"], "control route /patchswarm/v1/commit"),
        (["/v1/*"], "control route /v1/load_lora_adapter"),
        (["v1/messages"], "must start with '/'"),
        (["/*"], "plain path"),
        (["/a/../pause"], "plain path"),
        (["/%70ause"], "plain path"),
        (["/v1/messages/"], "plain path"),
        (["/a b"], "plain path"),
        (["/" + "a" * 300], "longer than 256"),
        ([f"/r{i}" for i in range(MAX_EXTRA_ROUTES + 1)], f"more than {MAX_EXTRA_ROUTES}"),
    ],
)
def test_bad_operator_routes_are_refused_at_entry(routes: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        make_sidecar_app("http://127.0.0.1:1", VersionGate(1), allow_routes=routes)


def test_a_control_route_in_the_config_stops_the_daemon_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "daemon.toml"
    config.write_text(
        '[swarm]\nrun_id = "r"\ncluster_secret_file = "/nonexistent"\n[trust]\nroot = "/nonexistent"\n'
        '[sidecar]\nenabled = true\nallow_routes = ["/v1/messages", "/collective_rpc"]\n'
    )
    with pytest.raises(ConfigError, match=r"^sidecar\.allow_routes: route '/collective_rpc' would serve"):
        load_config(config, {})
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["daemon", "--config", str(config)])
    lines = err.getvalue().strip().splitlines()
    assert rc != 0 and len(lines) == 1 and "sidecar.allow_routes" in lines[0] and "/collective_rpc" in lines[0], lines
    env = {"PATCHSWARM_SIDECAR_ALLOW_ROUTES": "/v1/messages, /custom/*"}
    config.write_text(config.read_text().replace(', "/collective_rpc"', ""))
    assert load_config(config, env)["sidecar.allow_routes"] == EXTRA
    with pytest.raises(ConfigError, match=r"PATCHSWARM_SIDECAR_ALLOW_ROUTES\): route '/sleep'"):
        load_config(config, {"PATCHSWARM_SIDECAR_ALLOW_ROUTES": "/x,/sleep"})


# ---------------------------------------------------------------- any path at all


@dataclass
class Served:
    port: int
    engine: RecordingEngine


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """An engine and a sidecar (with EXTRA) on a loop of their own, for synchronous hypothesis tests."""
    loop = asyncio.new_event_loop()
    engine = RecordingEngine()
    stop = asyncio.Event()
    ready: list[int] = []
    started = threading.Event()

    async def serve() -> None:
        upstream = await serve_app(engine.app())
        sidecar = await start_sidecar(upstream.url, VersionGate(1), allow_routes=EXTRA)
        ready.append(sidecar.port)
        started.set()
        await stop.wait()
        await sidecar.close()
        await upstream.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(60)
    try:
        yield Served(ready[0], engine)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


SEGMENTS = [
    "v1", "models", "completions", "chat", "responses", "generate", "health", "custom", "messages", "pause",
    "pause_generation", "collective_rpc", "patchswarm", "commit", "files", "metrics", ".", "..", "", "%2e",
    "%2E%2e", "%2f", "%2F..", "..%2f", "%70ause", "%76%31", "org%2Fname", "%252e%252e", "a;b", "%00", "~",
]  # fmt: skip
_segment = st.sampled_from(SEGMENTS) | st.text(alphabet="abcv1./%2eEfF_;~", max_size=8)


@st.composite
def _encoded_route(draw: st.DrawFn) -> str:
    """A listed or control route with some of its characters percent-encoded."""
    route = draw(st.sampled_from(sorted(DEFAULT_ROUTES | CONTROL_ROUTES | {"/v1/messages", "/custom/a"})))
    flags = draw(st.lists(st.booleans(), min_size=len(route), max_size=len(route)))
    return "".join(f"%{ord(c):02X}" if f else c for c, f in zip(route, flags, strict=True))


_targets = (
    st.lists(_segment, min_size=1, max_size=7).map(lambda parts: "/" + "/".join(parts))
    | st.tuples(st.lists(_segment, max_size=3), _encoded_route()).map(lambda t: "/" + "/".join(t[0]) + t[1])
).flatmap(lambda path: st.sampled_from(["", "?a=1", "?x=/../pause"]).map(lambda q: path + q))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=_targets, method=st.sampled_from(["GET", "POST"]))
def test_the_engine_never_sees_a_path_off_the_list(served: Served, target: str, method: str) -> None:
    before = len(served.engine.seen)
    status, body = raw_request(served.port, method, target)
    reached = served.engine.seen[before:]
    for _, path, raw, _, _ in reached:  # what the engine's router got, decoded and raw
        assert on_the_list(path, EXTRA) and on_the_list(unquote(raw.split("?")[0]), EXTRA), (target, path, raw)
    client_path = unquote(target.split("?")[0])
    if not on_the_list(client_path, EXTRA):  # off the list as the client wrote it: refused, engine untouched
        assert reached == [] and status in (400, 403, 404), (target, status, body)
    if status == 404 and isinstance(body, dict) and body.get("error") == "RouteNotServed":
        assert reached == []


# SGLang's control routes that CONTROL_ROUTES did not name (sgl-project/sglang,
# python/sglang/srt/entrypoints/http_server.py): weights sent to an address the caller names, cache storage
# cleared, the garbage collector frozen, expert-distribution recording.  Each release adds more, so the
# check is by what a route does (its words), not by a list of names.
UNLISTED_CONTROL = [
    "/send_weights_to_remote_instance", "/init_weights_send_group_for_remote_instance",
    "/clear_hicache_storage_backend", "/freeze_gc", "/start_expert_distribution_record",
    "/stop_expert_distribution_record", "/dump_expert_distribution_record", "/update_weights_from_disk_v2",
    "/v1/update_lora", "/engine/resume", "/reset_encoder_cache", "/sglang/flush_cache/*",
]  # fmt: skip
# Routes the docs say an operator may add (docs/sidecar.md): metadata, state, and inference routes.
ADDABLE = [
    "/metrics", "/get_server_info", "/server_info", "/get_weights_by_name", "/get_weight_version", "/open_session",
    "/close_session", "/v1/files/*", "/v1/batches/*", "/invocations", "/load", "/get_load", "/v1/messages",
    "/v1/classify", "/v1/tokenize", "/v1/detokenize", "/parse_function_call", "/is_sleeping", "/vertex_generate",
]  # fmt: skip


@pytest.mark.parametrize("route", UNLISTED_CONTROL)
def test_an_operator_route_that_names_a_control_action_is_refused(route: str) -> None:
    with pytest.raises(ValueError, match=r"control"):
        make_sidecar_app("http://127.0.0.1:1", VersionGate(1), allow_routes=[route])


def test_the_routes_an_operator_may_add_are_taken() -> None:
    make_sidecar_app("http://127.0.0.1:1", VersionGate(1), allow_routes=ADDABLE)


def test_every_listed_control_route_names_a_control_word_and_no_default_route_does() -> None:
    assert all(set(route_words(r)) & CONTROL_WORDS for r in CONTROL_ROUTES)
    assert not any(set(route_words(r)) & CONTROL_WORDS for r in DEFAULT_ROUTES | DEFAULT_PREFIXES)

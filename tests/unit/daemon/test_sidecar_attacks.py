"""Attacks on the sidecar from a rollout client, over raw sockets, against an engine that records exactly
what it was sent (headers and body), so "the engine never got it" is checked, not assumed."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from patchswarm.daemon.sidecar import RunningServer, serve_app, start_sidecar
from patchswarm.daemon.sidecar_gate import VersionGate
from tests.support.recording_engine import RecordingEngine


@dataclass
class Rig:
    engine: RecordingEngine
    sidecar: RunningServer


@asynccontextmanager
async def rig(applied: int = 1) -> AsyncIterator[Rig]:
    engine = RecordingEngine()
    upstream = await serve_app(engine.app())
    sidecar = await start_sidecar(upstream.url, VersionGate(applied=applied))
    try:
        yield Rig(engine, sidecar)
    finally:
        await sidecar.close()
        await upstream.close()


def exchange(port: int, data: bytes) -> tuple[int, Any]:
    """``data`` sent byte for byte on a fresh connection; (status, JSON body or None) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply and (chunk := s.recv(65536)):
            reply += chunk
        head, _, payload = reply.partition(b"\r\n\r\n")
        lengths = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
        while len(payload) < (lengths or [0])[0] and (chunk := s.recv(65536)):  # (the connection may stay open)
            payload += chunk
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    return int(head.split()[1]), parsed


def post(path: str, body: bytes, headers: list[str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", *headers, f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def engine_reads_as_json(headers: dict[str, str]) -> bool:
    """Whether FastAPI (vLLM's and SGLang's servers) parses a body with these headers as JSON: with no
    Content-Type, an empty one, or an application/json or +json one."""
    ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), "").split(";")[0].strip().lower()
    return ctype in ("", "application/json") or (ctype.startswith("application/") and ctype.endswith("+json"))


PINNED = json.dumps({"weight_version": {"exact_version": 7}, "prompt": "hi"}).encode()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "headers",
    [
        # The client's Connection header names Content-Type, so the sidecar drops it: the engine must then
        # not get the body with no Content-Type (FastAPI would read it as JSON, and the pin the sidecar did
        # not look for in a text/plain body would be dropped there, served from any version).
        ["Content-Type: text/plain", "Connection: keep-alive, Content-Type"],
        ["Content-Type: text/plain", "Connection: content-type, close"],
        ["Content-Type: text/plain", "Connection: Content-Type", "Connection: close"],
        ["Content-Type: text/plain", "Content-Type: application/json"],  # (a duplicate: 400 at parsing)
        ["Content-Type: application/json", "Connection: Content-Type"],
        [],  # no Content-Type at all: sniffed as JSON by the sidecar, as by FastAPI
    ],
)
async def test_a_pin_never_reaches_an_engine_that_reads_the_body_as_json(headers: list[str]) -> None:
    async with rig(applied=1) as r:
        status, body = await asyncio.to_thread(exchange, r.sidecar.port, post("/v1/completions", PINNED, headers))
        for seen in r.engine.seen:
            assert not (engine_reads_as_json(seen.headers) and b"weight_version" in seen.body), seen
        if not r.engine.seen:  # refused: the pin (version 7; the engine serves 1) was read and honoured
            duplicate = len({h.split(":")[0].lower() for h in headers}) < len(headers)
            assert (status == 409 and body["error"] == "WeightVersionNotReady") or (duplicate and status == 400), status


CLOSE = "Host: x\r\nConnection: close\r\n"
# Request framings that might reach the engine with a path or a request the sidecar did not judge: each
# is refused (the status) and nothing reaches the engine.
REFUSED = [
    (f"POST http://127.0.0.1:1/pause_generation HTTP/1.1\r\n{CLOSE}Content-Length: 0\r\n\r\n", 403),  # absolute-form
    (f"POST https://u@h/generate/..%2F..%2Fpause HTTP/1.1\r\n{CLOSE}Content-Length: 0\r\n\r\n", 403),
    (f"CONNECT 127.0.0.1:1 HTTP/1.1\r\n{CLOSE}\r\n", 404),  # authority-form: no path to match
    (f"CONNECT /generate HTTP/1.1\r\n{CLOSE}\r\n", 404),
    (f"OPTIONS * HTTP/1.1\r\n{CLOSE}\r\n", 404),
    ("GET /\r\nGET /pause_generation HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # HTTP/0.9, a request pipelined after
    ("POST /generate\r\nContent-Length: 2\r\n\r\n{}", 400),
    ("GET /health\r\n\r\nPOST /pause_generation HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 400),
    # smuggling: both framings, an obs-fold, a second Host, a version that is not 1.0 or 1.1
    (
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        "0\r\n\r\nPOST /pause_generation HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        400,
    ),
    (f"POST /generate HTTP/1.1\r\n{CLOSE}X-A: a\r\n Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n", 400),
    (f"POST /generate HTTP/1.1\r\n{CLOSE}Host: y\r\nContent-Length: 0\r\n\r\n", 400),
    (f"GET /health HTTP/1.9\r\n{CLOSE}\r\n", 400),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("request_bytes", "status"), REFUSED)
async def test_odd_request_framings_never_reach_the_engine(request_bytes: str, status: int) -> None:
    async with rig() as r:
        got, _ = await asyncio.to_thread(exchange, r.sidecar.port, request_bytes.encode())
        assert got == status
        assert r.engine.seen == []

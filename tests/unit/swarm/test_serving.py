"""swarm/serving.py on real loopback sockets, in process: request bodies read piece by piece within a
size limit and a deadline (the peer gossip route among them), one log line and no traceback per
malformed request, the connection cap, the open-files limit.  The same limits against the four
servers as processes: tests/system/test_slow_clients.py and tests/system/test_http_fuzz.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from patchswarm.swarm.http import MAX_GOSSIP_BYTES, PREFIX, add_routes
from patchswarm.swarm.serving import ServerLimits, address_key, is_loopback, raise_nofile_limit, read_body, serve_tcp
from patchswarm.swarm.transport import Handlers

LIMITS = ServerLimits(max_connections=4, header_timeout_s=5, idle_timeout_s=5, body_timeout_s=1, send_timeout_s=5)


async def _never(*args: object) -> None:
    raise AssertionError("not called")


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[int, list[bytes]]]:
    """The peer routes (gossip recorded) and an echo of read_body(limit 1000), under LIMITS."""
    got: list[bytes] = []

    async def echo(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await read_body(request, 1000))))

    @web.middleware
    async def peek(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/peek":
            await request.read()  # (a middleware may read the body first: aiohttp caches it)
        return await handler(request)

    app = web.Application(middlewares=[peek])
    add_routes(app, Handlers(got.append, _never, _never))
    app.router.add_post("/echo", echo)
    app.router.add_post("/peek", echo)
    runner, port = await serve_tcp(app, "127.0.0.1", 0, LIMITS)
    try:
        yield port, got
    finally:
        await runner.cleanup()


async def _send(port: int, *pieces: bytes, pause: float = 0.1) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def _post(path: str, length: int, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\nConnection: close\r\n{extra}\r\n".encode()


@pytest.mark.asyncio
async def test_a_gossip_frame_in_pieces_arrives_whole(server: tuple[int, list[bytes]]) -> None:
    port, got = server
    frame = bytes(range(256)) * 40
    reply = await _send(port, _post(f"{PREFIX}/gossip", len(frame)), frame[:100], frame[100:5000], frame[5000:])
    assert reply.startswith(b"HTTP/1.1 204")
    assert got == [frame]


@pytest.mark.asyncio
async def test_a_gossip_frame_past_the_limit_is_refused(server: tuple[int, list[bytes]]) -> None:
    port, got = server
    reply = await _send(port, _post(f"{PREFIX}/gossip", MAX_GOSSIP_BYTES + 1))
    assert reply.startswith(b"HTTP/1.1 413")
    chunked = f"POST {PREFIX}/gossip HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    piece = b"%x\r\n" % (1 << 16) + b"g" * (1 << 16) + b"\r\n"
    reply = await _send(port, chunked.encode(), piece * 17, pause=0)  # no length said: counted as it comes
    assert reply.startswith(b"HTTP/1.1 413")
    assert got == []


@pytest.mark.asyncio
async def test_head_of_a_chunk_is_405_without_a_body_or_an_upload(server: tuple[int, list[bytes]]) -> None:
    # (the handler, _never here, used to run and send the whole chunk after the HEAD's headers)
    port, _ = server
    head = f"HEAD {PREFIX}/chunks/{'ab' * 32} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    reply = await _send(port, head)
    assert reply.startswith(b"HTTP/1.1 405") and reply.endswith(b"\r\n\r\n")


@pytest.mark.asyncio
async def test_bodies_in_pieces_limits_and_deadline(server: tuple[int, list[bytes]]) -> None:
    port, _ = server
    assert (await _send(port, _post("/echo", 900), b"a" * 300, b"b" * 300, b"c" * 300)).endswith(b"\r\n\r\n900")
    assert (await _send(port, _post("/echo", 1001))).startswith(b"HTTP/1.1 413")
    slow = await _send(port, _post("/echo", 900), b"a" * 10)  # the rest never comes
    assert slow.startswith(b"HTTP/1.1 408")
    assert (await _send(port, _post("/peek", 900), b"a" * 900)).endswith(b"\r\n\r\n900")  # read once, kept


@pytest.mark.asyncio
async def test_malformed_requests_log_one_line_without_traceback(
    server: tuple[int, list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    port, _ = server
    caplog.set_level(logging.DEBUG)
    for bad in (b"\x16\x03\x01garbage\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", b"GET /\x00 HTTP/1.1\r\n\r\n"):
        assert (await _send(port, bad)).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1  # rate-limited: one line per interval
    assert all(r.exc_info is None for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.asyncio
async def test_connections_past_the_cap_are_refused_and_the_others_kept(server: tuple[int, list[bytes]]) -> None:
    port, _ = server
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMITS.max_connections)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(reader.read(), 10)  # answered before it says anything
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After" in refused
        reader, writer = held[0]
        writer.write(_post("/echo", 2) + b"ab")
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"\r\n\r\n2")
    finally:
        for _, writer in held:
            writer.close()
    for _ in range(50):  # once they are gone, new connections are served again
        await asyncio.sleep(0.05)
        with contextlib.suppress(ConnectionError):
            if (await _send(port, _post("/echo", 1), b"x")).endswith(b"\r\n\r\n1"):
                break
    else:
        raise AssertionError("still refused after the held connections closed")


def test_address_key_counts_one_host_once() -> None:
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"  # IPv4-mapped: the same IPv4 host
    # IPv6: one /64 (a host is handed a whole /64), whatever the interface id, scope or spelling.
    v6 = {address_key(a) for a in ("2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:0db8:1:2:0::9")}
    assert v6 == {"2001:db8:1:2::/64"}
    assert address_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("") == "" and address_key("/run/x.sock") == "/run/x.sock"  # not an IP: as is
    assert all(is_loopback(address_key(a)) for a in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(address_key(a)) for a in ("203.0.113.7", "2001:db8::1", "", "/run/x.sock"))


def test_per_address_limits_from_environment() -> None:
    limits = ServerLimits.from_env(
        {"PATCHSWARM_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "3", "PATCHSWARM_HTTP_EXEMPT_LOOPBACK": "0"}
    )
    assert (limits.max_connections_per_address, limits.exempt_loopback) == (3, False)
    assert ServerLimits().exempt_loopback and ServerLimits().max_connections_per_address == 64
    with pytest.raises(ValueError, match="PATCHSWARM_HTTP_EXEMPT_LOOPBACK"):
        ServerLimits.from_env({"PATCHSWARM_HTTP_EXEMPT_LOOPBACK": "maybe"})
    with pytest.raises(ValueError, match="PATCHSWARM_HTTP_MAX_CONNECTIONS_PER_ADDRESS"):
        ServerLimits.from_env({"PATCHSWARM_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "0"})


def test_open_files_limit_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        now, _ = raise_nofile_limit()
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

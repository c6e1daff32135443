"""Hypothesis over raw HTTP request bytes (tests/support/http_requests.py) against the four servers as real
processes (tests/support/serverkit.py), each example sent to all four at once: every server answers with a
status below 500 (a seed's busy 503, which names a Retry-After, is an answer), closes, or waits for
the rest of a request it has not got; none crashes or logs a traceback, and each answers an honest
request after every example.  benchmarks/http_fuzz.py sends the same grammar 100k times.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.http_requests import raw_request
from tests.support.serverkit import Server, running_servers, status_of

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
SILENCE_S = 0.3  # no byte for this long: the server waits for the rest of the request


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    with running_servers(tmp_path_factory.mktemp("fuzz")) as started:
        yield started
        for s in started:
            assert "Traceback" not in s.log_text(), f"{s.name}: {s.log_text()[-3000:]}"


class DrawPick:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def choice(self, options: Sequence[object]) -> object:
        return self.data.draw(st.sampled_from(options))

    def blob(self, max_size: int) -> bytes:
        return self.data.draw(st.binary(max_size=max_size))


def acceptable(server: Server, reply: bytes) -> bool:
    status = status_of(reply)
    if status < 500:
        return True  # an answer, or none (closed, or waiting for more)
    return status == 503 and b"\r\nretry-after:" in reply.lower()  # busy, or the connection cap


def exchange_all(servers: list[Server], data: bytes) -> dict[str, bytes]:
    """Send ``data`` to every server at once; what each sent back before closing, completing its
    headers, or falling silent."""
    socks: dict[socket.socket, Server] = {}
    replies: dict[str, bytes] = {s.name: b"" for s in servers}
    for server in servers:
        sock = server.connect()
        socks[sock] = server
        try:
            sock.sendall(data)
        except OSError:
            pass  # closed on us mid-request: read what it said
    try:
        open_ = list(socks)
        while open_:
            ready, _, _ = select.select(open_, [], [], SILENCE_S)
            if not ready:
                break
            for sock in ready:
                name = socks[sock].name
                try:
                    piece = sock.recv(1 << 16)
                except OSError:
                    piece = b""
                replies[name] += piece
                if not piece or b"\r\n\r\n" in replies[name]:
                    open_.remove(sock)
    finally:
        for sock in socks:
            sock.close()
    return replies


@EXAMPLES
@given(data=st.data())
def test_raw_requests_never_break_a_server(servers: list[Server], data: st.DataObject) -> None:
    request = raw_request(DrawPick(data))  # type: ignore[arg-type]
    replies = exchange_all(servers, request)
    for server in servers:
        assert acceptable(server, replies[server.name]), (server.name, request[:300], replies[server.name][:300])
        assert server.alive(), server.log_text()[-2000:]
        assert server.honest(deadline_s=15) == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /swarm/v1/board/..%2F..%2F..%2Fetc%2Fpasswd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"POST /swarm/v1/gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\nConnection: close\r\n\r\n",
        b"POST /v1/ack HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello on the plain port
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(500)) + b"\r\n",
    ],
    ids=["encoded-dots", "huge-length", "bad-chunk", "two-lengths", "tls", "long-line", "many-headers"],
)
def test_known_hostile_requests(servers: list[Server], request_bytes: bytes) -> None:
    replies = exchange_all(servers, request_bytes)
    for server in servers:
        assert acceptable(server, replies[server.name]), (server.name, replies[server.name][:300])
        assert server.honest(deadline_s=15) == 200

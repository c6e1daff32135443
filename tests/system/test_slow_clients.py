"""Slow and idle clients against each of the four servers, as real processes (tests/support/serverkit.py):
a seed node's peer endpoints, the plain board server, the sidecar and the unix-socket API.

Each runs with small limits (serverkit.FAST_LIMITS: 48 connections, 1.5 s for a request's headers,
3 s idle, 1 s for a response nobody reads), and for every attack the test asserts that the server
closes the attacker's connections, that an honest request is still answered (retried within a
bounded wait, no timing asserted), that its memory stays bounded and that its log has no traceback.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.boards import free_port
from tests.support.serverkit import (
    FAST_LIMITS,
    ROOT,
    Server,
    closed_within,
    read_until_closed,
    running_servers,
    status_of,
)

CAP = int(FAST_LIMITS["PATCHSWARM_HTTP_MAX_CONNECTIONS"])
MAX_GROWTH_KIB = 64 << 10  # RSS a server may gain over one attack
NAMES = ["seed", "board", "sidecar", "api"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with running_servers(tmp_path_factory.mktemp("slow")) as started:
        yield {s.name: s for s in started}


@pytest.fixture(params=NAMES)
def server(request: pytest.FixtureRequest, servers: dict[str, Server]) -> Iterator[Server]:
    s = servers[request.param]
    s.honest()
    before = s.rss_kib()
    yield s
    assert s.alive(), s.log_text()[-2000:]
    s.honest()
    assert s.rss_kib() - before < MAX_GROWTH_KIB
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def _all_closed(socks: list[socket.socket], timeout: float, drip: bytes = b"") -> list[socket.socket]:
    """Wait up to ``timeout`` for the server to close each socket, sending one byte of ``drip`` to
    each every 0.3 s meanwhile (slowloris); returns the sockets still open at the end."""
    open_ = list(socks)
    end = time.monotonic() + timeout
    sent = 0
    while open_ and time.monotonic() < end:
        if drip:
            byte = drip[sent % len(drip) : sent % len(drip) + 1]
            sent += 1
            for s in list(open_):
                try:
                    s.send(byte)
                except OSError:
                    open_.remove(s)
        ready, _, _ = select.select(open_, [], [], 0.3)
        for s in ready:
            try:
                if s.recv(1 << 16):
                    continue
            except OSError:
                pass
            open_.remove(s)
    return open_


def test_half_open_and_slowloris_connections_are_closed(server: Server) -> None:
    half_open = [server.connect() for _ in range(12)]
    slow = [server.connect() for _ in range(24)]
    for s in slow:
        s.sendall(f"GET {server.honest_path} HTTP/1.1\r\nHost: x\r\n".encode())
    try:
        # (honest requests are answered meanwhile: the attackers hold 36 of the 48 connections)
        assert server.honest() == 200
        left = _all_closed(half_open + slow, timeout=20, drip=b"X-Slow: a\r\n")
        assert not left, f"{len(left)} slow connections still open"
    finally:
        for s in half_open + slow:
            s.close()


def test_slow_readers_are_cut_off(server: Server) -> None:
    """Pipelined requests for large answers, never read: the server's send buffer stays full, and
    it drops the connection before it has sent them all."""
    request = server.request(server.big_path, keep_alive=True) * server.big_count
    readers = []
    for _ in range(3):
        s = server.connect()
        s.setblocking(False)
        readers.append((s, memoryview(request)))
    try:
        # Keep writing the requests (the server reads them as it answers) until all are sent or the
        # server stops taking them for a while (its answers fill the socket and it stops reading).
        end = time.monotonic() + 6
        while time.monotonic() < end:
            pending = [(s, rest) for s, rest in readers if rest]
            _, writable, _ = select.select([], [s for s, _ in pending], [], 0.5)
            if not writable:
                break
            for i, (s, rest) in enumerate(readers):
                if s in writable and rest:
                    try:
                        readers[i] = (s, rest[s.send(rest) :])
                    except OSError:
                        readers[i] = (s, rest[:0])
        assert server.honest() == 200
        time.sleep(max(0.0, end - 2 - time.monotonic()))  # never read for 4 s: 4 send timeouts
        for s, _ in readers:
            s.setblocking(True)
            got = read_until_closed(s, timeout=20)
            answers = got.count(b"HTTP/1.1 200")
            assert answers < server.big_count, "the server sent everything: nothing cut the slow reader off"
            assert closed_within(s, 1), "the slow reader's connection is still open"
    finally:
        for s, _ in readers:
            s.close()


def test_idle_keepalive_connections_beyond_the_cap(server: Server) -> None:
    """CAP connections each make a keep-alive request and idle; more are refused at once, the
    established ones keep working, and the server closes them all once idle too long."""
    held: list[socket.socket] = []
    try:
        for _ in range(CAP):
            s = server.connect()
            s.sendall(server.request(server.honest_path, keep_alive=True))
            held.append(s)
        statuses = [status_of(_first_reply(s)) for s in held]
        assert statuses.count(200) >= CAP - 4, statuses  # (an honest probe of the fixture may hold one)
        served = [s for s, st in zip(held, statuses, strict=True) if st == 200]
        extra = [server.connect() for _ in range(16)]
        held += extra
        for s in extra:
            with contextlib.suppress(OSError):  # (refused and closed before it sent: a broken pipe)
                s.sendall(server.request(server.honest_path, keep_alive=True))
            reply = read_until_closed(s, timeout=10)
            assert status_of(reply) in (0, 503), reply[:200]  # refused, and closed
        for s in served:  # the established connections are untouched
            s.sendall(server.request(server.honest_path, keep_alive=True))
            assert status_of(_first_reply(s)) == 200
        left = _all_closed(served, timeout=20)
        assert not left, f"{len(left)} idle keep-alive connections still open"
    finally:
        for s in held:
            s.close()


def _first_reply(s: socket.socket, timeout: float = 10) -> bytes:
    """The next whole reply on ``s`` (headers, and a body of its Content-Length); what came if it closed."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(1 << 16)
        if not piece:
            return data
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    while len(body) < length:
        piece = s.recv(length - len(body))
        if not piece:
            break
        body += piece
    return head + b"\r\n\r\n" + body


def test_limits_from_environment_are_checked(tmp_path: Path) -> None:
    from patchswarm.swarm.serving import ServerLimits

    assert ServerLimits.from_env({"PATCHSWARM_HTTP_HEADER_TIMEOUT": "2.5"}).header_timeout_s == 2.5
    with pytest.raises(ValueError, match="PATCHSWARM_HTTP_MAX_CONNECTIONS"):
        ServerLimits.from_env({"PATCHSWARM_HTTP_MAX_CONNECTIONS": "many"})
    with pytest.raises(ValueError, match="PATCHSWARM_HTTP_IDLE_TIMEOUT"):
        ServerLimits.from_env({"PATCHSWARM_HTTP_IDLE_TIMEOUT": "0"})


def test_one_address_cannot_take_every_connection(tmp_path: Path) -> None:
    """The plain board server, loopback not exempt, 4 connections per address: a fifth idle one from
    127.0.0.1 is answered 503 and closed, the four are untouched, a client on 127.0.0.2 is served,
    and once the four are gone 127.0.0.1 is served again."""
    (tmp_path / "board" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "board" / "runs" / "r" / "head").write_bytes(b"head")
    port = free_port()
    log = tmp_path / "board.log"
    env = {
        **os.environ,
        **FAST_LIMITS,
        "PATCHSWARM_HTTP_IDLE_TIMEOUT": "30",  # (the held connections stay for the whole test)
        "PATCHSWARM_HTTP_HEADER_TIMEOUT": "30",
        "PATCHSWARM_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "4",
        "PATCHSWARM_HTTP_EXEMPT_LOOPBACK": "0",
    }
    args = ["-m", "patchswarm.daemon.cli", "seed", "--board", str(tmp_path / "board"), "--listen", f"127.0.0.1:{port}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server("board", proc, log, port=port, honest_path="/runs/r/head")
    held: list[socket.socket] = []
    try:
        server.honest(deadline_s=60)
        for _ in range(4):  # idle: connected, nothing sent
            held.append(server.connect())
        s = server.connect()
        held.append(s)
        reply = read_until_closed(s, timeout=10)
        assert status_of(reply) == 503 and b"Retry-After" in reply, reply[:200]
        for s in held[:4]:  # the four are still open, and served
            s.sendall(server.request(server.honest_path, keep_alive=True))
            assert status_of(_first_reply(s)) == 200
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        other.bind(("127.0.0.2", 0))
        other.settimeout(10)
        other.connect(("127.0.0.1", port))
        held.append(other)
        other.sendall(server.request(server.honest_path))
        assert status_of(read_until_closed(other, timeout=10)) == 200
        for s in held[:4]:
            s.close()
        assert server.honest(deadline_s=30) == 200  # (retried until the server has seen them go)
        assert "HTTP connections from 127.0.0.1 past its cap (4): refusing" in log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(15)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_descriptors_the_server_neither_spins_nor_dies(tmp_path: Path) -> None:
    """The plain board server with 40 descriptors at most (hard limit: it cannot raise it): 80
    connections leave accept() failing with EMFILE; it pauses accepting instead of spinning, logs a
    line, and serves again once they are gone."""
    (tmp_path / "board" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "board" / "runs" / "r" / "head").write_bytes(b"head")
    port = free_port()
    log = tmp_path / "board.log"
    env = {**os.environ, **FAST_LIMITS, "PATCHSWARM_HTTP_MAX_CONNECTIONS": "1000"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "patchswarm.daemon.cli",
                "seed",
                "--board",
                str(tmp_path / "board"),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40)),
        )
    server = Server("board", proc, log, port=port, honest_path="/runs/r/head")
    held: list[socket.socket] = []
    try:
        server.honest(deadline_s=60)
        held = [server.connect() for _ in range(80)]  # (the kernel queues what the server cannot accept)
        before = _cpu_s(proc.pid)
        time.sleep(3)
        assert _cpu_s(proc.pid) - before < 1.5, "the accept loop spins"
        assert "Too many open files" in log.read_text(), log.read_text()[-2000:]
        for s in held:
            s.close()
        assert server.honest() == 200
        assert proc.poll() is None
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(15)

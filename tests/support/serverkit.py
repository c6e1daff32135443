"""The project's four HTTP servers as real processes, for the slow-client suite, the HTTP fuzz test and
benchmarks/http_fuzz.py: a seed node (``patchswarm seed --run``, the peer endpoints), the plain board
server (``patchswarm seed --board``), the sidecar and the daemon's unix-socket API (tests/support/server_worker.py).

Each :class:`Server` knows an honest request (answered 200) and a large answer a slow reader can
pipeline, and speaks raw bytes over its socket: a test sends what it likes and reads what comes back.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.trust import RootDocument
from tests.support.boards import Keys, free_port

ROOT = Path(__file__).parents[2]
RUN = "serve-run"
SECRET = b"s" * 32

# Small deadlines so a test sees each one fire within seconds (swarm/serving.py ServerLimits).
FAST_LIMITS = {
    "PATCHSWARM_HTTP_MAX_CONNECTIONS": "48",
    "PATCHSWARM_HTTP_HEADER_TIMEOUT": "1.5",
    "PATCHSWARM_HTTP_IDLE_TIMEOUT": "3",
    "PATCHSWARM_HTTP_BODY_TIMEOUT": "2",
    "PATCHSWARM_HTTP_SEND_TIMEOUT": "1",
}


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0  # TCP on 127.0.0.1, or
    socket_path: str = ""  # a unix socket
    honest_path: str = "/"
    big_path: str = "/"  # a large answer (slow readers pipeline it)
    big_count: int = 8  # pipelined big requests that fill the socket buffers several times over

    def connect(self, timeout: float = 10.0) -> socket.socket:
        if self.socket_path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(self.socket_path)
        else:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return s

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.socket_path:
            return await asyncio.open_unix_connection(self.socket_path)
        return await asyncio.open_connection("127.0.0.1", self.port)

    def request(self, path: str, *, keep_alive: bool = False, headers: str = "") -> bytes:
        conn = "keep-alive" if keep_alive else "close"
        return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: {conn}\r\n{headers}\r\n".encode()

    def exchange(self, data: bytes, timeout: float = 10.0) -> bytes:
        """Send ``data`` and read until the server closes (or ``timeout``).  (No half-close: aiohttp
        takes a client's end of input as the end of the connection.)"""
        with self.connect(timeout) as s:
            try:
                s.sendall(data)
            except OSError:
                pass  # the server closed first (a refusal): read what it said
            return read_until_closed(s, timeout)

    def honest(self, deadline_s: float = 20.0) -> int:
        """The status of the honest request, retried while refused (503, connection errors) until
        the deadline; AssertionError if it never gets an answer."""
        end = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < end:
            try:
                reply = self.exchange(self.request(self.honest_path), timeout=5.0)
            except OSError as e:
                last = repr(e)
            else:
                status = status_of(reply)
                if status == 200:
                    return status
                last = reply[:200].decode("latin-1")
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: no honest answer within {deadline_s} s (last: {last})")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


def status_of(reply: bytes) -> int:
    """The status of the first response in ``reply``, 0 if there is none."""
    head = reply.split(b"\r\n", 1)[0].split()
    if len(head) >= 2 and head[0].startswith(b"HTTP/1.") and head[1].isdigit():
        return int(head[1])
    return 0


def read_until_closed(s: socket.socket, timeout: float) -> bytes:
    """Everything the peer sends until it closes; a reset counts as closed; stops at ``timeout``."""
    end = time.monotonic() + timeout
    parts: list[bytes] = []
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([s], [], [], left)
        if not ready:
            break
        try:
            piece = s.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not piece:
            break
        parts.append(piece)
    return b"".join(parts)


def closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``s`` within ``timeout`` (whatever it sends first is read and dropped)."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([s], [], [], left)
        if not ready:
            return False
        try:
            if not s.recv(1 << 16):
                return True
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            return True
    return False


def make_board(tmp: Path) -> tuple[Path, list[str]]:
    """A board with one published version of 8 MiB in 1 MiB chunks; returns its root and chunk names."""
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    board = Board(tmp / "board")
    pub = Publisher(board, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), chunk_size=1 << 20)
    gen = torch.Generator().manual_seed(0)
    pub.publish({"w": torch.randn(2048, 2048, generator=gen)})
    board.put_root(1, RootDocument(1, (keys.root.key_id,), ()).sign(keys.root).to_bytes())
    chunks = sorted(p.name for p in (board.root / "chunks").iterdir() if p.stat().st_size >= 1 << 19)
    assert len(chunks) >= 4, chunks
    return board.root, chunks


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=out, env={**os.environ, **env}
        )


def _wait_listening(proc: subprocess.Popen[bytes], log: Path, what: str) -> dict[str, object]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        raise AssertionError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
    event: dict[str, object] = json.loads(line)
    return event


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"board server did not start: {log.read_text(errors='replace')[-2000:]}")


@contextmanager
def running_servers(tmp: Path, env: dict[str, str] | None = None) -> Iterator[list[Server]]:
    """The four servers, started at once (limits from ``env``, FAST_LIMITS by default), stopped after."""
    env = dict(FAST_LIMITS if env is None else env)
    board, chunks = make_board(tmp)
    (tmp / "secret").write_bytes(SECRET)
    cli = ["-m", "patchswarm.daemon.cli", "seed", "--board", str(board)]
    seed_port, board_port, sidecar_port = free_port(), free_port(), free_port()
    head = f"runs/{RUN}/head"
    logs = {name: tmp / f"{name}.log" for name in ("seed", "board", "sidecar", "api")}
    procs = {
        "seed": _spawn(
            [*cli, "--listen", f"127.0.0.1:{seed_port}", "--run", RUN, "--secret-file", str(tmp / "secret")]
            + ["--copy-window", "0", "--max-uploads", "64"],
            logs["seed"],
            env,
        ),
        "board": _spawn([*cli, "--listen", f"127.0.0.1:{board_port}"], logs["board"], env),
        "sidecar": _spawn(["-m", "tests.support.server_worker", "sidecar", str(sidecar_port)], logs["sidecar"], env),
        "api": _spawn(["-m", "tests.support.server_worker", "api", str(tmp / "api.sock")], logs["api"], env),
    }
    servers: list[Server] = []
    try:
        _wait_listening(procs["seed"], logs["seed"], "seed --run")
        _wait_port(board_port, procs["board"], logs["board"])
        _wait_listening(procs["sidecar"], logs["sidecar"], "sidecar")
        _wait_listening(procs["api"], logs["api"], "api")
        servers = [
            Server(
                "seed",
                procs["seed"],
                logs["seed"],
                port=seed_port,
                honest_path=f"/swarm/v1/board/{head}",
                big_path=f"/swarm/v1/chunks/{chunks[0]}",
                big_count=16,
            ),
            Server(
                "board",
                procs["board"],
                logs["board"],
                port=board_port,
                honest_path=f"/{head}",
                big_path=f"/chunks/{chunks[0]}",
                big_count=16,
            ),
            Server(
                "sidecar",
                procs["sidecar"],
                logs["sidecar"],
                port=sidecar_port,
                honest_path="/generate",
                big_path="/big",
                big_count=8,
            ),
            Server(
                "api",
                procs["api"],
                logs["api"],
                socket_path=str(tmp / "api.sock"),
                honest_path="/v1/status",
                big_path="/v1/status",
                big_count=4000,
            ),
        ]
        yield servers
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

"""The swarm's board route on a real ``patchswarm seed --run`` with 16 MiB chunks (issue 31, review
finding 1): ``/swarm/v1/board/chunks/<hash>`` is not there (a chunk goes out only through
``/swarm/v1/chunks``, under the upload slots, the per-requester share and the rate limit), and clients
that ask for a large board object and never read the answer do not each make the seed hold a copy.

Before the fix, 40 never-reading clients of the board route took a seed with 32 MiB chunks from
303 MiB to 2.8 GiB of memory; every reply held its own copy of the file it sent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.trust import RootDocument
from tests.support.boards import Keys, free_port

ROOT = Path(__file__).resolve().parents[2]
RUN = "route-run"
SECRET = b"r" * 32
CHUNK = 16 << 20
FILLER = 4 << 20  # a board object as large as a big model's manifest gets (the route serves its bytes as they are)
CLIENTS = 48
BOUND = 64 << 20  # CLIENTS copies of FILLER would take 192 MiB


@dataclass
class Seed:
    proc: subprocess.Popen[bytes]
    port: int
    board: Board
    chunks: list[str]
    log: Path

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seed]:
    tmp = tmp_path_factory.mktemp("route")
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    board = Board(tmp / "board")
    pub = Publisher(board, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), chunk_size=CHUNK)
    pub.publish({"w": torch.randn(4096, 2048, generator=torch.Generator().manual_seed(0))})  # 32 MiB
    board.put_root(1, RootDocument(1, (keys.root.key_id,), ()).sign(keys.root).to_bytes())
    chunks = sorted(p.name for p in (board.root / "chunks").iterdir() if p.stat().st_size >= 8 << 20)
    assert chunks, "no large chunk"  # (stored compressed: ~12 MiB)
    (tmp / "secret").write_bytes(SECRET)
    port = free_port()
    log = tmp / "seed.log"
    args = ["seed", "--board", str(board.root), "--listen", f"127.0.0.1:{port}", "--run", RUN]
    args += ["--secret-file", str(tmp / "secret"), "--name", "seed"]
    with open(log, "wb") as out:  # (environment inherited: PYTHONPATH names this worktree)
        proc = subprocess.Popen(
            [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=ROOT, stdout=out, stderr=out
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"seed did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.05)
    yield Seed(proc, port, board, chunks, log)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(20)


def get(port: int, target: str, timeout: float = 30) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        parts = []
        while piece := sock.recv(1 << 20):
            parts.append(piece)
            assert sum(map(len, parts)) <= CHUNK + (1 << 16), "an endless answer"
    head, _, body = b"".join(parts).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_board_route_serves_no_chunk_and_the_chunk_route_does(seed: Seed) -> None:
    for name in seed.chunks:
        assert get(seed.port, f"/swarm/v1/board/chunks/{name}")[0] == 404
        assert get(seed.port, f"/swarm/v1/board/chunks%2F{name}")[0] == 404
        status, body = get(seed.port, f"/swarm/v1/chunks/{name}")
        assert status == 200
        assert body == (seed.board.root / "chunks" / name).read_bytes()
    head = head_rel(RUN)
    assert get(seed.port, f"/swarm/v1/board/{head}") == (200, (seed.board.root / head).read_bytes())
    assert seed.proc.poll() is None


def test_never_reading_clients_of_a_large_board_object_share_one_copy(seed: Seed) -> None:
    rel = f"manifests/{'ab' * 32}"
    data = os.urandom(FILLER)
    (seed.board.root / rel).write_bytes(data)
    assert get(seed.port, f"/swarm/v1/board/{rel}") == (200, data)
    before = seed.rss()
    stalled: list[socket.socket] = []
    try:
        for _ in range(CLIENTS):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little of the reply
            s.connect(("127.0.0.1", seed.port))
            s.sendall(f"GET /swarm/v1/board/{rel} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 4)
            stalled.append(s)
        for s in stalled:  # every reply has begun: the seed sent its headers
            s.settimeout(30)
            assert s.recv(64).startswith(b"HTTP/1.1 200"), "no reply"
        # An honest request is answered meanwhile: the seed's loop is not stuck behind them.
        head = head_rel(RUN)
        assert get(seed.port, f"/swarm/v1/board/{head}")[0] == 200
        time.sleep(1)  # (whatever the replies would buffer, they have by now)
        grown = seed.rss() - before
        assert grown < BOUND, f"the seed grew {grown >> 20} MiB for {CLIENTS} clients that read nothing"
    finally:
        for s in stalled:
            s.close()
    assert get(seed.port, f"/swarm/v1/board/{rel}") == (200, data)
    assert "Traceback" not in seed.log.read_text(errors="replace")

"""A seed serves its board and nothing else (issue 31, defect 1), as real processes on loopback.

``patchswarm seed --board`` (the static board server) and ``patchswarm seed --run`` (the same plus
the swarm's ``/swarm/v1/board/<path>`` and ``/swarm/v1/chunks/<hash>``) get raw requests, sent
byte for byte so no client normalizes them, with every encoding of ``/`` and ``..`` that reaches
the handlers (aiohttp percent-decodes the path), absolute paths, NULs, backslashes, overlong
UTF-8, and names of files an attacker or a careless operator put in the board: symlinks out of
it, a FIFO, /dev/zero, a huge sparse file.  The trainer's signing key sits inside the board
directory and next to it.  Each request gets a 404, never a byte of the key; afterwards the
seed still serves its files, and its memory did not grow by more than a bound far below what
reading any of those files would take.
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
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.board import Board
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.files import confined_parts, open_confined, read_confined
from tests.support.boards import free_port
from tests.support.swarmkit import RUN, SECRET, Swarm

ROOT = Path(__file__).resolve().parents[2]
KEY_MARK = b"PRIVATE KEY"  # in the PEM of every signing key
SPARSE = 512 << 20  # bigger than any board file may be (chunks and manifests: 64 MiB)
RSS_GROWTH = 96 << 20  # reading any of the hostile files would take more than this
FIFO_HASH = "ee" * 32  # chunk names (hex) that are not chunks
ZERO_HASH = "dd" * 32
LINK_HASH = "ff" * 32


@dataclass
class SeedProc:
    proc: subprocess.Popen[bytes]
    port: int
    board: Board
    key_outside: Path

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")


def hostile_board(tmp: Path) -> tuple[Swarm, Path]:
    """A published board with the trainer's key inside and next to it, and traps in its folders."""
    s = Swarm(tmp)
    s.publish()
    board = s.board.root
    s.trainer.save(board / "trainer.key")
    outside = tmp / "outside.key"
    s.trainer.save(outside)
    (board / "chunks" / "link").symlink_to(outside)
    (board / "chunks" / LINK_HASH).symlink_to(outside)
    (board / "chunks" / "rel-link").symlink_to("../trainer.key")
    (board / "certs" / "abs-link").symlink_to(board / "trainer.key")
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "head").write_bytes(outside.read_bytes())
    (board / "runs" / "evil").symlink_to(tmp / "elsewhere")
    os.mkfifo(board / "chunks" / "fifo")
    os.mkfifo(board / "chunks" / FIFO_HASH)
    os.mkfifo(board / "runs" / RUN / "fifo")
    (board / "chunks" / "zero").symlink_to("/dev/zero")
    (board / "chunks" / ZERO_HASH).symlink_to("/dev/zero")
    (board / "trust").mkdir(exist_ok=True)
    (board / "trust" / "root.9").symlink_to("/dev/zero")
    with open(board / "manifests" / ("ab" * 32), "wb") as fh:
        fh.truncate(SPARSE)
    with open(board / "chunks" / ("cd" * 32), "wb") as fh:
        fh.truncate(SPARSE)
    (tmp / "secret").write_bytes(SECRET)
    return s, outside


def start_seed(tmp: Path, *, run: bool) -> SeedProc:
    s, outside = hostile_board(tmp)
    port = free_port()
    args = ["seed", "--board", str(s.board.root), "--listen", f"127.0.0.1:{port}"]
    if run:
        args += ["--run", RUN, "--secret-file", str(tmp / "secret"), "--name", "seed"]
    log = open(tmp / "seed.log", "wb")  # noqa: SIM115 (the process writes it until the fixture ends)
    proc = subprocess.Popen([sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=ROOT, stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"seed did not start: {(tmp / 'seed.log').read_text()[-2000:]}") from None
            time.sleep(0.05)
    return SeedProc(proc, port, s.board, outside)


def stop(seed: SeedProc) -> None:
    if seed.proc.poll() is None:
        seed.proc.send_signal(signal.SIGTERM)
        try:
            seed.proc.wait(20)
        except subprocess.TimeoutExpired:
            seed.proc.kill()
            seed.proc.wait(20)


@pytest.fixture(scope="module")
def board_seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeedProc]:
    seed = start_seed(tmp_path_factory.mktemp("board-seed"), run=False)
    yield seed
    stop(seed)


@pytest.fixture(scope="module")
def run_seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeedProc]:
    seed = start_seed(tmp_path_factory.mktemp("run-seed"), run=True)
    yield seed
    stop(seed)


def raw_get(port: int, target: str | bytes, timeout: float = 20) -> tuple[int, bytes]:
    """A GET with the request target exactly as given; the status and the body."""
    target = target.encode("latin-1") if isinstance(target, str) else target
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        parts = []
        while piece := sock.recv(1 << 16):
            parts.append(piece)
            assert sum(map(len, parts)) < 16 << 20, "an endless answer"
    response = b"".join(parts)
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def hostile_targets(seed: SeedProc) -> list[str]:
    """Names relative to a prefix (``/`` or ``/swarm/v1/board/``) that must not leave the board's files."""
    key = str(seed.key_outside)
    return [
        "..%2Foutside.key",
        "..%2F..%2Foutside.key",
        "%2e%2e/outside.key",
        "%2e%2e%2foutside.key",
        "%2E%2E%2Foutside.key",
        "chunks/..%2Ftrainer.key",
        "chunks/..%2F..%2Foutside.key",
        "chunks%2F..%2F..%2Foutside.key",
        "chunks/%2e%2e/%2e%2e/outside.key",
        "runs/%2e%2e/trainer.key",
        "%2F" + quote(key.lstrip("/"), safe=""),
        quote(key, safe="/").lstrip("/").replace("/", "%2F", 1),
        "/" + quote(key.lstrip("/"), safe="/"),
        "chunks/%2F" + quote(key.lstrip("/"), safe=""),
        "%252F..%252F..%252Foutside.key",
        "chunks%252F..%252F..%252Ftrainer.key",
        "chunks/%252e%252e%252f%252e%252e%252ftrainer.key",
        "chunks\\..\\..\\trainer.key",
        "chunks/..%5C..%5Ctrainer.key",
        "chunks/%5C..%5C..%5Coutside.key",
        "chunks/%00",
        "chunks/link%00",
        "trainer.key%00/x",
        "chunks/x%00/../../trainer.key",
        "%c0%ae%c0%ae%c0%aftrainer.key",
        "chunks/%c0%ae%c0%ae/%c0%ae%c0%ae/outside.key",
        "chunks/%e0%80%ae%e0%80%ae/trainer.key",
        "trainer.key",
        "chunks/link",
        f"chunks/{LINK_HASH}",
        "chunks/rel-link",
        "certs/abs-link",
        "runs/evil/head",
        f"runs/{RUN}/../../trainer.key",
        f"runs/{RUN}/fifo",
        "chunks/fifo",
        f"chunks/{FIFO_HASH}",
        "chunks/zero",
        f"chunks/{ZERO_HASH}",
        "trust/root.9",
        f"manifests/{'ab' * 32}",
        f"chunks/{'cd' * 32}",
        "chunks",
        "chunks/",
        "runs/" + RUN,
    ]


def assert_confined(seed: SeedProc, prefix: str) -> None:
    for rel in hostile_targets(seed):
        status, body = raw_get(seed.port, prefix + rel)
        assert status == 404, (prefix + rel, status)
        assert KEY_MARK not in body, prefix + rel


def honest_files(board: Board, folder: str = "chunks") -> list[str]:
    """The head and a few of ``folder``'s files: regular files of the board's layout, none of them a trap."""
    files = [
        f"{folder}/{p.name}"
        for p in sorted((board.root / folder).iterdir())
        if p.is_file() and not p.is_symlink() and p.stat().st_size < SPARSE
    ]
    return [head_rel(RUN), *files[:3]]


def assert_honest(seed: SeedProc, prefix: str) -> None:
    # The swarm's board route serves no chunks (/swarm/v1/chunks does, under the upload limits).
    swarm = prefix.startswith("/swarm/")
    for rel in honest_files(seed.board, "manifests" if swarm else "chunks"):
        status, body = raw_get(seed.port, prefix + rel)
        assert status == 200, (prefix + rel, status)
        assert body == (seed.board.root / rel).read_bytes()
    if swarm:
        for rel in honest_files(seed.board)[1:]:
            assert raw_get(seed.port, prefix + rel)[0] == 404, prefix + rel


@pytest.mark.parametrize("prefix", ["/"])
def test_board_seed_serves_nothing_outside_its_board(board_seed: SeedProc, prefix: str) -> None:
    before = board_seed.rss()
    assert_confined(board_seed, prefix)
    assert_honest(board_seed, prefix)
    assert board_seed.proc.poll() is None
    assert board_seed.rss() - before < RSS_GROWTH


@pytest.mark.parametrize("prefix", ["/swarm/v1/board/", "/"])
def test_run_seed_serves_nothing_outside_its_board(run_seed: SeedProc, prefix: str) -> None:
    before = run_seed.rss()
    assert_confined(run_seed, prefix)
    assert_honest(run_seed, prefix)
    assert run_seed.proc.poll() is None
    assert run_seed.rss() - before < RSS_GROWTH


def test_run_seed_chunk_endpoint_serves_only_the_boards_chunks(run_seed: SeedProc) -> None:
    """``/swarm/v1/chunks/<hash>``: a name that is hex but a symlink, FIFO, device or huge file is absent."""
    before = run_seed.rss()
    for name in (LINK_HASH, FIFO_HASH, ZERO_HASH, "cd" * 32):
        status, body = raw_get(run_seed.port, f"/swarm/v1/chunks/{name}")
        assert status == 404, (name, status)
        assert KEY_MARK not in body
    real = honest_files(run_seed.board)[1]
    status, body = raw_get(run_seed.port, f"/swarm/v1/{real}")
    assert status == 200 and body == (run_seed.board.root / real).read_bytes()
    assert run_seed.rss() - before < RSS_GROWTH


# ---------------------------------------------------------------- the confinement function itself


def test_confined_parts_refuses_every_way_out() -> None:
    top = {"chunks", "runs"}
    assert confined_parts("chunks/ab", top) == ["chunks", "ab"]
    assert confined_parts("runs/r/head", top) == ["runs", "r", "head"]
    for bad in (
        "",
        "chunks",
        "chunks/",
        "/chunks/ab",
        "chunks//ab",
        "chunks/../x",
        "chunks/./ab",
        "chunks/.ab",
        "chunks\\ab",
        "chunks/a\\b",
        "chunks/a\x00b",
        "chunks/a\nb",
        "manifests/ab",
        "x" * 2000,
    ):
        assert confined_parts(bad, top) is None, bad


def test_read_confined_refuses_symlinks_fifos_and_devices(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "chunks").mkdir(parents=True)
    (root / "chunks" / "ok").write_bytes(b"data")
    (tmp_path / "key").write_bytes(b"secret")
    (root / "chunks" / "link").symlink_to(tmp_path / "key")
    (root / "linked").symlink_to(root / "chunks", target_is_directory=True)
    os.mkfifo(root / "chunks" / "fifo")
    (root / "chunks" / "zero").symlink_to("/dev/zero")
    (root / "chunks" / "dir").mkdir()
    top = {"chunks", "linked"}
    assert read_confined(root, "chunks/ok", top, 4) == b"data"
    for rel in ("chunks/link", "linked/ok", "chunks/fifo", "chunks/zero", "chunks/dir", "chunks/none"):
        assert read_confined(root, rel, top, 1 << 20) is None, rel
        assert open_confined(root, rel, top, 1 << 20) is None, rel
    with pytest.raises(Exception, match="more than the 3 allowed"):
        read_confined(root, "chunks/ok", top, 3)


def test_garbage_collection_leaves_files_the_board_did_not_name(tmp_path: Path) -> None:
    """A board's collector deletes its own manifests and chunks only: a stray name is not a crash."""
    s = Swarm(tmp_path)
    s.publish()
    board = s.board.root
    os.mkfifo(board / "chunks" / "fifo")
    (board / "chunks" / "link").symlink_to(tmp_path / "elsewhere")
    (board / "manifests" / "README").write_text("notes")
    (board / "chunks" / ("AB" * 32)).write_bytes(b"upper-case hex: not a name the board writes")
    assert s.board.collect_garbage([]) > 0
    assert sorted(p.name for p in (board / "chunks").iterdir()) == sorted(["fifo", "link", "AB" * 32])
    assert [p.name for p in (board / "manifests").iterdir()] == ["README"]


PIECES = ["chunks", "runs", "r", "head", "ok", "..", ".", "", "/", "%2F", "\\", "\x00", "link", "up", "key", "é", "~"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=8), sep=st.sampled_from(["/", ""]))
def test_read_confined_returns_a_file_of_the_board_or_nothing(tmp_path: Path, parts: list[str], sep: str) -> None:
    """Whatever name a peer sends, what comes back is one of the board's own files, or None."""
    root = tmp_path / "root"
    if not root.exists():
        (root / "chunks").mkdir(parents=True)
        (root / "runs" / "r").mkdir(parents=True)
        (root / "chunks" / "ok").write_bytes(b"chunk")
        (root / "runs" / "r" / "head").write_bytes(b"head")
        (tmp_path / "key").write_bytes(b"secret")
        (root / "chunks" / "link").symlink_to(tmp_path / "key")
        (root / "runs" / "up").symlink_to(tmp_path, target_is_directory=True)
    got = read_confined(root, sep.join(parts), {"chunks", "runs"}, 1 << 10)
    assert got in (None, b"chunk", b"head")

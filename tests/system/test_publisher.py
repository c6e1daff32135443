"""Publisher behaviour: background mode, crash safety (kill -9 at random points)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.errors import PublisherBehindError
from patchswarm.protocol.head import Head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller
from tests.support.boards import Keys, board_files

KILLS = 8


def test_background_mode_returns_futures_and_reports_falling_behind(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id="bg", background=True, queue_size=1)
    gate = threading.Event()
    real = pub._publish

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(timeout=30)
        return real(*args, **kwargs)

    pub._publish = slow  # type: ignore[method-assign]
    weights = {"w": torch.randn(64, 64)}
    first = pub.publish(weights)  # taken by the worker, blocked on the gate
    assert isinstance(first, Future)
    deadline = time.monotonic() + 10
    while pub._queue is not None and pub._queue.unfinished_tasks and not pub._queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    weights["w"] += 1e-3
    second = pub.publish(weights)  # waits in the queue
    with pytest.raises(PublisherBehindError, match="behind"):
        pub.publish(weights)
    gate.set()
    assert isinstance(second, Future)
    infos = [first.result(timeout=30), second.result(timeout=30)]
    assert [i.version for i in infos] == [1, 2] and all(isinstance(i, PublishInfo) for i in infos)
    pub.close()
    assert pub.version == 2


def check_board(board: Board, keys: Keys, run: str) -> int:
    """The head names only complete, verifiable versions; returns the head version (0: no head)."""
    data = board.read(head_rel(run))
    if data is None:
        return 0
    head = Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)
    names = board_files(board)
    for e in head.catalog:
        m = board.manifest(e.manifest_id)
        assert all(f"chunks/{c.hash.hex()}" in names for c in m.chunks)
    held = asyncio.run(Puller(DirSource(board.root), TrustState(keys.root.key_id), run).catch_up(None))
    assert held.version == head.version
    return head.version


@pytest.mark.slow
def test_publisher_killed_at_random_points_leaves_the_board_valid(tmp_path: Path) -> None:
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    keys.trainer.save(tmp_path / "trainer.key")
    (tmp_path / "cert").write_bytes(keys.certificate("crash"))
    board = Board(tmp_path / "board")
    rng = random.Random(1234)
    last = 0
    for i in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.publisher_worker", str(board.root), "crash"]
            + [str(tmp_path / "trainer.key"), str(tmp_path / "cert"), str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one version per life, so the chain moves on
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        version = check_board(board, keys, "crash")
        assert version > last  # resumed from the board and never rewound
        last = version

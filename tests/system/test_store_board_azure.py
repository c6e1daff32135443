"""Boards in Azure Blob, on a real Azurite process on loopback (the emulator speaks the Blob REST API,
conditional headers included): the same obstore code path as S3, with Azure's ETags and
If-Match / If-None-Match.  Skipped, with a message, where Azurite is not installed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.board import HeadRaceError
from patchswarm.daemon.board_store import StoreBoard, open_board
from patchswarm.daemon.head_refresh import board_head, refresh_board_head
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import source_for
from patchswarm.swarm.board_store import StoreCredentialsError
from patchswarm.swarm.puller import Puller
from tests.support.azurite import Azurite, azurite_server
from tests.support.boards import Keys

RUN = "run-az"


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    with azurite_server(tmp_path_factory.mktemp("azurite")) as a:
        yield a


@pytest.fixture
def az(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> Azurite:
    for k, v in azurite.env().items():
        monkeypatch.setenv(k, v)
    return azurite


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(96, 64, generator=g) for i in range(3)}


def served(w: dict[str, torch.Tensor]) -> ServedModel:
    return ServedModel.from_tensors(ServedFormat("bf16").convert(w))


def pull(url: str, keys: Keys) -> ServedModel:
    async def go() -> ServedModel:
        src = source_for(url)
        try:
            return (await Puller(src, TrustState(keys.root.key_id), RUN).catch_up(None)).model
        finally:
            await src.close()

    return asyncio.run(go())


def test_publish_and_pull_an_azure_board_bitwise(az: Azurite, keys: Keys) -> None:
    url = f"az://{az.new_container()}/boards/a"
    pub = Publisher(
        url, keys.trainer, run_id=RUN, anchor_every=2, keep_anchors=1, certificate=keys.certificate(RUN), refresh=False
    )
    assert isinstance(pub.board, StoreBoard)
    w = weights(0)
    for v in range(1, 5):
        assert getattr(pub.publish(w), "version", None) == v
        assert pull(url, keys).bitwise_equal(served(w))
        for t in w.values():
            t[: v + 1] += 0.01
    pub.close()
    again = Publisher(url, keys.trainer, run_id=RUN, anchor_every=2, keep_anchors=1, refresh=False)
    assert again.version == 4  # resumed from the container


def test_the_azure_head_is_compare_and_swap(az: Azurite, keys: Keys) -> None:
    board = open_board(f"az://{az.new_container()}/cas")
    assert isinstance(board, StoreBoard)
    with board.head_slot("r") as a, board.head_slot("r") as b:
        a.write(b"one")
        with pytest.raises(HeadRaceError):
            b.write(b"two")
    with board.head_slot("r") as a, board.head_slot("r") as b:
        b.write(b"three")
        with pytest.raises(HeadRaceError):
            a.write(b"four")
    assert board.read(head_rel("r")) == b"three"

    url = f"az://{az.new_container()}/race"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False)
    pub.publish(weights(1))
    pub.close()
    start = board_head(pub.board, RUN)
    assert start is not None
    won: list[tuple[int, int]] = []  # (counter, created_ms) of each head written
    gate = threading.Barrier(3)

    def signer() -> None:
        own = open_board(url)
        gate.wait()
        for _ in range(5):
            try:
                head = refresh_board_head(own, keys.trainer, RUN)
                assert head is not None
                won.append((head.counter, head.created_ms))
            except HeadRaceError:
                pass

    threads = [threading.Thread(target=signer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = board_head(pub.board, RUN)
    assert end is not None
    assert_one_head_per_counter(won, start.counter, end.counter)


def test_a_wrong_azure_key_is_one_clear_error(az: Azurite, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"az://{az.new_container()}/keys"
    Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False).publish(weights(2))
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "d3Jvbmcga2V5IGZvciB0aGUgdGVzdA==")
    with pytest.raises(StoreCredentialsError, match="rejected the credentials") as e:
        pull(url, keys)
    assert "\n" not in str(e.value)


def test_nothing_outside_the_layout_is_read(az: Azurite, tmp_path: Path) -> None:
    board = open_board(f"az://{az.new_container()}/x")
    assert board.read("../escape") is None and board.read("runs/a/head/more") is None


def assert_one_head_per_counter(won: list[tuple[int, int]], start: int, end: int) -> None:
    """Every counter from start + 1 to end was written, each as one head: two writers may both report
    a counter only when they wrote the very same bytes (same key, version, counter and millisecond:
    the second's put failed its condition and found its own bytes there).  A lost update would show
    as one counter written twice with different creation times."""
    by_counter: dict[int, set[int]] = {}
    for counter, created in won:
        by_counter.setdefault(counter, set()).add(created)
    assert sorted(by_counter) == list(range(start + 1, end + 1))
    assert all(len(times) == 1 for times in by_counter.values()), by_counter

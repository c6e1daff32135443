"""A run outlives its trainer process: resume after any pause, head refresh, key rotation.

In-process, with the publisher's clock injected; tests/system/test_run_lifecycle_processes.py runs the
same through real processes under libfaketime."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.head_refresh import HeadWriteError, board_head, refresh_board_head
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.errors import ExpiredError, SignatureError, UntrustedKeyError
from patchswarm.protocol.head import Head, HeadTracker, verify_head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller

RUN = "life"
HOUR = 3600.0
DAY = 86_400.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def certificate(root: SigningKey, key: SigningKey, run: str = RUN, days: float = 30) -> bytes:
    now = int(time.time() * 1000)
    return Certificate(key.key_id, run, now - 60_000, now + int(days * DAY * 1000)).sign(root).to_bytes()


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(32, generator=g)}


def head_of(board: Board) -> Head:
    head = board_head(board, RUN)
    assert head is not None
    return head


def host_view(board: Board, root: SigningKey, clock: Clock, tracker: HeadTracker | None = None) -> tuple[int, int]:
    """What a host that trusts ``root`` reaches now: (version, head counter), fully verified."""
    puller = Puller(DirSource(board.root), TrustState(root.key_id), RUN, clock=clock, tracker=tracker)
    held = asyncio.run(puller.catch_up(None))
    return held.version, puller.tracker.counter


@pytest.fixture
def run(tmp_path: Path) -> tuple[Board, SigningKey, SigningKey, bytes, Clock]:
    root, trainer = SigningKey.generate(), SigningKey.generate()
    return Board(tmp_path / "board"), root, trainer, certificate(root, trainer), Clock()


@pytest.mark.parametrize("silence", [HOUR, 3 * DAY], ids=["1h", "3d"])
def test_the_run_continues_after_trainer_silence(run, silence: float) -> None:  # type: ignore[no-untyped-def]
    board, root, trainer, cert, clock = run
    with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
        pub.publish(weights(1))
        pub.publish(weights(2))
    before = head_of(board)
    clock.now += silence  # the head expired long ago: to a host the board is frozen
    with pytest.raises(ExpiredError, match="frozen"):
        host_view(board, root, clock)

    with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
        resumed = head_of(board)  # re-signed on resume: same version, next counter, fresh expiry
        assert (resumed.version, resumed.catalog) == (before.version, before.catalog)
        assert resumed.counter == before.counter + 1
        assert resumed.expires_ms == int(clock.now * 1000) + pub.head_ttl_ms
        assert host_view(board, root, clock) == (2, resumed.counter)
        info = pub.publish(weights(3))
    assert not hasattr(info, "result") and info.version == 3
    assert host_view(board, root, clock) == (3, resumed.counter + 1)


def test_counters_never_reused_and_versions_never_rewound(run) -> None:  # type: ignore[no-untyped-def]
    board, root, trainer, cert, clock = run
    seen: list[tuple[int, int]] = []
    tracker = HeadTracker(RUN)  # a host that follows every step: it refuses rewinds and reused counters
    policy = TrustState(root.key_id)
    policy.add_certificate(cert)

    def step() -> None:
        data = board.read(head_rel(RUN))
        assert data is not None
        head, env = verify_head(data, policy, now_ms=int(clock.now * 1000), skew_ms=0)
        seen.append((head.counter, head.version))
        assert tracker.accept(head, env)

    for i in range(3):
        clock.now += 2 * DAY
        with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
            if i:
                step()  # the resume's fresh head
            pub.publish(weights(i))
            step()
            clock.now += HOUR
            assert pub.refresh_head()
            step()
        clock.now += HOUR
        assert refresh_board_head(board, trainer, RUN, clock=clock) is not None
        step()
    counters = [c for c, _ in seen]
    assert counters == list(range(counters[0], counters[0] + len(counters)))
    assert [v for _, v in seen] == sorted(v for _, v in seen)


def test_refresh_of_an_expired_head(run) -> None:  # type: ignore[no-untyped-def]
    board, root, trainer, cert, clock = run
    with pytest.raises(HeadWriteError, match="no head"):
        refresh_board_head(board, trainer, RUN, clock=clock)
    with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
        pub.publish(weights(1))
    before = head_of(board)
    clock.now += 3 * DAY
    new = refresh_board_head(board, trainer, RUN, head_ttl=600, clock=clock)
    assert new is not None and new == head_of(board)
    assert (new.version, new.manifest_id, new.catalog) == (before.version, before.manifest_id, before.catalog)
    assert new.counter == before.counter + 1 and new.expires_ms == int(clock.now * 1000) + 600_000
    assert host_view(board, root, clock) == (1, new.counter)
    # A background refresher leaves a head younger than its period alone (another signer just did it).
    assert refresh_board_head(board, trainer, RUN, only_after=60, clock=clock) is None
    # A key the run's root never certified cannot re-sign it.
    with pytest.raises(UntrustedKeyError, match=r"does not trust|cannot sign"):
        refresh_board_head(board, SigningKey.generate(), RUN, certificate=certificate(root, SigningKey.generate()))


def test_two_refreshers_racing_never_fork_the_head(run) -> None:  # type: ignore[no-untyped-def]
    board, root, trainer, cert, clock = run
    pub = Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False)
    pub.publish(weights(1))
    start = head_of(board).counter
    written: list[bytes] = []
    errors: list[BaseException] = []
    real_put = board.put_head

    def put_head(run_id: str, data: bytes) -> None:
        written.append(data)
        time.sleep(0.001)  # widen the window between reading the head and writing the next one
        real_put(run_id, data)

    board.put_head = put_head

    def refresher(n: int) -> None:
        try:
            for _ in range(n):
                refresh_board_head(board, trainer, RUN, clock=clock)
        except BaseException as e:
            errors.append(e)

    def publisher() -> None:
        try:
            for i in range(2, 6):
                pub.publish(weights(i))
                pub.refresh_head()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=refresher, args=(15,)) for _ in range(2)] + [threading.Thread(target=publisher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    heads = [Head.from_bytes(Envelope.from_bytes(d, HEAD_TAG).body) for d in written]
    counters = [h.counter for h in heads]
    assert counters == list(range(start + 1, start + 1 + 30 + 8))  # each one next, none reused, in write order
    versions = [h.version for h in heads]
    assert versions == sorted(versions) and versions[-1] == 5
    tracker = HeadTracker(RUN)  # a host that saw every one of them in turn
    policy = TrustState(root.key_id)
    policy.add_certificate(cert)
    for d in written:
        tracker.accept(*verify_head(d, policy, now_ms=int(clock.now * 1000), skew_ms=0))
    pub.close()


def test_a_newly_certified_key_continues_the_run(run) -> None:  # type: ignore[no-untyped-def]
    board, root, key_a, cert_a, clock = run
    with Publisher(board, key_a, run_id=RUN, certificate=cert_a, clock=clock, refresh=False) as pub:
        pub.publish(weights(1))
    tracker = HeadTracker(RUN)
    assert host_view(board, root, clock, tracker) == (1, head_of(board).counter)

    key_b = SigningKey.generate()
    clock.now += DAY
    with Publisher(board, key_b, run_id=RUN, certificate=certificate(root, key_b), clock=clock, refresh=False) as pub:
        pub.publish(weights(2))
    head = board.read(head_rel(RUN))
    assert head is not None and Envelope.from_bytes(head, HEAD_TAG).key_id == key_b.key_id
    # The same host (same high-water mark, same trust root) takes the handover: no config change.
    assert host_view(board, root, clock, tracker) == (2, head_of(board).counter)

    # A key certified for another run, or revoked since, cannot take the run over.
    key_c = SigningKey.generate()
    with pytest.raises(UntrustedKeyError, match=r"does not trust|cannot sign"):
        Publisher(board, key_c, run_id=RUN, certificate=certificate(root, key_c, run="other"), clock=clock)
    revoke = RootDocument(1, (root.key_id,), (key_b.key_id,))
    board.put_root(1, revoke.sign(root).to_bytes())
    key_d = SigningKey.generate()
    with pytest.raises(UntrustedKeyError, match="revoked"):
        Publisher(board, key_d, run_id=RUN, certificate=certificate(root, key_d), clock=clock)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"head_ttl": 0}, "head_ttl"),
        ({"head_ttl": -5}, "head_ttl"),
        ({"head_ttl": float("nan")}, "head_ttl"),
        ({"head_ttl": 1e12}, "head_ttl"),
        ({"head_ttl_s": 0.0}, "head_ttl"),
        ({"head_ttl": 60, "head_ttl_s": 60}, "head_ttl"),
        ({"run_id": ""}, "run_id"),
        ({"run_id": "../etc"}, "run_id"),
        ({"run_id": ".hidden"}, "run_id"),
        ({"run_id": "x" * 129}, "run_id"),
        ({"run_id": "a b"}, "run_id"),
        ({"chunk_size": 10}, "chunk_size"),
        ({"chunk_size": 1 << 30}, "chunk_size"),
        ({"chunk_size": 4096.5}, "chunk_size"),
        ({"anchor_every": 0}, "anchor_every"),
        ({"anchor_every": True}, "anchor_every"),
        ({"keep_anchors": 0}, "keep_anchors"),
        ({"queue_size": 0}, "queue_size"),
        ({"served_format": "fp3"}, "served format"),
        ({"certificate": "not bytes"}, "certificate"),
    ],
)
def test_publisher_parameters_are_checked_where_they_enter(
    tmp_path: Path, kwargs: dict[str, object], name: str
) -> None:
    args: dict[str, object] = {"run_id": RUN, **kwargs}
    with pytest.raises(ValueError, match=name):
        Publisher(tmp_path / "board", SigningKey.generate(), **args)  # type: ignore[arg-type]
    assert not (tmp_path / "board").exists()  # nothing written


def test_background_refresh_keeps_an_idle_run_fresh_and_stops_on_close(run) -> None:  # type: ignore[no-untyped-def]
    board, _, trainer, cert, _ = run
    pub = Publisher(board, trainer, run_id=RUN, certificate=cert, head_ttl=1.2)
    pub.publish(weights(1))
    first = head_of(board).counter
    deadline = time.monotonic() + 30
    while head_of(board).counter < first + 2:  # re-signed twice while the trainer did nothing
        assert time.monotonic() < deadline, "the idle head was never refreshed"
        time.sleep(0.05)
    pub.close()
    assert pub._refresher is None
    closed = head_of(board).counter
    time.sleep(1.0)  # over two refresh periods: a closed publisher writes nothing more
    assert head_of(board).counter == closed


def test_publish_parameters_are_checked_where_they_enter(run) -> None:  # type: ignore[no-untyped-def]
    board, _, trainer, cert, clock = run
    with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
        with pytest.raises(ValueError, match="anchor"):
            pub.publish(weights(1), anchor="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="model_or_state"):
            pub.publish([torch.zeros(3)])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="world_size"):
            pub.begin_sharded(1 << 20)
        assert pub.version == 0 and board.read(head_rel(RUN)) is None  # nothing taken, nothing written


def test_expiry_is_tolerated_only_when_asked_and_nothing_else_is(run) -> None:  # type: ignore[no-untyped-def]
    board, root, trainer, cert, clock = run
    with Publisher(board, trainer, run_id=RUN, certificate=cert, clock=clock, refresh=False) as pub:
        pub.publish(weights(1))
    data = board.read(head_rel(RUN))
    assert data is not None
    policy = TrustState(root.key_id)
    policy.add_certificate(cert)
    later = int((clock.now + DAY) * 1000)
    with pytest.raises(ExpiredError, match="frozen"):  # what every host does
        verify_head(data, policy, now_ms=later, skew_ms=300_000)
    head, _ = verify_head(data, policy, now_ms=later, skew_ms=0, allow_expired=True)
    assert head == head_of(board)
    env = Envelope.from_bytes(data, HEAD_TAG)
    forged = Envelope(env.tag, env.body, env.key_id, bytes(64)).to_bytes()
    with pytest.raises(SignatureError):
        verify_head(forged, policy, now_ms=later, skew_ms=0, allow_expired=True)
    with pytest.raises(UntrustedKeyError):
        verify_head(data, TrustState(SigningKey.generate().key_id), now_ms=later, skew_ms=0, allow_expired=True)

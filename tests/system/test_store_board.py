"""Boards in an object store, on a real S3-compatible server process (moto) on loopback: the
Publisher and ``patchswarm publish`` write ``s3://`` boards, ``patchswarm pull`` and hosts read them
back bitwise; the head's conditional write keeps racing writers from rewinding or forking it; a
publisher killed mid-upload or an interrupted upload leaves the old head readable and verifiable."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from patchswarm.daemon.board import HeadRaceError
from patchswarm.daemon.board_store import StoreBoard, open_board
from patchswarm.daemon.head_refresh import board_head, refresh_board_head
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import source_for
from patchswarm.swarm.puller import Puller
from tests.support.boards import Keys
from tests.support.moto_server import Moto, clean_env
from tests.support.store_boards import RUN, object_names, pull, served, step, weights

CLI = [sys.executable, "-m", "patchswarm.daemon.cli"]
ROOT = Path(__file__).parents[2]


# ---------------------------------------------------------------- publish and pull


def test_publisher_writes_an_s3_board_hosts_reach_each_head_bitwise(aws: Moto, keys: Keys) -> None:
    bucket = aws.new_bucket()
    url = f"s3://{bucket}/boards/a"
    pub = Publisher(
        url, keys.trainer, run_id=RUN, anchor_every=3, keep_anchors=1, certificate=keys.certificate(RUN), refresh=False
    )
    assert isinstance(pub.board, StoreBoard)
    w = weights(0)
    for v in range(1, 8):
        info = pub.publish(w)
        assert not isinstance(info, Exception) and getattr(info, "version", None) == v
        assert pull(url, keys).bitwise_equal(served(w))  # each head, read through the SDK
        step(w, v)
    pub.close()
    names = object_names(aws, bucket)
    assert all(n.startswith("boards/a/") for n in names)
    head = board_head(pub.board, RUN)
    assert head is not None and head.version == 7
    # Retention ran on the store: exactly the manifests the head lists are left, and their chunks.
    manifests = {n for n in names if n.startswith("boards/a/manifests/")}
    assert manifests == {f"boards/a/manifests/{e.manifest_id.hex()}" for e in head.catalog}
    chunks = {n.rsplit("/", 1)[1] for n in names if n.startswith("boards/a/chunks/")}
    wanted = {ref.hash.hex() for e in head.catalog for ref in pub.board.manifest(e.manifest_id).chunks}
    assert chunks == wanted
    # What a CDN in front of the store may cache: everything but heads, forever.
    s3 = aws.client()
    assert s3.head_object(Bucket=bucket, Key=f"boards/a/{head_rel(RUN)}")["CacheControl"] == "no-cache"
    assert "immutable" in s3.head_object(Bucket=bucket, Key=min(manifests))["CacheControl"]
    # A publisher that comes back resumes the chain from the store.
    again = Publisher(url, keys.trainer, run_id=RUN, anchor_every=3, keep_anchors=1, refresh=False)
    assert again.version == 7
    step(w, 99)
    assert getattr(again.publish(w), "version", None) == 8
    assert pull(url, keys).bitwise_equal(served(w))


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        cwd=cwd,
        env=clean_env(env) | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_cli_publish_and_pull_an_s3_board(moto: Moto, keys: Keys, tmp_path: Path) -> None:
    bucket = moto.new_bucket()
    board = f"s3://{bucket}/cli"
    keys.root.save(tmp_path / "root.key")
    keys.trainer.save(tmp_path / "trainer.key")
    (tmp_path / "cert").write_bytes(keys.certificate(RUN))
    w = weights(1)
    for v in (1, 2):
        save_safetensors(ServedModel.from_tensors(w), tmp_path / "ck.safetensors")
        r = run_cli(
            ["publish", "ck.safetensors", "--board", board, "--key", "trainer.key", "--run-id", RUN, "--cert", "cert"],
            moto.env(),
            tmp_path,
        )
        assert r.returncode == 0, r.stderr
        assert f"published version {v}" in r.stdout
        r = run_cli(
            ["pull", "--from", f"{board}/runs/{RUN}", "--trust", "root.key.pub", "--to", "out.safetensors"],
            moto.env(),
            tmp_path,
        )
        assert r.returncode == 0, r.stderr
        assert load_safetensors(tmp_path / "out.safetensors").bitwise_equal(served(w))
        step(w, 10 + v)
    # A seed of a store board serves a local copy of one run: it needs the run and a place for the copy.
    r = run_cli(["seed", "--board", board, "--listen", "127.0.0.1:0"], moto.env(), tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "give --run RUN and --cache DIR" in r.stderr


# ---------------------------------------------------------------- the head's conditional write


def test_the_head_is_replaced_only_if_it_is_still_the_one_read(aws: Moto) -> None:
    board = open_board(f"s3://{aws.new_bucket()}/cas")
    assert isinstance(board, StoreBoard)
    with board.head_slot("r") as a, board.head_slot("r") as b:  # both see no head: create-only
        assert a.data is None and b.data is None
        a.write(b"head one")
        with pytest.raises(HeadRaceError, match="another publisher writes this run"):
            b.write(b"head two")
    assert board.read(head_rel("r")) == b"head one"
    with board.head_slot("r") as a, board.head_slot("r") as b:  # both read "head one": If-Match its ETag
        assert a.data == b.data == b"head one"
        b.write(b"head three")
        with pytest.raises(HeadRaceError):
            a.write(b"head four")
    assert board.read(head_rel("r")) == b"head three"


def test_concurrent_signers_never_reuse_a_counter(aws: Moto, keys: Keys) -> None:
    """Writers re-signing the same head at once (counter + 1 each): every write that succeeded moved
    the counter by exactly one, so none overwrote another's (a lost update would count twice)."""
    url = f"s3://{aws.new_bucket()}/race"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False)
    pub.publish(weights(2))
    pub.close()
    start = board_head(pub.board, RUN)
    assert start is not None
    won: list[tuple[int, int]] = []  # (counter, created_ms) of each head written
    lost: list[BaseException] = []
    gate = threading.Barrier(4)

    def signer() -> None:
        board = open_board(url)  # a client of its own, as another process would have
        gate.wait()
        for _ in range(6):
            try:
                head = refresh_board_head(board, keys.trainer, RUN)
                assert head is not None
                won.append((head.counter, head.created_ms))
            except HeadRaceError as e:
                lost.append(e)

    threads = [threading.Thread(target=signer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = board_head(pub.board, RUN)
    assert end is not None and end.version == start.version
    assert_one_head_per_counter(won, start.counter, end.counter)
    assert len(won) + len(lost) == 24


def test_two_publishers_cannot_fork_or_rewind_the_head(aws: Moto, keys: Keys) -> None:
    url = f"s3://{aws.new_bucket()}/two"
    cert = keys.certificate(RUN)
    first = Publisher(url, keys.trainer, run_id=RUN, certificate=cert, refresh=False)
    first.publish(weights(3))
    first.close()
    results: dict[str, list[tuple[int, ServedModel]]] = {"a": [], "b": []}
    errors: dict[str, BaseException] = {}
    gate = threading.Barrier(2)

    def publisher(name: str, seed: int) -> None:
        pub = Publisher(url, keys.trainer, run_id=RUN, certificate=cert, refresh=False)  # both resume version 1
        w = weights(3)
        gate.wait()
        try:
            for i in range(6):
                step(w, seed + i)
                info = pub.publish(w)
                results[name].append((getattr(info, "version", -1), served(w)))
        except HeadRaceError as e:
            errors[name] = e
            with pytest.raises(HeadRaceError):  # the loser stays out: nothing more is written
                pub.publish(w)
        finally:
            pub.close()

    threads = [threading.Thread(target=publisher, args=(n, s)) for n, s in (("a", 100), ("b", 200))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) >= 1, "two publishers of one run both went on"
    assert all("another publisher writes this run" in str(e) for e in errors.values())
    head = board_head(open_board(url), RUN)
    assert head is not None
    winner = [n for n in "ab" if any(v == head.version for v, _ in results[n])]
    assert len(winner) == 1  # one history: the head is a version its one publisher wrote
    expected = dict(results[winner[0]])[head.version]
    assert pull(url, keys).bitwise_equal(expected)


# ---------------------------------------------------------------- interrupted writers


def check_board(url: str, keys: Keys, run: str) -> int:
    """The head names only complete, verifiable versions; returns the head version (0: no head)."""
    board = open_board(url)
    head = board_head(board, run)
    if head is None:
        return 0
    for e in head.catalog:
        for ref in board.manifest(e.manifest_id).chunks:
            assert board.read(f"chunks/{ref.hash.hex()}") is not None

    async def go() -> int:
        src = source_for(url)
        try:
            return (await Puller(src, TrustState(keys.root.key_id), run).catch_up(None)).version
        finally:
            await src.close()

    assert asyncio.run(go()) == head.version
    return head.version


@pytest.mark.slow
def test_publisher_killed_mid_upload_leaves_the_board_valid(aws: Moto, keys: Keys, tmp_path: Path) -> None:
    url = f"s3://{aws.new_bucket()}/crash"
    keys.trainer.save(tmp_path / "trainer.key")
    (tmp_path / "cert").write_bytes(keys.certificate("crash"))
    rng = random.Random(35)
    last = 0
    for i in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.publisher_worker", url, "crash"]
            + [str(tmp_path / "trainer.key"), str(tmp_path / "cert"), str(i)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=clean_env(aws.env()) | {"PYTHONPATH": str(ROOT)},
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one version per life, so the chain moves on
        time.sleep(rng.uniform(0.0, 0.8))  # then killed wherever it is: chunk puts, manifest, head
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        version = check_board(url, keys, "crash")
        assert version > last  # resumed from the store and never rewound
        last = version


def worker(url: str, tmp: Path, aws: Moto, seed: int, fault: str | None = None) -> subprocess.Popen[str]:
    env = clean_env(aws.env()) | {"PYTHONPATH": str(ROOT)} | ({"PATCHSWARM_FAULT_AT": fault} if fault else {})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.publisher_worker", url, "crash"]
        + [str(tmp / "trainer.key"), str(tmp / "cert"), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
def test_a_publisher_killed_between_chunks_or_before_the_head_leaves_the_old_head(
    aws: Moto, keys: Keys, tmp_path: Path
) -> None:
    """Killed at set points (PATCHSWARM_FAULT_AT): with half of a version's chunks stored, and with
    its manifest stored but the head not moved.  Each time the store holds objects no head names,
    and readers get the previous head, verified; a publisher started next resumes and moves on."""
    bucket = aws.new_bucket()
    url = f"s3://{bucket}/points"
    keys.trainer.save(tmp_path / "trainer.key")
    (tmp_path / "cert").write_bytes(keys.certificate("crash"))

    def unnamed(folder: str) -> set[str]:
        head = board_head(open_board(url), "crash")
        assert head is not None
        board = open_board(url)
        named = {f"points/manifests/{e.manifest_id.hex()}" for e in head.catalog}
        if folder == "chunks":
            named = {
                f"points/chunks/{r.hash.hex()}" for e in head.catalog for r in board.manifest(e.manifest_id).chunks
            }
        return {n for n in object_names(aws, bucket) if n.startswith(f"points/{folder}/")} - named

    proc = worker(url, tmp_path, aws, 0, fault="board.chunks@2")  # version 1 lands; version 2 dies mid-chunks
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and out.split("\n")[0] == "published 1", out
    assert unnamed("chunks") and not unnamed("manifests")  # it did die with part of version 2 stored
    assert check_board(url, keys, "crash") == 1

    proc = worker(url, tmp_path, aws, 1, fault="board.manifest@1")  # resumes at 1; dies before the head moves
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and "published" not in out, out
    assert unnamed("manifests")
    assert check_board(url, keys, "crash") == 1

    proc = worker(url, tmp_path, aws, 2)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "published 2"
    proc.kill()
    proc.communicate()
    assert check_board(url, keys, "crash") >= 2


def test_an_interrupted_upload_leaves_no_object(aws: Moto, keys: Keys) -> None:
    """A put cut off mid-body (the uploader died): the store keeps nothing, so neither a chunk nor
    the head can ever be half written; the head before it still verifies."""
    bucket = aws.new_bucket()
    url = f"s3://{bucket}/cut"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False)
    w = weights(4)
    pub.publish(w)
    pub.close()
    before = aws.client().get_object(Bucket=bucket, Key=f"cut/{head_rel(RUN)}")["Body"].read()
    port = urlparse(aws.endpoint).port
    for key in (f"cut/{head_rel(RUN)}", "cut/chunks/" + "ab" * 32):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                f"PUT /{bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100000\r\n\r\n".encode()
                + b"x" * 1000
            )
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            with contextlib.suppress(OSError):  # whatever the server answers (or not), once it has seen EOF
                s.recv(1024)
    assert aws.client().get_object(Bucket=bucket, Key=f"cut/{head_rel(RUN)}")["Body"].read() == before
    assert "cut/chunks/" + "ab" * 32 not in object_names(aws, bucket)
    assert check_board(url, keys, RUN) == 1
    assert pull(url, keys).bitwise_equal(served(w))


# ---------------------------------------------------------------- over HTTP(S): 403 is missing


def test_an_anonymous_403_counts_as_missing(aws: Moto, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A public board without public listing: S3 answers an anonymous GET of a key it will not show
    with 403, not 404.  Hosts reading the store's HTTP endpoint (or the SDK unsigned) take it as
    missing, and reach the head over HTTP bitwise."""
    bucket = aws.new_bucket()
    pub = Publisher(f"s3://{bucket}/pub", keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False)
    w = weights(5)
    pub.publish(w)
    pub.close()
    s3 = aws.client()
    for name in object_names(aws, bucket):
        s3.put_object_acl(Bucket=bucket, Key=name, ACL="public-read")
    s3.put_object(Bucket=bucket, Key="pub/runs/private/head", Body=b"not for you")  # private
    http = f"{aws.endpoint}/{bucket}/pub"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{http}/runs/private/head", timeout=10)
    assert refused.value.code == 403  # what the store says: forbidden, not missing

    async def read(url: str, rel: str) -> bytes | None:
        src = source_for(url)
        try:
            return await src.get(rel, 1 << 20)
        finally:
            await src.close()

    assert asyncio.run(read(http, "runs/private/head")) is None
    assert asyncio.run(read(http, f"runs/{RUN}/head")) == pub.board.read(head_rel(RUN))
    assert pull(http, keys).bitwise_equal(served(w))
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")  # the SDK, unsigned: the same answers
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert asyncio.run(read(f"s3://{bucket}/pub", "runs/private/head")) is None
    s3.put_object(Bucket=bucket, Key="pub/extra/x", Body=b"x", ACL="public-read")
    assert asyncio.run(read(f"s3://{bucket}/pub", "extra/x")) is None  # not a board name: not read
    assert pull(f"s3://{bucket}/pub", keys).bitwise_equal(served(w))


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


def test_a_stray_object_in_the_store_fails_no_publish(aws: Moto, keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    """Retention lists manifests/ and chunks/; one object obstore cannot name there (a key holding
    ``..``) failed that listing, and with it every publish that dropped a version, after its head had
    moved.  Now the publish returns, the old versions wait for the next collection, and one line says why."""
    bucket = aws.new_bucket()
    url = f"s3://{bucket}/gc"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), anchor_every=1, keep_anchors=1)
    w = weights(11)
    pub.publish(w)
    aws.client().put_object(Bucket=bucket, Key="gc/chunks/../stray", Body=b"stray")
    for i in range(2):
        step(w, 110 + i)
        with caplog.at_level(logging.WARNING, logger="patchswarm.publisher"):
            info = pub.publish(w)
        assert getattr(info, "version", None) == i + 2
    pub.close()
    head = board_head(open_board(url), RUN)
    assert head is not None and head.version == 3 and len(head.catalog) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "patchswarm.publisher"]
    assert lines and all("old versions not deleted" in line and "gc/chunks/../stray" in line for line in lines), lines
    assert served(w).bitwise_equal(pull(url, keys))

"""A fleet on an object-store board, on a real moto server process: a seed serving its copy of the
store's run and a rollout daemon polling the store; two daemons and no seed at all; the seed's copy
refusing a damaged chunk."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.board_mirror import BoardMirror, StaleHeadError
from patchswarm.daemon.board_store import StoreBoard, open_board
from patchswarm.daemon.head_refresh import parse_head, refresh_board_head
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import cert_rel, head_rel, root_rel
from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.trust import RootDocument
from tests.support.boards import Keys, free_port
from tests.support.daemonkit import Daemon
from tests.support.moto_server import Moto, clean_env
from tests.support.store_boards import RUN, served, step, weights
from tests.support.swarmkit import SECRET

CLI = [sys.executable, "-m", "patchswarm.daemon.cli"]
ROOT = Path(__file__).parents[2]


# ---------------------------------------------------------------- a seed and a rollout daemon on an s3:// board


@contextlib.contextmanager
def seed_process(url: str, env: dict[str, str], tmp: Path) -> Iterator[str]:
    """``patchswarm seed --board s3://... --cache DIR --run RUN``: the store's run copied locally and served."""
    port = free_port()
    log = tmp / "seed.log"
    args = ["seed", "--board", url, "--cache", str(tmp / "cache"), "--run", RUN, "--listen", f"127.0.0.1:{port}"]
    args += ["--secret-file", str(tmp / "secret"), "--name", "seed"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, *args], cwd=ROOT, stdout=out, stderr=out, env=clean_env(env) | {"PYTHONPATH": str(ROOT)}
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"seed did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(20)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_seed_and_a_rollout_daemon_follow_an_s3_board_bitwise(aws: Moto, keys: Keys, tmp_path: Path) -> None:
    """The trainer publishes to the store only.  The seed keeps a local copy of the run and serves it
    to the swarm; the rollout daemon polls the store's head through the SDK (credentials from its
    environment) and reaches each version; its state root is the published one."""
    url = f"s3://{aws.new_bucket()}/fleet"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), chunk_size=16 << 10)
    w = weights(6)
    pub.publish(w)
    (tmp_path / "secret").write_bytes(SECRET)
    keys.root.save(tmp_path / "root.key")
    d = tmp_path / "d1"
    d.mkdir()
    store = f"ps-test-{uuid.uuid4().hex[:12]}"
    daemon: Daemon | None = None
    try:
        with seed_process(url, aws.env(), tmp_path) as seed:
            (d / "daemon.toml").write_text(
                f"""
[node]
name = "d1"
listen = "127.0.0.1:0"
[swarm]
run_id = "{RUN}"
bootstrap = ["{seed}"]
seed_urls = ["{url}"]
cluster_secret_file = "{tmp_path / "secret"}"
[trust]
root = "{tmp_path / "root.key.pub"}"
[store]
name = "{store}"
size = 0
[api]
socket = "{d / "api.sock"}"
[data]
dir = "{d / "data"}"
[log]
format = "json"
"""
            )
            daemon = Daemon("d1", d, d / "daemon.toml", store, str(d / "api.sock"), env=clean_env(aws.env()))
            daemon.start()
            for v in (1, 2, 3):
                if v > 1:
                    step(w, 50 + v)
                    pub.publish(w)
                st = await daemon.wait_version(v, timeout=90)
                assert st["root"] == served(w).root().hex()  # the state root: every byte, hashed
            assert await daemon.stop() == 0
        cached = open_board(tmp_path / "cache")
        assert cached.read(head_rel(RUN)) == pub.board.read(head_rel(RUN))  # the seed's copy is the store's head
    finally:
        pub.close()
        if daemon is not None:
            daemon.cleanup()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_rollout_daemons_without_a_seed_take_chunks_from_the_store(aws: Moto, keys: Keys, tmp_path: Path) -> None:
    """No seed at all: two daemons with only ``seed_urls = ["s3://..."]`` (one joins through the
    other) take heads, manifests and the chunks no peer has from the store, and reach each version."""
    url = f"s3://{aws.new_bucket()}/seedless"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), chunk_size=16 << 10)
    w = weights(8)
    pub.publish(w)
    (tmp_path / "secret").write_bytes(SECRET)
    keys.root.save(tmp_path / "root.key")
    port = free_port()
    d1 = daemon_config(tmp_path, "d1", url, port=port, bootstrap=[], env=aws.env())
    d2 = daemon_config(tmp_path, "d2", url, port=free_port(), bootstrap=[f"http://127.0.0.1:{port}"], env=aws.env())
    try:
        d1.start()
        d2.start()
        for v in (1, 2, 3):
            if v > 1:
                step(w, 80 + v)
                pub.publish(w)
            for d in (d1, d2):
                st = await d.wait_version(v, timeout=90)
                assert st["root"] == served(w).root().hex()
        assert await d1.stop() == 0 and await d2.stop() == 0
    finally:
        pub.close()
        d1.cleanup()
        d2.cleanup()


def daemon_config(tmp: Path, name: str, url: str, *, port: int, bootstrap: list[str], env: dict[str, str]) -> Daemon:
    d = tmp / name
    d.mkdir()
    store = f"ps-test-{uuid.uuid4().hex[:12]}"
    boot = ", ".join(f'"{b}"' for b in bootstrap)
    (d / "daemon.toml").write_text(
        f"""
[node]
name = "{name}"
listen = "127.0.0.1:{port}"
[swarm]
run_id = "{RUN}"
bootstrap = [{boot}]
seed_urls = ["{url}"]
cluster_secret_file = "{tmp / "secret"}"
[trust]
root = "{tmp / "root.key.pub"}"
[store]
name = "{store}"
size = 0
[api]
socket = "{d / "api.sock"}"
[data]
dir = "{d / "data"}"
[log]
format = "json"
"""
    )
    return Daemon(name, d, d / "daemon.toml", store, str(d / "api.sock"), env=clean_env(env))


Published = tuple[str, Publisher, StoreBoard, dict[str, torch.Tensor]]


def published(aws: Moto, keys: Keys, prefix: str, seed: int) -> Published:
    """A new bucket with one version of run RUN under ``prefix``: (bucket, publisher, its board, weights)."""
    bucket = aws.new_bucket()
    url = f"s3://{bucket}/{prefix}"
    pub = Publisher(url, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), refresh=False)
    w = weights(seed)
    pub.publish(w)
    assert isinstance(pub.board, StoreBoard)
    return bucket, pub, pub.board, w


def test_a_seed_copy_refuses_a_chunk_that_is_not_what_its_name_says(aws: Moto, keys: Keys, tmp_path: Path) -> None:
    """The seed's copy checks each object against its name: a damaged chunk in the store stops the
    copy of that version, and the local head stays at the last complete one."""
    bucket, pub, store, w = published(aws, keys, "m", 7)
    local = Board(tmp_path / "copy")
    mirror = BoardMirror(store, local, RUN)
    assert mirror.sync() and not mirror.sync()  # copied once; nothing new the second time
    first = local.read(head_rel(RUN))
    assert first == store.read(head_rel(RUN))
    step(w, 70)
    info = pub.publish(w)
    pub.close()
    manifest = store.manifest(getattr(info, "manifest_id", b""))
    victim = f"m/chunks/{manifest.chunks[0].hash.hex()}"
    aws.client().put_object(Bucket=bucket, Key=victim, Body=b"\0" * manifest.chunks[0].size)
    with pytest.raises(FormatError, match="does not hold the chunk its name says"):
        mirror.sync()
    assert local.read(head_rel(RUN)) == first


def test_a_seed_copy_does_not_follow_an_older_head_put_back(aws: Moto, keys: Keys, tmp_path: Path) -> None:
    """An older, validly signed head put back in the store (replayed, or a restored backup): hosts refuse
    it by its counter, and the copy used to follow it, deleting the newer version's chunks hosts still
    fetch from the seed.  Now the copy keeps its head and every chunk, and says why in one line."""
    bucket, pub, store, w = published(aws, keys, "r", 8)
    old = store.read(head_rel(RUN))
    step(w, 80)
    pub.publish(w)
    pub.close()
    local = Board(tmp_path / "copy")
    mirror = BoardMirror(store, local, RUN)
    assert mirror.sync()
    newest = local.read(head_rel(RUN))
    chunks = sorted(p.name for p in local.path("chunks").iterdir())
    aws.client().put_object(Bucket=bucket, Key=f"r/{head_rel(RUN)}", Body=old)
    with pytest.raises(StaleHeadError, match=r"not newer than the copy's \(\d+\): not followed"):
        mirror.sync()
    assert local.read(head_rel(RUN)) == newest
    assert sorted(p.name for p in local.path("chunks").iterdir()) == chunks


def test_a_stray_object_the_sdk_cannot_name_stops_neither_the_copy_nor_a_refresh(
    aws: Moto, keys: Keys, tmp_path: Path
) -> None:
    """A key holding ``..`` is a valid S3 object name that obstore refuses to list: one such object under
    trust/ or certs/ failed every listing, so a seed's copy and the head's refresh stopped for good.
    Root documents are now asked for by number and certificates by the keys that signed."""
    bucket, pub, store, _ = published(aws, keys, "j", 9)
    store.put_root(1, RootDocument(1, (keys.root.key_id,), ()).sign(keys.root).to_bytes())
    for stray in ("j/trust/root.2/../../x", "j/certs/../x"):
        aws.client().put_object(Bucket=bucket, Key=stray, Body=b"stray")
    local = Board(tmp_path / "copy")
    assert BoardMirror(store, local, RUN).sync()
    cert = store.read(cert_rel(keys.trainer.key_id))
    assert cert is not None and local.read(cert_rel(keys.trainer.key_id)) == cert
    assert local.read(root_rel(1)) == store.read(root_rel(1))
    before = parse_head(store.read(head_rel(RUN)) or b"").counter
    head = refresh_board_head(store, keys.trainer, RUN, certificate=cert)
    assert head is not None and head.counter == before + 1
    pub.close()

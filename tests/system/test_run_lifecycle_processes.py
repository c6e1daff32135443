"""A run that lasts for weeks, through real processes: the trainer's CLI and a rollout daemon under
libfaketime (the wall clock moved through a file the process rereads; monotonic timers stay real).

- ``patchswarm publish`` continues its run after 1 hour and after 3 days of silence, and
  ``patchswarm head refresh`` re-signs an expired head (both used to fail: "expired: the board may
  be frozen"); ``patchswarm seed --key`` keeps an idle run's head fresh.
- A daemon that stayed up the whole time reports the frozen board once (status, one warning,
  metrics), keeps serving its version, and converges on the next one without a restart, also when
  the trainer comes back with a newly certified key.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.engine import attach
from patchswarm.daemon.head_refresh import board_head
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.errors import ExpiredError
from patchswarm.protocol.head import HeadTracker, verify_head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.safetensors_io import save_safetensors
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate, TrustState
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller
from patchswarm.swarm.transport import SystemClock
from tests.support.adversary import parse_metrics
from tests.support.faultkit import SkewedClock, engine_sees, fleet_daemon, wait_status
from tests.support.swarmkit import RUN, SECRET, Swarm

DAY = 86_400


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},  # keeps PYTHONPATH: this tree's code, not an installed one
    )


def certificate(root: SigningKey, key: SigningKey, days: int = 30) -> bytes:
    now = int(time.time() * 1000)
    return Certificate(key.key_id, RUN, now - 60_000, now + days * DAY * 1000).sign(root).to_bytes()


def host_reaches(board: Board, root: SigningKey, offset: float) -> int:
    """The version a host trusting ``root``, its clock ``offset`` seconds ahead, verifies on ``board``."""
    trust = TrustState(root.key_id, skew_ms=0)  # strict: a head past its expiry is refused
    puller = Puller(DirSource(board.root), trust, RUN, clock=lambda: time.time() + offset)
    return asyncio.run(puller.catch_up(None)).version


async def metrics(socket: str) -> dict[str, float]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as s,
        s.get("http://d/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r,
    ):
        return parse_metrics(await r.text())


def model(step: int) -> ServedModel:
    g = torch.Generator().manual_seed(step)
    return ServedModel.from_tensors({"a": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g)})


@pytest.mark.slow
def test_cli_trainer_continues_after_an_hour_and_after_three_days(tmp_path: Path) -> None:
    clock = SkewedClock(tmp_path)  # the trainer's processes' wall clock
    root, trainer = SigningKey.generate(), SigningKey.generate()
    trainer.save(tmp_path / "trainer.key")
    (tmp_path / "trainer.cert").write_bytes(certificate(root, trainer))
    board = Board(tmp_path / "board")
    common = ["--board", "board", "--key", "trainer.key", "--run-id", RUN, "--head-ttl", "60"]
    for step in range(1, 4):
        save_safetensors(model(step), tmp_path / f"m{step}.safetensors")

    r = cli("publish", "m1.safetensors", *common, "--cert", "trainer.cert", env=clock.env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first = board_head(board, RUN)
    assert first is not None and first.expires_ms - first.created_ms == 60_000

    clock.set(3600)  # an hour of silence: the head expired long ago
    with pytest.raises(ExpiredError, match="frozen"):
        host_reaches(board, root, 3600)
    r = cli("publish", "m2.safetensors", *common, env=clock.env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "published version 2" in r.stdout
    assert host_reaches(board, root, 3600) == 2

    clock.set(3 * DAY)  # three days: re-signed once from cron, then the trainer comes back
    before = board_head(board, RUN)
    r = cli("head", "refresh", *common, env=clock.env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    refreshed = board_head(board, RUN)
    assert before is not None and refreshed is not None
    assert len(lines) == 1 and f"counter {refreshed.counter}" in lines[0] and "expires" in lines[0], r.stdout
    assert (refreshed.version, refreshed.counter) == (2, before.counter + 1)
    assert abs(refreshed.created_ms / 1000 - (time.time() + 3 * DAY)) < 60  # signed by the faked clock
    assert host_reaches(board, root, 3 * DAY) == 2
    r = cli("publish", "m3.safetensors", *common, env=clock.env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert host_reaches(board, root, 3 * DAY) == 3
    last = board_head(board, RUN)
    assert last is not None and last.counter > refreshed.counter


def test_cli_head_errors_are_one_line(tmp_path: Path) -> None:
    key = SigningKey.generate()
    key.save(tmp_path / "k")
    (tmp_path / "board").mkdir()
    cases = [
        (["head", "refresh", "--board", "board", "--key", "k", "--run-id", RUN], 1, "no head for run"),
        (["head", "refresh", "--board", "board", "--key", "k", "--run-id", "../x"], 2, "run id must be"),
        (["publish", "m", "--board", "board", "--key", "k", "--run-id", RUN, "--head-ttl", "nan"], 2, "--head-ttl"),
        (["seed", "--board", "board", "--key", "k"], 1, "--key needs --run"),
    ]
    procs = [  # at once: each pays the interpreter's start
        subprocess.Popen(
            [sys.executable, "-m", "patchswarm.daemon.cli", *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for args, _, _ in cases
    ]
    for (args, rc, message), proc in zip(cases, procs, strict=True):
        with proc:
            _, err = proc.communicate(timeout=120)
        text = err.decode()
        assert proc.returncode == rc and "Traceback" not in text, (args, text)
        assert message in text.strip().splitlines()[-1], (args, text)
    assert os.listdir(tmp_path / "board") == []


def test_seed_with_the_key_keeps_an_idle_run_fresh_beside_the_trainer(tmp_path: Path) -> None:
    root, trainer = SigningKey.generate(), SigningKey.generate()
    trainer.save(tmp_path / "trainer.key")
    (tmp_path / "secret").write_bytes(SECRET)
    board = Board(tmp_path / "board")
    Publisher(board, trainer, run_id=RUN, certificate=certificate(root, trainer), head_ttl=2, refresh=False).publish(
        {"w": torch.randn(64, 64)}
    )
    first = board_head(board, RUN)
    assert first is not None
    with (
        open(tmp_path / "seed.log", "wb") as log,
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "patchswarm.daemon.cli",
                "seed",
                "--board",
                "board",
                "--run",
                RUN,
                "--listen",
                "127.0.0.1:0",
            ]
            + ["--secret-file", "secret", "--key", "trainer.key", "--head-ttl", "2"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        ) as seed,
    ):
        try:
            assert seed.stdout is not None
            assert json.loads(seed.stdout.readline())["event"] == "listening"
            deadline = time.monotonic() + 60
            while (head := board_head(board, RUN)) is None or head.counter < first.counter + 2:
                assert seed.poll() is None and time.monotonic() < deadline, (tmp_path / "seed.log").read_text()
                time.sleep(0.1)
            time.sleep(2.5)  # past the first head's lifetime (and every head the seed replaced)
            assert host_reaches(board, root, 0) == 1  # still fresh: hosts see a live run, not a frozen board

            # The trainer comes back while the seed keeps refreshing (two processes, two refreshers):
            # a host reading the head all along sees no fork, no reused counter, no rewind.
            tracker, policy = HeadTracker(RUN), TrustState(root.key_id)
            policy.add_certificate(certificate(root, trainer))
            with Publisher(board, trainer, run_id=RUN, head_ttl=1, refresh=True) as pub:
                for _ in range(2, 8):
                    pub.publish({"w": torch.randn(64, 64)})
                    for _poll in range(3):
                        data = board.read(head_rel(RUN))
                        assert data is not None
                        tracker.accept(*verify_head(data, policy, now_ms=int(time.time() * 1000), skew_ms=0))
                        time.sleep(0.1)
            assert tracker.version == 7 and host_reaches(board, root, 0) == 7
        finally:
            seed.send_signal(signal.SIGTERM)
            seed.wait(timeout=30)


class ShiftedClock(SystemClock):
    def __init__(self, offset: float) -> None:
        self.offset = offset

    def wall(self) -> float:
        return super().wall() + self.offset


@pytest.mark.asyncio
async def test_daemon_up_through_three_days_of_silence_converges_without_a_restart(tmp_path: Path) -> None:
    clock = SkewedClock(tmp_path)  # the daemon's wall clock
    sw = Swarm(tmp_path)
    assert sw.pub is not None
    sw.pub.close()
    sw.pub = Publisher(
        sw.board, sw.trainer, run_id=RUN, certificate=certificate(sw.root, sw.trainer), chunk_size=16 << 10
    )
    v1 = sw.publish()
    seed = await sw.start_seed()
    d = fleet_daemon(sw, seed.url, "idle-host", tmp_path, env=clock.env)
    d.start()
    view = None
    try:
        await d.wait_version(v1)
        view = attach((await d.get("/v1/layout"))["attach"])
        sw.pub.close()  # the trainer stops: nothing re-signs the head

        clock.set(3 * DAY)  # the host stays up; three days pass
        # ... for the seed too: gossip frames carry their sender's wall clock (protocol/wire.py), and a host
        # three days apart from its peers is cut off from them, as it should be.
        seed.node.clock = ShiftedClock(3 * DAY)
        st = await wait_status(d, lambda s: s["head_expired_since"] is not None)
        head = board_head(sw.board, RUN)
        assert head is not None and st["head_expired_since"] == head.expires_ms / 1000
        assert "board frozen since" in st["reason"] and st["version"] == v1 and engine_sees(view, sw.served) == v1
        expired = 'patchswarm_heads_refused_total{reason="ExpiredError"}'
        deadline = time.monotonic() + 60
        while (m := await metrics(d.socket)).get(expired, 0) < 3:  # three polls at least, each one refused
            assert time.monotonic() < deadline, m
            await asyncio.sleep(0.2)
        assert m["patchswarm_head_ttl_seconds"] < -2 * DAY and m["patchswarm_head_age_seconds"] > 2 * DAY
        assert d.log.read_text().count("the board may be frozen") == 1  # warned once, not at every poll
        assert (await d.status() or {}).get("reason") == st["reason"]  # the same one line all along

        # The trainer restarts from its checkpoint, three days later by its own clock.
        def later() -> float:
            return time.time() + 3 * DAY

        sw.pub = Publisher(sw.board, sw.trainer, run_id=RUN, chunk_size=16 << 10, clock=later, refresh=False)
        v2 = sw.publish(scale=3e-4)
        await d.wait_version(v2)
        # The frozen-board report clears with the fresh head (the status is refreshed a few times a second).
        st = await wait_status(d, lambda s: s["head_expired_since"] is None and s["reason"] is None)
        assert st["version"] == v2 and engine_sees(view, sw.served) == v2

        # And hands over to a newly certified key: the host follows with no change to its config.
        key_b = SigningKey.generate()
        sw.pub = Publisher(
            sw.board, key_b, run_id=RUN, certificate=certificate(sw.root, key_b), chunk_size=16 << 10, clock=later
        )
        v3 = sw.publish(scale=3e-4)
        st = await d.wait_version(v3)
        assert st["reason"] is None and engine_sees(view, sw.served) == v3
        assert await d.stop() == 0
    finally:
        if view is not None:
            view.close()
        if sw.pub is not None:
            sw.pub.close()
        d.cleanup()
        await sw.close()

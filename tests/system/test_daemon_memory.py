"""The daemon's host memory stays within 1.3x the served model, and the host store is its only copy.

A real daemon process follows a board; its /proc/PID/status is sampled from a thread.  Bounds, not
exact figures: anonymous memory above the daemon's own before its first version (interpreter,
torch, sockets), plus the store, against the model measured in the same run.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path

import pytest
import torch

from patchswarm.daemon import publish_work
from patchswarm.daemon.board import Board
from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.codec import diff_tensor
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import RUN, Swarm

pytestmark = pytest.mark.asyncio

MB = 1 << 20
# The fixed allowance on every bound: what does not scale with the model (sockets, logs, Python
# objects, the decoder's per-stream zstd contexts and 4 MiB hash slice): 0.25x of this 64 MiB model.
MARGIN = 16 * MB


def rss(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class PeakSampler(threading.Thread):
    """The daemon's peak ``RssAnon`` since the last ``take``.  The update and ``take`` hold one lock: a
    sample read before a ``take`` and stored after it used to put the anchor's peak back into the
    first patch's window (the 2.0x "patch" peak seen once in 11 runs)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                now = rss(self.pid)["RssAnon"]
            except (OSError, KeyError):
                return
            with self.lock:
                self.peak = max(self.peak, now)
            time.sleep(0.005)

    def take(self) -> int:
        with self.lock:
            peak, self.peak = self.peak, 0
        return peak


@pytest.mark.slow
async def test_host_memory_of_a_daemon_following_versions_stays_within_1_3x_the_model(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    now = int(time.time() * 1000)
    cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
    sw.board = Board(tmp_path / "board64")
    pub = Publisher(sw.board, sw.trainer, run_id=RUN, certificate=cert, anchor_every=100)
    gen = torch.Generator().manual_seed(3)
    weights = {f"w{i:02d}": (torch.randn(2048, 1024, generator=gen) * 0.02).bfloat16() for i in range(16)}
    model = sum(w.numel() * 2 for w in weights.values())  # 64 MiB of bf16
    await sw.start_seed()
    d = make_daemon(sw, "mem", tmp_path)
    d.start()
    try:
        while await d.status() is None:
            assert d.alive, d.log.read_text()[-2000:]
            await asyncio.sleep(0.1)
        assert d.proc is not None
        await asyncio.sleep(1.0)
        baseline = rss(d.proc.pid)["RssAnon"]
        sampler = PeakSampler(d.proc.pid)
        sampler.start()
        for v in range(1, 5):
            if v > 1:  # 0.5% of the values move by one ulp
                for w in weights.values():
                    words = w.view(torch.int16).view(-1)
                    words[torch.randint(0, words.numel(), (words.numel() // 200,), generator=gen)] += 1
            await asyncio.to_thread(pub.publish, weights)
            await d.wait_version(v, timeout=120)
            await asyncio.sleep(0.5)
            peak = sampler.take()
            now_rss = rss(d.proc.pid)
            assert now_rss["RssShmem"] <= model + MARGIN
            # Steady: the store (the model) plus at most 0.3x of it besides what the daemon had before.
            tail = d.log.read_text()[-3000:]  # (what the daemon did, when a bound fails)
            assert now_rss["RssAnon"] - baseline + model <= 1.3 * model + MARGIN, (v, now_rss, baseline, tail)
            # Peak, the anchor too: its payload (about 0.75x for these values) is spooled to a file
            # under data.dir and decoded from its mapping (page cache), straight into the store.
            assert peak - baseline + model <= 1.3 * model + MARGIN, (v, peak, baseline, tail)
        sampler.stop.set()
        expected = ServedModel.from_tensors(weights)
        st = await d.status()
        assert st is not None and st["root"] == expected.root().hex()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.parametrize("payload_format", [1, 2])
async def test_an_engine_writing_into_the_store_is_caught_and_the_store_reloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload_format: int
) -> None:
    """The host store is the daemon's only copy: a write by an engine makes the next patch's digest
    check fail against it, and the daemon reloads from an anchor instead of serving a wrong version.
    Format 2 decodes positions under the base's exponents: a scribbled base may make the payload look
    malformed (a FormatError) rather than decode to another target; that is caught the same way."""
    scale = 5e-4
    if payload_format == 2:  # (the publisher here is this process; the daemon under test reads)
        monkeypatch.setattr(publish_work, "diff_tensor", functools.partial(diff_tensor, payload_format=2))
        scale = 3e-5  # small steps: contexts pay (SPARSE_CTX records)
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)
    d.start()
    try:
        await d.wait_version(1)
        v = sw.publish(scale=scale)
        await d.wait_version(v)
        view = attach((await d.get("/v1/layout"))["attach"])
        names = [s.name for s in sw.served[v].specs]
        view.tensor(names[0]).view(-1)[:64] += 1  # the engine scribbles on weights it only had to read
        v = sw.publish(scale=scale)
        st = await d.wait_version(v, timeout=60)
        assert st["root"] == sw.served[v].root().hex()
        for i, n in enumerate(names):
            assert view.tensor(n).view(-1).equal(sw.served[v].typed(i).view(-1)), n
        assert "reloading from an anchor" in d.log.read_text()
        view.close()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()

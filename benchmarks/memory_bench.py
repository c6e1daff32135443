"""Host memory of a rollout daemon following a board, against the served model's size.

    python -m benchmarks.memory_bench                         # 100 MB bf16, anchor + 4 patches, store.kind shm
    .venv/bin/python benchmarks/memory_bench.py               # the same, from the repository's root
    python -m benchmarks.memory_bench --kind engine-shm       # the engine allocates the buffer (CPU twin of cuda)
    python -m benchmarks.memory_bench --env MALLOC_ARENA_MAX=2

A board (this process) gets an anchor and then patches that each change ``--frac`` of the bf16
values by 1-2 ulps; a seed node (this process) serves it; the daemon is a real process
(``patchswarm daemon``) following the board into its store.  A thread samples the daemon's
``/proc/PID/status`` every 10 ms: ``RssAnon`` (its private heap: shadow copies, payloads, chunk
cache, interpreter) and ``RssShmem`` (the store's pages it has touched).  Printed per version: the
peak and the steady value (after the version is served and the daemon is idle again) of both, and
``host`` = (anon - baseline + store bytes) / model, where the baseline is the daemon's anonymous
memory before the first version (interpreter, torch, aiohttp).  ``file+`` is the peak of ``RssFile``
above its baseline: the mapped spool of a download (swarm/spool.py), page cache the kernel can
reclaim (data.dir on a disk; on tmpfs it would be shared memory), not counted in ``host``.  For
``engine-shm`` the engine's buffer is allocated in this process and registered by socket
(``DaemonClient.open_store``): it is the store, and counts once in ``host``.  ``/proc/PID/smaps_rollup``
is printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not __package__:  # run as a script (.venv/bin/python benchmarks/memory_bench.py): this repository first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.trust import Certificate
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import RUN, Swarm

STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def read_status(pid: int) -> dict[str, int]:
    """The RSS fields of /proc/PID/status, in bytes ({} once the process is gone)."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            out[key] = int(rest.split()[0]) * 1024
    return out


def smaps_rollup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return ""


@dataclass
class Sampler:
    """Samples a process's RSS fields every ``period`` s; ``peak()`` since the last ``reset()``."""

    pid: int
    period: float = 0.01
    _peak: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period)

    def sample(self) -> dict[str, int]:
        s = read_status(self.pid)
        with self._lock:
            for k, v in s.items():
                self._peak[k] = max(self._peak.get(k, 0), v)
        return s

    def reset(self) -> None:
        with self._lock:
            self._peak = {}

    def peak(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak)

    def stop(self) -> None:
        self._stop.set()


def make_model(mb: float, tensors: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """About ``mb`` MB of bf16 in ``tensors`` equal [rows, 1024] tensors."""
    rows = max(1, round(mb * 1e6 / 2 / 1024 / tensors))
    return {
        f"layers.{i:03d}.weight": (torch.randn(rows, 1024, generator=gen) * 0.02).bfloat16() for i in range(tensors)
    }


def nudge(weights: dict[str, torch.Tensor], frac: float, gen: torch.Generator) -> None:
    """Change ``frac`` of every tensor's values by +-1 or 2 ulps (bf16 words), in place."""
    for w in weights.values():
        words = w.view(torch.int16).view(-1)
        k = max(1, int(frac * words.numel()))
        pos = torch.randint(0, words.numel(), (k,), generator=gen)
        step = torch.randint(1, 3, (k,), generator=gen, dtype=torch.int16)
        words[pos] += step


def mb(n: float) -> str:
    return f"{n / 1e6:7.1f}"


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="memory-bench-"))
    sw = Swarm(tmp)
    now = int(time.time() * 1000)
    cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
    sw.board = Board(tmp / "board")
    pub = Publisher(sw.board, sw.trainer, run_id=RUN, certificate=cert, anchor_every=1000, keep_anchors=2)
    gen = torch.Generator().manual_seed(1)
    weights = make_model(args.mb, args.tensors, gen)
    model_bytes = sum(w.numel() * 2 for w in weights.values())
    await sw.start_seed()
    env = dict(e.split("=", 1) for e in args.env)
    d = make_daemon(sw, "mem", tmp)
    root = str(Path(__file__).resolve().parents[1])  # the daemon runs this repository's code, from any folder
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    d.env = {"PATCHSWARM_STORE_KIND": args.kind, "PYTHONPATH": path, **env}
    d.start()
    view = None
    try:
        while (await d.status()) is None:
            assert d.alive, d.log.read_text()[-2000:]
            await asyncio.sleep(0.1)
        assert d.proc is not None
        pid = d.proc.pid
        await asyncio.sleep(2.0)
        base = read_status(pid)
        baseline, file_base = base["RssAnon"], base["RssFile"]
        sampler = Sampler(pid)
        sampler.start()
        print(
            f"model {mb(model_bytes)} MB bf16 in {args.tensors} tensors, store.kind {args.kind}, "
            f"frac {args.frac}, env {env or '-'}; daemon baseline anon {mb(baseline)} MB"
        )
        print(
            "version  kind    payload MB | peak anon  peak shm  file+ | steady anon  steady shm "
            "| host peak  host steady"
        )
        host_steady: list[float] = []
        host_peak: list[float] = []
        for v in range(1, args.versions + 2):
            if v > 1:
                nudge(weights, args.frac, gen)
            sampler.reset()
            info = await asyncio.to_thread(pub.publish, weights)
            if v == 1 and args.kind != "shm":
                from patchswarm.daemon.engine_client import DaemonClient

                view = await asyncio.to_thread(DaemonClient(d.socket).open_store, "cpu", "bench", 120.0)
            await d.wait_version(v, timeout=600)
            await asyncio.sleep(args.settle)
            peak = sampler.peak()
            steady = sampler.sample()
            store = model_bytes
            hp = (peak["RssAnon"] - baseline + store) / model_bytes
            hs = (steady["RssAnon"] - baseline + store) / model_bytes
            host_peak.append(hp)
            host_steady.append(hs)
            payload = (info.anchor_bytes or 0) if v == 1 else info.patch_bytes
            print(
                f"{v:7d}  {'anchor' if v == 1 else 'patch ':6s}  {mb(payload)}   | {mb(peak['RssAnon'])}  "
                f"{mb(peak['RssShmem'])} {mb(peak['RssFile'] - file_base)} | {mb(steady['RssAnon'])}     "
                f"{mb(steady['RssShmem'])}    | "
                f"{hp:6.2f}x   {hs:6.2f}x"
            )
        sampler.stop()
        worst = f"peak {max(host_peak):.2f}x (patches {max(host_peak[1:]):.2f}x), steady {max(host_steady):.2f}x"
        print(f"worst host: {worst}")
        print("smaps_rollup at the end:")
        for line in smaps_rollup(pid).splitlines()[1:]:
            if any(line.startswith(k) for k in ("Rss", "Pss_Anon", "Pss_Shmem", "Anonymous", "Shared_", "Private_")):
                print("   ", line)
        await d.stop()
    finally:
        if view is not None:
            view.close()
        d.cleanup()
        await sw.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="model size in MB (bf16)")
    p.add_argument("--tensors", type=int, default=25)
    p.add_argument("--versions", type=int, default=4, help="patches after the anchor")
    p.add_argument("--frac", type=float, default=0.005, help="fraction of values each patch changes")
    p.add_argument("--kind", choices=("shm", "engine-shm"), default="shm")
    p.add_argument("--settle", type=float, default=1.5, help="seconds after a version before the steady sample")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the daemon (e.g. MALLOC_ARENA_MAX=2)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()

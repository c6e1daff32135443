"""``make demo``: the whole system on one machine, in about a minute.

A trainer trains a small transformer with AdamW (FP32 master weights) on the CPU and, after every
RL-like step (lr 1e-6), publishes the served bf16 version to a board; a seed and four rollout
daemons (separate processes, each with its own shared-memory weight store) spread the versions
over loopback; a reference engine serves generations straight from daemon 1's store behind the
version-aware sidecar, and a client asks for each new version by pinning it.  The table at the
end checks every host bitwise against the trainer and shows the engine's answer per version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from patchswarm.daemon.board import Board
from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.daemon.refengine import StoreViewSource, start_engine
from patchswarm.daemon.trajectory import generate
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate

RUN = "demo-run"
SECRET = os.urandom(32).hex().encode()
PROMPT = [2, 5, 6, 7, 8, 1]  # "copy 5 6 7 8 ="


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Host:
    name: str
    zone: str
    dir: Path
    store: str
    socket: str
    proc: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)
    reached: dict[int, float] = field(default_factory=dict)
    roots: dict[int, str] = field(default_factory=dict)  # the state root each version had on this host


@dataclass
class Published:
    version: int
    info: PublishInfo
    served: ServedModel
    at: float


class Demo:
    def __init__(self, workdir: Path, hosts: int, steps: int, preset: str) -> None:
        self.dir = workdir
        self.steps = steps
        self.preset = preset
        self.board = Board(workdir / "board")
        self.root, self.trainer = SigningKey.generate(), SigningKey.generate()
        self.root.save(workdir / "root.key")
        (workdir / "secret").write_bytes(SECRET)
        self.seed_port = free_port()
        self.engine_port, self.sidecar_port = free_port(), free_port()
        self.hosts = [
            Host(
                f"host-{i + 1}",
                f"zone-{'ab'[i % 2]}",
                workdir / f"host-{i + 1}",
                f"patchswarm-demo-{os.getpid()}-{i}",
                str(workdir / f"host-{i + 1}" / "api.sock"),
            )
            for i in range(hosts)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.published: dict[int, Published] = {}
        self.answers: dict[int, tuple[list[int], float]] = {}
        self.trainer_state = "starting"
        self.t0 = time.monotonic()
        self.errors: list[str] = []

    # ------------------------------------------------------------ processes

    def spawn(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as fh:
            p = subprocess.Popen(
                [sys.executable, "-m", "patchswarm.daemon.cli", *args], stdout=fh, stderr=subprocess.STDOUT
            )
        self.procs.append(p)
        return p

    def start_seed(self) -> None:
        self.spawn(
            ["seed", "--board", str(self.board.root), "--listen", f"127.0.0.1:{self.seed_port}", "--run", RUN,
             "--secret-file", str(self.dir / "secret"), "--name", "seed", "--zone", "zone-a"],
            self.dir / "seed.log",
        )  # fmt: skip

    def start_host(self, h: Host, sidecar: bool) -> None:
        h.dir.mkdir(parents=True, exist_ok=True)
        seed = f"http://127.0.0.1:{self.seed_port}"
        side = (
            f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{self.sidecar_port}"\n'
            f'upstream = "http://127.0.0.1:{self.engine_port}"\n'
            if sidecar
            else ""
        )
        (h.dir / "daemon.toml").write_text(
            f'[node]\nname = "{h.name}"\nlisten = "127.0.0.1:0"\nzone = "{h.zone}"\n'
            f'[swarm]\nrun_id = "{RUN}"\nbootstrap = ["{seed}"]\nseed_urls = ["{seed}"]\n'
            f'cluster_secret_file = "{self.dir / "secret"}"\n'
            f'[trust]\nroot = "{self.dir / "root.key.pub"}"\n[store]\nname = "{h.store}"\n'
            f'[api]\nsocket = "{h.socket}"\n[data]\ndir = "{h.dir / "data"}"\n[log]\nformat = "json"\n{side}'
        )
        h.proc = self.spawn(["daemon", "--config", str(h.dir / "daemon.toml")], h.dir / "daemon.log")

    async def poll(self) -> None:
        while True:
            for h in self.hosts:
                try:
                    async with (
                        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=h.socket)) as s,
                        s.get("http://d/v1/status", timeout=aiohttp.ClientTimeout(total=2)) as r,
                    ):
                        h.status = await r.json()
                except (aiohttp.ClientError, OSError, TimeoutError):
                    h.status = {"state": "starting"}
                v = h.status.get("version")
                if v is not None and v not in h.reached:
                    h.reached[v] = time.monotonic()
                    h.roots[v] = str(h.status.get("root"))
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------ trainer and engine client

    def train(self) -> None:
        now = int(time.time() * 1000)
        cert = Certificate(self.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(self.root).to_bytes()
        pub = Publisher(self.board, self.trainer, run_id=RUN, served_format="as_is", certificate=cert,
                        chunk_size=256 << 10, anchor_every=4)  # fmt: skip

        def on_version(i: int, bf16: dict[str, torch.Tensor], fp8: dict[str, torch.Tensor]) -> None:
            info = pub.publish(bf16)
            assert isinstance(info, PublishInfo)
            self.published[info.version] = Published(
                info.version, info, ServedModel.from_tensors(bf16), time.monotonic()
            )
            self.trainer_state = (
                f"published version {info.version} (RL step {i})" if i else "published version 1 (warm-up)"
            )
            time.sleep(2.0)  # pace the steps so the spreading is visible

        self.trainer_state = "training (warm-up at lr 1e-3)"
        generate(self.preset, steps=self.steps, lr=1e-6, on_version=on_version)
        self.trainer_state = "done"

    async def ask_engine(self, stop: asyncio.Event) -> None:
        """For every published version, a request pinned to it: 409 until it lands, then an answer."""
        url = f"http://127.0.0.1:{self.sidecar_port}/generate"
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                for v in sorted(self.published):
                    if v in self.answers:
                        continue
                    body = {"prompt": PROMPT, "max_tokens": 4, "weight_version": {"exact_version": v}}
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
                            if r.status == 200:
                                out = await r.json()
                                if out["weight_version"] != {"start": v, "end": v}:
                                    self.errors.append(f"version {v} answered as {out['weight_version']}")
                                self.answers[v] = (out["tokens"], time.monotonic())
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------ views

    def live_view(self) -> Group:
        t = Table(title="versions spreading (live)")
        for col in ("host", "zone", "state", "version", "progress"):
            t.add_column(col)
        for h in self.hosts:
            st = h.status
            prog = st.get("progress") or {}
            p = f"{prog.get('chunks_done', 0)}/{prog.get('chunks_total', 0)}" if prog.get("chunks_total") else ""
            t.add_row(h.name, h.zone, str(st.get("state", "")), str(st.get("version", "")), p)
        head = max(self.published, default=0)
        return Group(f"[bold]trainer:[/] {self.trainer_state}   [bold]head:[/] version {head}   "
                     f"[bold]engine answers:[/] {len(self.answers)}", t)  # fmt: skip

    def final_table(self) -> tuple[Table, bool]:
        t = Table(title="patchswarm demo: every version, every host")
        for col in (
            "version",
            "patch bytes",
            "full bytes",
            "patch/full",
            "time to all hosts",
            "bitwise",
            "engine answer",
        ):
            t.add_column(col, justify="right")
        ok = True
        for v, p in sorted(self.published.items()):
            full = p.served.nbytes
            size = p.info.patch_bytes or (p.info.anchor_bytes or 0)
            times = [h.reached[v] for h in self.hosts if v in h.reached]
            spread = f"{max(times) - p.at:.2f} s" if len(times) == len(self.hosts) else "-"
            want = p.served.root().hex()
            seen = [h.roots[v] for h in self.hosts if v in h.roots]
            same = sum(r == want for r in seen)
            # A host that jumped straight past a version (catching up) never held it: not counted.
            bitwise = f"{same}/{len(seen)} identical" + ("" if same == len(seen) else f", {len(seen) - same} DIFFERENT")
            ok &= same == len(seen)
            answer = " ".join(map(str, self.answers[v][0])) if v in self.answers else "-"
            ratio = f"{100 * size / full:.2f}%" + ("" if p.info.patch_bytes else " (anchor)")
            t.add_row(str(v), f"{size:,}", f"{full:,}", ratio, spread, bitwise, answer)
        return t, ok and not self.errors

    # ------------------------------------------------------------ main

    async def run(self, console: Console) -> bool:
        self.start_seed()
        for i, h in enumerate(self.hosts):
            self.start_host(h, sidecar=(i == 0))
        trainer = threading.Thread(target=self.train, name="trainer", daemon=True)
        trainer.start()
        poller = asyncio.create_task(self.poll())
        stop = asyncio.Event()
        engine = None
        asker = None
        try:
            with Live(self.live_view(), console=console, refresh_per_second=4) as live:
                while trainer.is_alive() or not self.all_at_head():
                    if engine is None and self.hosts[0].status.get("version"):
                        engine = await self.start_engine()
                        asker = asyncio.create_task(self.ask_engine(stop))
                    live.update(self.live_view())
                    await asyncio.sleep(0.25)
                    if time.monotonic() - self.t0 > 600:
                        self.errors.append("timed out")
                        break
                deadline = time.monotonic() + 20
                while len(self.answers) < len(self.published) and time.monotonic() < deadline:
                    live.update(self.live_view())
                    await asyncio.sleep(0.25)
                live.update(self.live_view())
        finally:
            stop.set()
            poller.cancel()
            if asker:
                asker.cancel()
            if engine is not None:
                await engine.close()
        table, ok = self.final_table()
        console.print(table)
        return ok

    def all_at_head(self) -> bool:
        head = max(self.published, default=None)
        return head is not None and all(h.status.get("version") == head for h in self.hosts)

    async def start_engine(self) -> Any:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.hosts[0].socket)) as s,
            s.get("http://d/v1/layout") as r,
        ):
            info = await r.json()
        self.view = attach(info["attach"])
        return await start_engine(StoreViewSource(self.view), port=self.engine_port)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        from patchswarm.daemon.store_format import StoreError
        from patchswarm.daemon.weightstore import WeightStore

        for h in self.hosts:
            with contextlib.suppress(StoreError, OSError):
                WeightStore.open(h.store).destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, board)")
    args = ap.parse_args(argv)
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="patchswarm-demo-"))
    demo = Demo(workdir, args.hosts, args.steps, args.preset)
    console.print(f"[bold]patchswarm demo[/]: trainer + seed + {args.hosts} daemons on loopback (work dir {workdir})")
    try:
        ok = asyncio.run(demo.run(console))
    finally:
        demo.cleanup()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if demo.errors:
        console.print(f"[red]errors:[/] {demo.errors}")
    console.print("[bold green]every host matched the trainer bitwise[/]" if ok else "[bold red]mismatch[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``make demo``: the whole system on one machine, in about a minute.

A trainer trains a small Llama (transformers, built from a config; daemon/demo_llama.py) with
AdamW (FP32 master weights) on the CPU: a short warm-up on a few chat facts, then RL-like steps
(lr 1e-6), publishing each served bf16 version to a board under its Hugging Face names.  A seed and
rollout daemons (separate processes, each with its own shared-memory weight store) spread the
versions over loopback; on host 1, ``patchswarm engine transformers`` (its own process) serves
straight from the daemon's store behind the version-aware sidecar (commit_mode in_place), and a
client asks a chat question pinned to each version.  The table at the end checks every host
bitwise against the trainer and shows the engine's answer per version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
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
from patchswarm.daemon.demo_llama import EOS, PRESETS, Trainer, chat_ids
from patchswarm.daemon.demo_llama import train as train_llama
from patchswarm.daemon.engine_http import read_json
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.daemon.status_cli import StatusError, fetch_status
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate

RUN = "demo-run"
SECRET = os.urandom(32).hex().encode()
QUESTION = "What does patchswarm ship?"  # one of the warm-up's facts (demo_llama.FACTS)
MAX_ANSWER_BYTES = 16 << 20  # (a logits answer: a vocabulary of floats as text)
TomlValue = str | int | float | bool | list[str]


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


@dataclass
class Answer:
    """The engine's answer to QUESTION on one version, and its logits for the answer's first token."""

    text: str
    logp: float | None  # log p(the greedy first answer token): moves with the weights even when the text does not
    digest: str  # BLAKE2b of the float32 next-token logits the engine returned: any change of the logits shows
    at: float


def toml_text(sections: dict[str, dict[str, TomlValue]]) -> str:
    """A TOML document of flat sections (the daemon's config): one place to add a key or a section."""

    def value(v: TomlValue) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(map(text, v)) + "]"
        return text(v)

    def text(v: str) -> str:  # a TOML basic string: quotes, backslashes and control characters escaped
        return (
            '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c for c in v) + '"'
        )

    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items()) + "\n"
        for name, keys in sections.items()
    )


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
        self.answers: dict[int, Answer | None] = {}  # None: replaced before it could be asked
        self.engine_dir = workdir / "demo-llama"  # the served model's id is its name
        self.engine_ready = threading.Event()  # the trainer goes on to RL steps once the engine answers
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

    def daemon_config(self, h: Host, engine: bool) -> dict[str, dict[str, TomlValue]]:
        """Host ``h``'s daemon.toml, section by section; the engine host's has the sidecar in front of it."""
        seed = f"http://127.0.0.1:{self.seed_port}"
        cfg: dict[str, dict[str, TomlValue]] = {
            "node": {"name": h.name, "listen": "127.0.0.1:0", "zone": h.zone},
            "swarm": {"run_id": RUN, "bootstrap": [seed], "seed_urls": [seed],
                      "cluster_secret_file": str(self.dir / "secret")},
            "trust": {"root": str(self.dir / "root.key.pub")},
            "store": {"name": h.store},
            "api": {"socket": h.socket},
            "data": {"dir": str(h.dir / "data")},
            "log": {"format": "json"},
        }  # fmt: skip
        if engine:  # the engine pauses between steps while the daemon writes a version in place
            cfg["sidecar"] = {
                "enabled": True,
                "listen": f"127.0.0.1:{self.sidecar_port}",
                "upstream": f"http://127.0.0.1:{self.engine_port}",
                "commit_mode": "in_place",
            }
            # Only a version the engine acknowledged (POST /patchswarm/v1/commit) is reported as served.
            cfg["engine"] = {"kind": "zero-copy"}
        return cfg

    def start_host(self, h: Host, engine: bool) -> None:
        h.dir.mkdir(parents=True, exist_ok=True)
        (h.dir / "daemon.toml").write_text(toml_text(self.daemon_config(h, engine)))
        h.proc = self.spawn(["daemon", "--config", str(h.dir / "daemon.toml")], h.dir / "daemon.log")

    def start_engine(self) -> None:
        """``patchswarm engine transformers`` over host 1's store (it waits for the store and a version)."""
        h = self.hosts[0]
        self.spawn(
            ["engine", "transformers", "--checkpoint", str(self.engine_dir), "--daemon", h.socket,
             "--listen", f"127.0.0.1:{self.engine_port}", "--fence-wait", "30"],
            self.dir / "engine.log",
        )  # fmt: skip

    async def poll(self) -> None:
        while True:
            for h in self.hosts:
                try:
                    h.status = await fetch_status(h.socket, timeout=2)
                except StatusError:
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
        pub = Publisher(self.board, self.trainer, run_id=RUN, served_format="bf16", certificate=cert,
                        chunk_size=256 << 10, anchor_every=4)  # fmt: skip

        def on_version(i: int, model: Trainer) -> None:
            if i == 0:
                model.write_engine_dir(self.engine_dir)  # config (as published) + tokenizer
            served = model.served()
            info = pub.publish(served, metadata=model.metadata())
            assert isinstance(info, PublishInfo)
            self.published[info.version] = Published(
                info.version, info, ServedModel.from_tensors(served), time.monotonic()
            )
            if i == 0:
                self.trainer_state = f"published version {info.version} (warm-up); waiting for the engine"
                self.engine_ready.wait(180)
            else:
                self.trainer_state = f"published version {info.version} (RL step {i})"
                time.sleep(2.0)  # pace the steps so the spreading is visible

        self.trainer_state = "training (warm-up on chat facts at lr 3e-3)"
        train_llama(self.preset, self.steps, on_version, rl_lr=1e-6)
        self.trainer_state = "done"

    async def ask_engine(self, stop: asyncio.Event) -> None:
        """For every published version, a chat request pinned to it (409 until it lands), then its logits."""
        side = f"http://127.0.0.1:{self.sidecar_port}"
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not stop.is_set():
                for v in sorted(self.published):
                    if v in self.answers:
                        continue
                    pin = {"exact_version": v}
                    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                            "temperature": 0, "weight_version": pin}  # fmt: skip
                    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                        async with http.post(f"{side}/v1/chat/completions", json=body) as r:
                            status, out = r.status, await read_json(r, MAX_ANSWER_BYTES)
                        if status == 409 and out.get("error") == "WeightVersionUnavailable":
                            self.answers[v] = None  # host 1 went past it before it was asked
                        elif status == 200:  # else not there yet (409), or the engine still starting (502)
                            if out["weight_version"] != {"start": v, "end": v}:
                                self.errors.append(f"version {v} answered as {out['weight_version']}")
                            text = str(out["choices"][0]["message"]["content"])
                            logp, digest = await self.logits(http, side, v, text)
                            self.answers[v] = Answer(text, logp, digest, time.monotonic())
                            self.engine_ready.set()
                await asyncio.sleep(0.2)

    async def logits(self, http: aiohttp.ClientSession, side: str, v: int, text: str) -> tuple[float | None, str]:
        """The next-token logits of the question on version ``v`` (pinned too): log p of the answer's first
        token and a digest of the logits; ("-") when v was replaced in between."""
        body = {"prompt": chat_ids(QUESTION), "weight_version": {"exact_version": v}}
        async with http.post(f"{side}/patchswarm/v1/logits", json=body) as r:
            if r.status != 200:
                return None, "-"
            out = await read_json(r, MAX_ANSWER_BYTES)
        if out["version"] != v:
            self.errors.append(f"logits of version {v} computed on version {out['version']}")
        logits = torch.tensor(out["logits"], dtype=torch.float32)
        first = text.encode()[0] if text else EOS
        logp = float(torch.log_softmax(logits, dim=-1)[first])
        return logp, hashlib.blake2b(logits.numpy().tobytes(), digest_size=4).hexdigest()

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
        answered = [(v, a) for v, a in sorted(self.answers.items()) if a is not None]
        last = f"   [bold]v{answered[-1][0]}:[/] {QUESTION} {answered[-1][1].text!r}" if answered else ""
        return Group(f"[bold]trainer:[/] {self.trainer_state}   [bold]head:[/] version {head}   "
                     f"[bold]engine answers:[/] {len(self.answers)}{last}", t)  # fmt: skip

    def final_table(self) -> tuple[Table, bool]:
        t = Table(title="patchswarm demo: every version, every host")
        for col in (
            "version",
            "patch bytes",
            "full bytes",
            "patch/full",
            "time to all hosts",
            "bitwise",
            "engine answer (host 1)",
            "log p(1st token)",
            "logits hash",
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
            a = self.answers.get(v)
            if a is None:
                self.errors.append(f"no engine answer for version {v}")
            answer, logp, digest = (repr(a.text), "-" if a.logp is None else f"{a.logp:.6f}", a.digest) if a else "---"
            ratio = f"{100 * size / full:.2f}%" + ("" if p.info.patch_bytes else " (anchor)")
            t.add_row(str(v), f"{size:,}", f"{full:,}", ratio, spread, bitwise, answer, logp, digest)
        return t, ok and not self.errors

    # ------------------------------------------------------------ main

    async def run(self, console: Console) -> bool:
        self.start_seed()
        for i, h in enumerate(self.hosts):
            self.start_host(h, engine=(i == 0))
        trainer = threading.Thread(target=self.train, name="trainer", daemon=True)
        trainer.start()
        poller = asyncio.create_task(self.poll())
        stop = asyncio.Event()
        asker = None
        try:
            with Live(self.live_view(), console=console, refresh_per_second=4) as live:
                while trainer.is_alive() or not self.all_at_head():
                    if asker is None and self.hosts[0].status.get("version"):
                        self.start_engine()  # the trainer wrote its directory before publishing
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
        table, ok = self.final_table()
        console.print(table)
        return ok

    def all_at_head(self) -> bool:
        head = max(self.published, default=None)
        return head is not None and all(h.status.get("version") == head for h in self.hosts)

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


def bounded(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi}, not {n}")
        return n

    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=bounded(1, 16), default=4, help="rollout daemons (1 to 16, default 4)")
    ap.add_argument("--steps", type=bounded(1, 100), default=6, help="RL steps after the warm-up (default 6)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (default small)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, board)")
    args = ap.parse_args(argv)
    console = Console()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the demo needs transformers: pip install 'patchswarm[transformers]'", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="patchswarm-demo-"))
    demo = Demo(workdir, args.hosts, args.steps, args.preset)
    console.print(
        f"[bold]patchswarm demo[/]: trainer + seed + {args.hosts} daemons + a transformers engine on loopback "
        f"(work dir {workdir})"
    )
    try:
        ok = asyncio.run(demo.run(console))
    finally:
        demo.cleanup()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if demo.errors:
        console.print(f"[red]errors:[/] {demo.errors}")
    console.print(
        "[bold green]every host matched the trainer bitwise[/]"
        if ok
        else "[bold red]failed[/]: a host differs from the trainer, or the engine left a version unanswered"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine pause per update relative to a memcpy of the weights it serves (CPU, transformers engine).

    python -m benchmarks.engine_pause_bench [--mb 50,200] [--updates 30] [--stream-updates 12]
                                            [--frac 0.005] [--hidden 1024] [--order both] [--json OUT.json]

Real processes: this process plays the daemon's side (a host shared-memory ``WeightStore`` and the
real ``ZeroCopyEngine`` driver); the engine is a second process (``--serve``, started here) that
attaches to the store as ``patchswarm engine transformers`` does and serves the real
``daemon/openai_api.py`` app on loopback.  The model is a transformers Llama of about ``--mb`` MB of
bf16 (``--hidden``; its layers set the size), random weights, built from its config (no download).

Per update, in the daemon's order (daemon/rollout_activation.py, in_place): ``store.prepare``
(staging, journal + fsync; the engine still serves), ``driver.pause()`` (HTTP), ``store.finish``
(the fenced write; ``--frac`` of the values moved by one or two ulps, versions alternating between
two weight sets), ``driver.commit()`` (HTTP: the engine checks the fence shows the version and
flushes its prefix cache), ``driver.resume()``.  ``--order both`` (the default) alternates these
idle updates with the order before it (``in_pause``: ``store.activate``, staging and journal
included, inside the pause), so both are measured in one run under the same load.

Printed: the pause (pause call start -> resume answered) and its parts, median and [min, max] over
``--updates``, next to a torch ``copy_`` of the served bytes measured in the same run (median of
5), and the ratio pause / memcpy.  Then the same while a client streams a greedy completion (the
request is held between steps): the pause again, and the latency the stream saw added per update
(the gap between the chunks around an update, less the median gap between chunks away from updates).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

from patchswarm.daemon.engine_driver import Activation
from patchswarm.daemon.engine_drivers import ZeroCopyEngine
from patchswarm.daemon.store_format import StoreLayout
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel

VOCAB = 264  # the byte-level tokenizer of daemon/demo_llama.py (256 bytes, 5 specials), rounded up
ASCII = 128  # rows >= this are zeroed: greedy picks ASCII bytes, each one a chunk of text at once
PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "
PARTS = ("pause_http", "journal", "fenced_write", "commit_http", "resume_http")


# ---------------------------------------------------------------- the model and its versions


def llama_config(mb: float, hidden: int) -> Any:
    """A Llama config of about ``mb`` MB of bf16: ``hidden`` wide, as many layers as make the size."""
    import transformers

    inter = (hidden * 11 // 4 + 31) // 32 * 32
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((mb * 1e6 - 2 * VOCAB * hidden) / per_layer))
    heads = max(1, hidden // 64)
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=256, eos_token_id=257, dtype="bfloat16",
    )  # fmt: skip


def versions(config: Any, frac: float, seed: int = 0) -> tuple[ServedModel, ServedModel]:
    """Two bf16 weight sets of ``config``'s parameters: random, then ``frac`` of the values moved by
    one or two ulps (an Adam-like step).  Embedding rows >= ASCII are zero in both (tied: zero logits)."""
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    with torch.device("meta"):
        meta = auto.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:  # norms
            w = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
        if name.endswith("embed_tokens.weight"):
            w[ASCII:] = 0
        words = w.view(torch.int16).flatten()
        k = max(1, int(words.numel() * frac))
        pos = torch.randint(0, words.numel(), (k,), generator=g)
        v = words.clone()
        v[pos] += torch.randint(1, 3, (k,), dtype=torch.int16, generator=g)
        w2 = v.view(torch.bfloat16).view(shape)
        if name.endswith("embed_tokens.weight"):
            w2[ASCII:] = 0
        a[name], b[name] = w, w2
    return ServedModel.from_tensors(a), ServedModel.from_tensors(b)


def write_checkpoint_dir(d: Path, config: Any) -> Path:
    """config.json and the byte-level tokenizer: what the engine reads of DIR when a store serves the weights."""
    from patchswarm.daemon.demo_llama import write_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(d / "config.json"))
    write_tokenizer(d)
    return d


# ---------------------------------------------------------------- the engine process


def serve(info_path: Path, checkpoint: Path) -> None:
    """The engine process: attach to the store, serve the OpenAI app on a free loopback port (printed)."""
    from patchswarm.daemon.engine import attach
    from patchswarm.daemon.openai_api import make_openai_app
    from patchswarm.daemon.sidecar import serve_app
    from patchswarm.daemon.tf_engine import TfEngine

    view = attach(json.loads(info_path.read_text()))
    engine = TfEngine(view, checkpoint)

    async def run() -> None:
        server = await serve_app(make_openai_app(engine), "127.0.0.1", 0)
        print(f"URL {server.url}", flush=True)
        await asyncio.Event().wait()  # until killed

    asyncio.run(run())


class EngineProcess:
    def __init__(self, info: dict[str, Any], checkpoint: Path, work: Path) -> None:
        info_path = work / "attach.json"
        info_path.write_text(json.dumps(info))
        argv = [sys.executable, "-m", "benchmarks.engine_pause_bench", "--serve", str(info_path), "--checkpoint"]
        self.proc = subprocess.Popen([*argv, str(checkpoint)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # (startup: transformers' import, the model on the store's views)
        if not line.startswith("URL "):
            self.close()
            raise RuntimeError(f"the engine process did not start (exit {self.proc.returncode}): {line!r}")
        self.url = line.split()[1]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------- measurements


def memcpy_s(data: torch.Tensor, repeat: int = 5) -> float:
    """Median time of a torch ``copy_`` of ``data`` into a buffer of its size (pages touched first)."""
    dst = torch.empty_like(data)
    dst.fill_(0)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(data)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Updater:
    """Alternates the store between the two weight sets, one version at a time, through the driver."""

    def __init__(self, store: WeightStore, a: ServedModel, b: ServedModel, driver: ZeroCopyEngine, jdir: Path):
        self.store, self.driver, self.jdir = store, driver, jdir
        self.ups = (diff_updates(a, b), diff_updates(b, a))
        self.roots = (b.root(), a.root())  # the root each direction leads to
        self.version = store.header().version
        self.changed = 0

    async def update(self, *, in_pause: bool = False) -> dict[str, float]:
        """One update, timed: the pause (pause call start -> resume answered) and its parts, seconds.
        The daemon's order stages and journals before the pause (``store.prepare``), then writes
        inside it (``store.finish``); ``in_pause`` is the order before that: ``store.activate``
        (staging, journal and write) inside the pause."""
        i = self.version % 2  # version 1 holds a: odd versions go a -> b
        v = self.version + 1
        ups, root = self.ups[1 - i], self.roots[1 - i]
        tp = time.perf_counter()
        prepared = None if in_pause else await asyncio.to_thread(self.store.prepare, v, root, ups, self.jdir)
        t0 = time.perf_counter()
        await self.driver.pause()
        t1 = time.perf_counter()
        if prepared is None:
            st = await asyncio.to_thread(self.store.activate, v, root, ups, self.jdir)
        else:
            st = await asyncio.to_thread(self.store.finish, prepared)
        t2 = time.perf_counter()
        ack = await self.driver.commit(Activation(v, self.version, full=False, flush_cache=True))
        t3 = time.perf_counter()
        await self.driver.resume()
        t4 = time.perf_counter()
        assert ack == v
        self.version, self.changed = v, st.changed
        other = (t2 - t1) - st.pause_s - (st.journal_s if in_pause else 0.0)  # staging (in_pause), thread hand-off
        return {"start": t0, "end": t4, "pause": t4 - t0, "prepare": t0 - tp, "pause_http": t1 - t0,
                "journal": st.journal_s, "fenced_write": st.pause_s, "activate_other": other, "commit_http": t3 - t2,
                "resume_http": t4 - t3}  # fmt: skip


def summary(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    xs = [r[key] for r in rows]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


async def stream_phase(
    up: Updater, url: str, n: int, max_tokens: int, in_pause: bool = False
) -> tuple[list[dict[str, float]], list[float]]:
    """Updates while one client streams a greedy completion; the updates and the chunk arrival times."""
    arrivals: list[float] = []
    rows: list[dict[str, float]] = []
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"the stream answered {resp.status}: {(await resp.text())[:200]}")

        async def read() -> None:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())

        reader = asyncio.create_task(read())
        try:
            while len(arrivals) < 8:  # a few steps first: the gaps away from updates
                if reader.done():
                    raise RuntimeError("the stream ended before the updates")
                await asyncio.sleep(0.005)
            for _ in range(n):
                seen = len(arrivals)
                while len(arrivals) < seen + 4:  # four chunks between updates
                    if reader.done():
                        raise RuntimeError(f"the stream ended after {len(arrivals)} chunks (raise --stream-tokens)")
                    await asyncio.sleep(0.002)
                rows.append(await up.update(in_pause=in_pause))
            seen = len(arrivals)
            while len(arrivals) < seen + 4 and not reader.done():
                await asyncio.sleep(0.002)
        finally:
            reader.cancel()
    return rows, arrivals


def stream_delays(rows: list[dict[str, float]], arrivals: list[float]) -> tuple[float, list[float]]:
    """The median gap between chunks away from updates, and per update the latency it added: the gap
    from the last chunk before the pause call to the first after resume answered, less the gaps the
    chunks inside it account for."""
    gaps = []
    for p, q in itertools.pairwise(arrivals):
        if not any(p < r["end"] and q > r["start"] for r in rows):
            gaps.append(q - p)
    base = statistics.median(gaps)
    added = []
    for r in rows:
        before = [t for t in arrivals if t <= r["start"]]
        after = [t for t in arrivals if t >= r["end"]]
        if not before or not after:
            continue
        inside = sum(1 for t in arrivals if before[-1] < t < after[0])
        added.append((after[0] - before[-1]) - (inside + 1) * base)
    return base, added


async def one_size(mb: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = llama_config(mb, args.hidden)
    a, b = versions(config, args.frac)
    ckpt = write_checkpoint_dir(work / f"ckpt-{mb:g}", config)
    store = WeightStore.create(f"psw-pausebench-{os.getpid()}-{mb:g}", StoreLayout.from_specs(a.specs))
    engine: EngineProcess | None = None
    driver = ZeroCopyEngine("http://127.0.0.1:1")
    try:
        store.load(a, 1, a.root())
        t = time.perf_counter()
        engine = EngineProcess(store.attach_info(), ckpt, work)
        startup = time.perf_counter() - t
        driver = ZeroCopyEngine(engine.url)
        jdir = work / f"journal-{mb:g}"
        jdir.mkdir()
        up = Updater(store, a, b, driver, jdir)
        orders = {"prepared": (False,), "in_pause": (True,), "both": (False, True)}[args.order]
        for o in orders:
            await up.update(in_pause=o)  # warm-up (connections, first scatter), not counted
        idle: dict[bool, list[dict[str, float]]] = {o: [] for o in orders}
        for _ in range(args.updates):  # (both orders: alternating, so that they see the same host load)
            for o in orders:
                idle[o].append(await up.update(in_pause=o))
        streaming, arrivals = await stream_phase(up, engine.url, args.stream_updates, args.stream_tokens, orders[0])
        store.verify(up.roots[0] if up.version % 2 == 0 else up.roots[1])
        mc = memcpy_s(store._require_data())
    finally:
        await driver.close()
        if engine is not None:
            engine.close()
        store.destroy()
    base, added = stream_delays(streaming, arrivals)
    keys = ("pause", *PARTS, "activate_other", "prepare")
    out: dict[str, Any] = {
        "mb": mb, "served_bytes": a.nbytes, "layers": config.num_hidden_layers, "hidden": args.hidden,
        "changed": up.changed, "engine_startup_s": startup, "memcpy_s": mc,
        "order": "in_pause" if orders[0] else "prepared",
        "idle": {k: summary(idle[orders[0]], k) for k in keys},
        "streaming": {k: summary(streaming, k) for k in keys},
        "stream_chunk_gap_s": base, "stream_added_s": added, "stream_chunks": len(arrivals),
        "streaming_rows": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in streaming],
    }  # fmt: skip
    if len(orders) == 2:
        out["idle_in_pause"] = {k: summary(idle[True], k) for k in keys}
        out["in_pause_over_memcpy"] = out["idle_in_pause"]["pause"]["median"] / mc
    out["pause_over_memcpy"] = out["idle"]["pause"]["median"] / mc
    out["streaming_pause_over_memcpy"] = out["streaming"]["pause"]["median"] / mc
    return out


def ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:8.2f} ms  [{s['min'] * 1e3:.2f}, {s['max'] * 1e3:.2f}]"


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{r['served_bytes'] / 1e6:.1f} MB bf16 Llama ({r['layers']} layers x hidden {r['hidden']}), "
          f"{r['changed']:,} values changed per update; engine start-up {r['engine_startup_s']:.1f} s")  # fmt: skip
    phases = [("idle", args.updates, r["order"]), ("streaming", args.stream_updates, r["order"])]
    if "idle_in_pause" in r:
        phases.insert(1, ("idle_in_pause", args.updates, "in_pause"))
    for phase, n, order in phases:
        rows, before = r[phase], order == "prepared"
        print(f"  {phase} ({n} updates, order {order}): median [min, max]")
        if before:
            print(f"    prepare before the pause (staging, journal) {ms(rows['prepare'])}")
        print(f"    pause (pause call -> resume answered) {ms(rows['pause'])}")
        for k in PARTS:
            print(f"      {k:<14} {ms(rows[k])}{'   (before the pause)' if before and k == 'journal' else ''}")
        what = "thread hand-off" if before else "staging + thread hand-off"
        print(f"      {'other':<14} {ms(rows['activate_other'])}   ({what})")
    mc = r["memcpy_s"]
    print(f"  memcpy of the served bytes (torch copy_, median of 5) {mc * 1e3:.2f} ms")
    print(f"  pause / memcpy: idle {r['pause_over_memcpy']:.2f}, streaming {r['streaming_pause_over_memcpy']:.2f}")
    if "in_pause_over_memcpy" in r:
        print(f"  pause / memcpy, staging and journal inside the pause: idle {r['in_pause_over_memcpy']:.2f}")
    added = r["stream_added_s"]
    if added:
        print(f"  stream: {r['stream_chunks']} chunks, median gap {r['stream_chunk_gap_s'] * 1e3:.2f} ms away from "
              f"updates; latency added per update median {statistics.median(added) * 1e3:.2f} ms "
              f"[{min(added) * 1e3:.2f}, {max(added) * 1e3:.2f}]")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="50,200", help="model sizes in MB of bf16, comma-separated")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--frac", type=float, default=0.005, help="fraction of values changed per update")
    ap.add_argument("--updates", type=int, default=30, help="updates measured with no request in flight")
    ap.add_argument("--stream-updates", type=int, default=12, help="updates measured while a client streams")
    ap.add_argument("--stream-tokens", type=int, default=1024, help="max_tokens of the streamed completion")
    ap.add_argument(
        "--order",
        choices=("prepared", "in_pause", "both"),
        default="both",
        help="prepared: staging and journal before the pause (the daemon's order); in_pause: inside it (the "
        "order before); both: idle updates alternate between the two (streaming: prepared)",
    )
    ap.add_argument("--json", default=None, help="also write the measurements to this file")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # (the engine process)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.serve), Path(args.checkpoint))
        return
    sizes = [float(x) for x in args.mb.split(",") if x.strip()]
    if not sizes or min(sizes) <= 0 or args.updates < 1 or args.stream_updates < 1 or not 0 < args.frac <= 1:
        ap.error("--mb, --updates, --stream-updates and --frac must be positive (frac at most 1)")
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}; engine in its own process, loopback HTTP")
    work = Path(tempfile.mkdtemp(prefix="psw-pausebench-"))
    results: dict[str, Any] = {"args": vars(args), "sizes": []}
    try:
        for mb in sizes:
            r = asyncio.run(one_size(mb, args, work))
            report(r, args)
            results["sizes"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""GPU check of the vLLM and SGLang integrations (benchmarks/gpu_check.sh step 7): real servers, real updates.

For each engine that imports here, each TP size that fits the GPUs (1, 2) and each format (bf16, fp8:
the engine's online fp8 quantization of the bf16 checkpoint), a tiny Llama checkpoint is written in
two versions; rank stores (host shared memory, the built-in plan) hold version 1; the engine starts
on version 1 with the patchswarm hook (vLLM: ``--worker-extension-cls``, dev mode; SGLang:
``--custom-weight-loader``), the driver (daemon/copy_drivers.py) attaches, pauses, the stores take
version 2, the driver commits the changed regions and resumes: the pause (pause -> resume) is timed.
Greedy completions of fixed prompts must equal those of the same engine started on version 2.

Exits 0 with one "skipped" line per engine that does not import (no engine wheels on the GPU image
today); non-zero when a check ran and failed.  Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon.copy_drivers import make_sglang_driver, make_vllm_driver
from patchswarm.daemon.engine import attach
from patchswarm.daemon.engine_driver import Activation, Region
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.untrusted_json import load_json

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
MAX_ANSWER = 1 << 20  # a completion of 16 tokens
CONFIG = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False}  # fmt: skip


def checkpoints(root: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    v1 = {k: v.detach().clone() for k, v in m.state_dict().items()}
    v2 = {k: v.clone() for k, v in v1.items()}
    for k in list(v2)[::3]:  # some tensors, a few rows each (about 0.5% of the model)
        v2[k][:2] += 0.05
    dirs = []
    for i, sd in enumerate((v1, v2), 1):
        d = root / f"v{i}"
        m.load_state_dict(sd)
        m.save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1], v1, v2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(engine: str, model: Path, tp: int, fmt: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if engine == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
               "--tensor-parallel-size", str(tp), "--dtype", "bfloat16", "--enforce-eager",
               "--gpu-memory-utilization", "0.25", "--max-model-len", "512",
               "--worker-extension-cls", "patchswarm.daemon.vllm_worker.PatchswarmWorkerExtension"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
               "--tp", str(tp), "--dtype", "bfloat16", "--mem-fraction-static", "0.25",
               "--custom-weight-loader", "patchswarm.daemon.sglang_loader.load_regions"]  # fmt: skip
    if fmt == "fp8":
        cmd += ["--quantization", "fp8"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}) before serving")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the engine did not come up")


def completions(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        body = json.dumps({"prompt": p, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            ans = load_json(r.read(MAX_ANSWER + 1), max_bytes=MAX_ANSWER)
        out.append(ans["choices"][0]["text"])
    return out


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_update(
    engine: str, url: str, tp: int, spec: str, rs: RankStores, v1: ServedModel, v2: ServedModel
) -> float:
    vllm = make_vllm_driver(url, tp, spec) if engine == "vllm" else None
    driver = vllm or make_sglang_driver(url, tp, spec)
    try:
        if vllm is not None:
            await vllm.attach()
        views = [attach(s.attach_info()) for s in rs.stores if s is not None]
        before = [v.data.clone() for v in views]
        t0 = time.perf_counter()
        await driver.pause()
        rs.apply(2, v2, diff_updates(v1, v2))
        regions: dict[int, tuple[Region, ...]] = {}
        for r, (v, b) in enumerate(zip(views, before, strict=True)):
            regs = []
            for s in v.layout.slots:
                d = (v.data[s.offset : s.offset + s.nbytes] != b[s.offset : s.offset + s.nbytes]).nonzero()
                if len(d):
                    regs.append(Region(s.name, int(d[0]), int(d[-1]) + 1))
            regions[r] = tuple(regs)
        ack = await driver.commit(Activation(2, 1, False, regions))
        await driver.resume()
        pause_s = time.perf_counter() - t0
        assert ack == 2 and await driver.served_version() == 2
        for v in views:
            v.close()
        return pause_s
    finally:
        await driver.close()


def case(engine: str, tp: int, fmt: str, root: Path, ckpt: tuple[Path, Path, Any, Any]) -> dict[str, Any]:
    d1, d2, sd1, sd2 = ckpt
    m1 = ServedModel.from_tensors(dict(sorted(sd1.items())))
    m2 = ServedModel.from_tensors(dict(sorted(sd2.items())))
    plan = builtin_plan(load_json((d1 / "config.json").read_bytes(), max_bytes=1 << 20, allow_nan=True), m1.specs, tp)
    name = f"psw-engcheck-{os.getpid()}-{engine}-{tp}-{fmt}"
    (root / name).mkdir()
    rs = RankStores(name, tp, root / name, engine_kind=False)
    rs.prepare(plan, m1.specs)
    rs.apply(1, m1, None)
    spec = json.dumps({"attach": [s.attach_info() for s in rs.stores if s is not None]})
    log = root / f"{engine}.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"engine": engine, "tp": tp, "format": fmt}
    proc = start(engine, d1, tp, fmt, port, log)
    try:
        wait_up(url, proc)
        result["pause_s"] = asyncio.run(one_update(engine, url, tp, spec, rs, m1, m2))
        updated = completions(url)
    finally:
        stop(proc)
        for s in rs.stores:
            if s is not None:
                s.destroy()
    proc = start(engine, d2, tp, fmt, port, log)
    try:
        wait_up(url, proc)
        fresh = completions(url)
    finally:
        stop(proc)
    result["equal_to_fresh_load"] = updated == fresh
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,sglang")
    ap.add_argument("--formats", default="bf16,fp8")
    args = ap.parse_args(argv)
    modules = {"vllm": "vllm", "sglang": "sglang"}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt: tuple[Path, Path, Any, Any] | None = None
        for engine in args.engines.split(","):
            if importlib.util.find_spec(modules[engine]) is None:
                print(f"engines: {engine} skipped: it is not installed on this machine")
                continue
            if gpus == 0:
                print(f"engines: {engine} skipped: no CUDA device")
                continue
            ckpt = ckpt or checkpoints(root)
            for tp in (1, 2):
                if tp > gpus:
                    print(f"engines: {engine} TP={tp} skipped: {gpus} GPU(s)")
                    continue
                for fmt in args.formats.split(","):
                    try:
                        r = case(engine, tp, fmt, root, ckpt)
                    except Exception as e:  # one line per failed case; the others still run
                        r = {"engine": engine, "tp": tp, "format": fmt, "error": f"{type(e).__name__}: {e}"[:400]}
                    failed |= "error" in r or not r.get("equal_to_fresh_load")
                    print(json.dumps(r), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

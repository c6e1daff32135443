"""Issue 33 end to end, real processes: transformers trains a Qwen3-MoE and a Llama (AdamW), each step is
saved as a 2-shard Hugging Face checkpoint and published with the real CLI (the MoE as fp8 e4m3 with
128x128 block scales, the Llama as bf16), a real daemon feeds two rank stores (store.ranks = 2,
store.plan = auto), and after every version each rank's bytes equal the tensor-parallel slices of the
version that ``pull --to DIR`` writes, computed here with torch.chunk / torch.cat by vLLM's rules, not by
the plan code (protocol/layout_*.py).

The MoE's sizes make every tensor-parallel cut a whole number of 128-row (or 128-column) fp8 blocks, as
vLLM requires of block-quantized checkpoints: 2 heads of head_dim 128 (one q head, one kv head per
rank: 128 rows), moe_intermediate_size 256 (128 rows of gate/up, 128 columns of down per rank), o_proj's
256 input columns cut in 128.  hidden 64 is a partial block on the dims that are not cut.

The CUDA variant (engine-allocated rank buffers on cuda:0, store.devices) runs in benchmarks/gpu_check.sh
(tp_ranks); its engine-shm twin runs everywhere."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from patchswarm.daemon.engine import EngineView
from patchswarm.daemon.engine_client import DaemonClient
from patchswarm.daemon.store_format import StoreState
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import raw_bytes
from patchswarm.protocol.trust import Certificate
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.hf_models import tiny_llama, train_step
from tests.support.layout_models import expected_rank
from tests.support.rank_swarm import rank_names
from tests.support.store_worker import remove_segments
from tests.support.swarmkit import RUN, Swarm

transformers = pytest.importorskip("transformers")  # the dev extra

TP = 2
STEPS = 3
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qwen3_moe() -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=512,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str]]] = {
    "qwen3-moe-fp8": (qwen3_moe, ["--served-format", "fp8-e4m3", "--fp8-block", "128"]),
    "llama-bf16": (tiny_llama, ["--served-format", "bf16"]),
}


def cli(*args: str, cwd: Path) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),  # keeps PYTHONPATH: this tree's code
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def save_two_shards(model: torch.nn.Module, path: Path) -> None:
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(path, max_shard_size=int(total * 0.6))
    assert len(list(path.glob("*.safetensors"))) == 2 and (path / "model.safetensors.index.json").is_file()


def load_pulled(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The pulled checkpoint's config.json and tensors (fp8 viewed as uint8: cat/stack on plain bytes)."""
    cfg = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return cfg, {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in tensors.items()}


def kv_chunk(x: torch.Tensor, kv_heads: int, r: int) -> torch.Tensor:
    """Rank r's kv rows: kv heads cut over the ranks, or head r // (TP / kv_heads) when fewer than TP."""
    if kv_heads >= TP:
        return torch.chunk(x, TP, dim=0)[r]
    return torch.chunk(x, kv_heads, dim=0)[r // (TP // kv_heads)]


def expected(cfg: dict[str, Any], t: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s runtime tensors: the weights by layout_models' rules, the fp8 block scales
    (``weight_scale_inv``) cut exactly as their weights, one scale row (or column) per 128 weight
    rows (columns): vLLM's block-fp8 weight_loader with per-rank cuts of whole blocks."""
    out = expected_rank(cfg, t, TP, r)
    kvh = cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if a + "q_proj.weight_scale_inv" not in t:
            continue
        out[a + "qkv_proj.weight_scale_inv"] = torch.cat(
            [
                torch.chunk(t[a + "q_proj.weight_scale_inv"], TP, dim=0)[r],
                kv_chunk(t[a + "k_proj.weight_scale_inv"], kvh, r),
                kv_chunk(t[a + "v_proj.weight_scale_inv"], kvh, r),
            ]
        )
        out[a + "o_proj.weight_scale_inv"] = torch.chunk(t[a + "o_proj.weight_scale_inv"], TP, dim=1)[r]
        e = p + "mlp.experts."
        ne = sum(1 for n in t if n.startswith(e) and n.endswith("gate_proj.weight_scale_inv"))
        out[e + "w13_weight_scale_inv"] = torch.stack(
            [
                torch.cat(
                    [
                        torch.chunk(t[e + f"{x}.gate_proj.weight_scale_inv"], TP, dim=0)[r],
                        torch.chunk(t[e + f"{x}.up_proj.weight_scale_inv"], TP, dim=0)[r],
                    ]
                )
                for x in range(ne)
            ]
        )
        out[e + "w2_weight_scale_inv"] = torch.stack(
            [torch.chunk(t[e + f"{x}.down_proj.weight_scale_inv"], TP, dim=1)[r] for x in range(ne)]
        )
    return out


def check_host_ranks(store: str, version: int, cfg: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
    for r, name in enumerate(rank_names(store, TP)):
        s = WeightStore.open(name)
        try:
            h = s.header()
            assert h.state == StoreState.READY and h.stable and h.version == version, (r, h)
            want = expected(cfg, t, r)
            assert [x.name for x in s.layout.specs] == sorted(want), r
            for i, spec in enumerate(s.layout.specs):
                assert torch.equal(s.slot_bytes(i), raw_bytes(want[spec.name])), f"rank {r} {spec.name} v{version}"
            assert s.root() == h.root, f"rank {r}: root does not verify"
        finally:
            s.close()


def check_view(view: EngineView, r: int, cfg: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
    want = expected(cfg, t, r)
    assert [x.name for x in view.layout.specs] == sorted(want), r
    data = view.data.cpu() if view.data.device.type != "cpu" else view.data
    for s in view.layout.slots:
        assert torch.equal(data[s.offset : s.offset + s.nbytes], raw_bytes(want[s.name])), f"rank {r} {s.name}"


class Run:
    """The trainer side: a model, its optimizer, the CLI publishing to the swarm's board, pulls."""

    def __init__(self, tmp: Path, sw: Swarm, model_id: str) -> None:
        build, self.fmt = MODELS[model_id]
        self.tmp, self.model = tmp, build()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        sw.trainer.save(tmp / "trainer.key")
        sw.root.save(tmp / "root.key")
        now = int(time.time() * 1000)
        cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root)
        (tmp / "trainer.cert").write_bytes(cert.to_bytes())

    def step(self, step: int) -> None:
        train_step(self.model, self.opt, step)
        ck = self.tmp / f"step{step}"
        save_two_shards(self.model, ck)
        cert = ["--cert", "trainer.cert"] if step == 1 else []
        args = ["--board", "board", "--key", "trainer.key", "--run-id", RUN, *self.fmt, *cert]
        out = cli("publish", ck.name, *args, cwd=self.tmp)
        assert f"published version {step}" in out, out

    def pull(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        to = ["--to", "pulled"] if step == 1 else ["--to", "pulled/", "--have", "pulled"]
        out = cli("pull", "--from", "board", "--run", RUN, "--trust", "root.key.pub", *to, cwd=self.tmp)
        assert f"version {step}" in out, out
        cfg, t = load_pulled(self.tmp / "pulled")
        if "fp8-e4m3" in self.fmt:
            assert t["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8  # (fp8 bytes)
            assert t["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 1)
        return cfg, t


def rank_daemon(sw: Swarm, tmp: Path, kind: str = "shm", device: str = "cpu") -> Daemon:
    d = make_daemon(sw, "ranks", tmp)
    d.env.update(PATCHSWARM_STORE_RANKS=str(TP), PATCHSWARM_STORE_PLAN="auto")
    if kind != "shm":
        devices = "" if kind != "cuda" else f"devices = {json.dumps([device] * TP)}\n"
        d.config.write_text(d.config.read_text().replace("[store]\n", f'[store]\nkind = "{kind}"\n{devices}', 1))
    return d


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("model_id", list(MODELS))
async def test_trained_checkpoints_land_sliced_in_every_rank_store(tmp_path: Path, model_id: str) -> None:
    sw = Swarm(tmp_path)
    run = Run(tmp_path, sw, model_id)
    run.step(1)
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path)
    d.start()
    try:
        before: dict[str, torch.Tensor] | None = None
        for step in range(1, STEPS + 1):
            if step > 1:
                run.step(step)
            st = await d.wait_version(step)
            assert [(x["rank"], x["version"], x["state"]) for x in st["ranks"]] == [
                (k, step, "ready") for k in range(TP)
            ]
            cfg, t = await asyncio.to_thread(run.pull, step)
            if before is not None:  # AdamW at lr 1e-3: the served weights really move
                assert any(not torch.equal(t[k], before[k]) for k in t)
            before = t
            check_host_ranks(d.store, step, cfg, t)
        assert await d.stop() == 0
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "device"),
    [pytest.param("engine-shm", "cpu", id="engine-shm"), pytest.param("cuda", "cuda:0", id="cuda", marks=CUDA)],
)
async def test_engine_rank_buffers_hold_their_slices(tmp_path: Path, kind: str, device: str) -> None:
    """An engine (this process) allocates each rank's buffer (on cuda:0 for both ranks with store.kind
    cuda, one GPU standing for two) and registers it with open_store(rank=...); after every version each
    buffer holds its rank's slice of the pulled fp8 MoE, and its fence reads the daemon's root."""
    sw = Swarm(tmp_path)
    run = Run(tmp_path, sw, "qwen3-moe-fp8")
    run.step(1)
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, kind, device)
    d.start()
    views: list[EngineView] = []
    try:
        client = DaemonClient(d.socket)
        for r in range(TP):
            views.append(await asyncio.to_thread(client.open_store, device, f"tp-rank{r}", 60.0, r))
        for step in range(1, STEPS + 1):
            if step > 1:
                run.step(step)
            st = await d.wait_version(step)
            cfg, t = await asyncio.to_thread(run.pull, step)
            for r, view in enumerate(views):
                assert view.read_version() == (step, bytes.fromhex(st["ranks"][r]["root"]))
                check_view(view, r, cfg, t)
        assert await d.stop() == 0
    finally:
        for view in views:
            view.close()
        d.cleanup()
        remove_segments(d.store)
        await sw.close()

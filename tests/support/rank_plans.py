"""Small layout plans and models for the rank-store tests, built with protocol.layout_plan's PlanBuilder.

``split_plan``: every 2-D tensor is cut by rows into ``world`` equal parts (column-parallel), except
``q``/``k`` which are fused per rank into one ``qk.weight`` (q's rows of the rank, then k's), and 1-D
tensors are replicated.  ``expected_rank`` computes a rank's tensors from a canonical model with
torch.chunk / cat, independently of the plan, so the tests compare two derivations.
"""

from __future__ import annotations

import numpy as np
import torch

from patchswarm.protocol.layout_plan import LayoutPlan, PlanBuilder, full_box
from patchswarm.protocol.served import ServedModel, TensorSpec

SPECS = [
    TensorSpec("down.weight", "BF16", (64, 48)),
    TensorSpec("k.weight", "BF16", (32, 48)),
    TensorSpec("norm.weight", "F32", (48,)),
    TensorSpec("q.weight", "BF16", (64, 48)),
    TensorSpec("up.weight", "F16", (128, 16)),
]
FUSED = ("q.weight", "k.weight")
# one word width (a 1-D tensor changed sparsely): the rank stores route these in one pass
# (protocol/layout_flat.py); SPECS' F32 norm, changed densely, takes the per-parameter routing
ONE_WIDTH = [*SPECS[:2], TensorSpec("ln.weight", "BF16", (48,)), *SPECS[3:]]


def split_plan(specs: list[TensorSpec], world: int, *, leave_out: str | None = None) -> LayoutPlan:
    b = PlanBuilder(world, "test-split")
    by = {s.name: s for s in specs}
    q, k = by[FUSED[0]], by[FUSED[1]]
    for r in range(world):
        qr, kr = q.shape[0] // world, k.shape[0] // world
        b.param(r, "qk.weight", (qr + kr, q.shape[1]), q.dtype)
        b.place(q.name, r, "qk.weight", ((r * qr, (r + 1) * qr), (0, q.shape[1])), ((0, qr), (0, q.shape[1])))
        b.place(k.name, r, "qk.weight", ((r * kr, (r + 1) * kr), (0, k.shape[1])), ((qr, qr + kr), (0, k.shape[1])))
        for s in specs:
            if s.name in FUSED or s.name == leave_out:
                continue
            if len(s.shape) == 1:
                b.param(r, s.name, s.shape, s.dtype)
                b.place(s.name, r, s.name, full_box(s.shape), full_box(s.shape))
                continue
            rows = s.shape[0] // world
            b.param(r, s.name, (rows, s.shape[1]), s.dtype)
            b.place(s.name, r, s.name, ((r * rows, (r + 1) * rows), (0, s.shape[1])), full_box((rows, s.shape[1])))
    return b.build()


def expected_rank(model: ServedModel, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors by the engine's rules (torch.chunk along rows, q then k fused)."""
    t = {s.name: model.typed(i) for i, s in enumerate(model.specs)}
    out = {n: torch.chunk(v, world, 0)[rank] if v.dim() == 2 else v for n, v in t.items() if n not in FUSED}
    out["qk.weight"] = torch.cat([torch.chunk(t[n], world, 0)[rank] for n in FUSED])
    return out


def version_model(seed: int, k: int, specs: list[TensorSpec] = SPECS) -> ServedModel:
    """Version ``k``: a fixed base with ~3% of each tensor's words rewritten per version; norm dense."""
    base = np.random.default_rng(seed)
    data = []
    for s in specs:
        raw = base.integers(0, 256, size=s.nbytes, dtype=np.uint8)
        w = raw.view(f"<i{s.dt.width}")
        for j in range(2, k + 1):
            step = np.random.default_rng([seed, j, len(s.name)])
            if s.name == "norm.weight":
                w[:] = step.integers(-(2**20), 2**20, size=w.size)
            else:
                idx = step.choice(w.size, size=max(1, w.size // 32), replace=False)
                w[idx] = step.integers(-(2**10), 2**10, size=idx.size)
        data.append(torch.from_numpy(raw.copy()))
    return ServedModel(list(specs), data)


# ---------------------------------------------------------------- a tiny Llama (transformers), vLLM's TP rules

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,  # padded to 512 by the engine: the last rank's rows past 500 are zero
    "tie_word_embeddings": False,
}


def llama_state(seed: int) -> tuple[dict[str, torch.Tensor], str]:
    """A tiny LlamaForCausalLM's state dict (float32) and its config.json text, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**LLAMA)
    model = LlamaForCausalLM(cfg)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    return state, cfg.to_json_string()


def llama_rank(typed: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s runtime parameters by vLLM's rules, with torch.chunk / cat (models/llama.py,
    layers/linear.py QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear,
    layers/vocab_parallel_embedding.py: vocab padded to a multiple of 64, then equal shards)."""
    heads, kv = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for name, t in typed.items():
        if name.endswith("norm.weight"):
            out[name] = t
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-t.shape[0] // 64) * 64
            full = torch.zeros((padded, t.shape[1]), dtype=t.dtype)
            full[: t.shape[0]] = t
            out[name] = torch.chunk(full, tp, 0)[rank]
    for layer in range(LLAMA["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        q = torch.chunk(typed[p + "self_attn.q_proj.weight"], tp, 0)[rank]
        if tp <= kv:
            k = torch.chunk(typed[p + "self_attn.k_proj.weight"], tp, 0)[rank]
            v = torch.chunk(typed[p + "self_attn.v_proj.weight"], tp, 0)[rank]
        else:  # fewer kv heads than ranks: each kv head replicated on tp / kv ranks
            k = torch.chunk(typed[p + "self_attn.k_proj.weight"], kv, 0)[rank // (tp // kv)]
            v = torch.chunk(typed[p + "self_attn.v_proj.weight"], kv, 0)[rank // (tp // kv)]
        assert heads % tp == 0
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        out[p + "self_attn.o_proj.weight"] = torch.chunk(typed[p + "self_attn.o_proj.weight"], tp, 1)[rank]
        gate = torch.chunk(typed[p + "mlp.gate_proj.weight"], tp, 0)[rank]
        up = torch.chunk(typed[p + "mlp.up_proj.weight"], tp, 0)[rank]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        out[p + "mlp.down_proj.weight"] = torch.chunk(typed[p + "mlp.down_proj.weight"], tp, 1)[rank]
    return out

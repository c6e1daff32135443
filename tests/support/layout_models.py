"""Tiny canonical checkpoints (Hugging Face names, random values) and each rank's expected runtime
tensors computed by the engine's rules written out directly with torch.chunk / torch.cat, independent
of protocol/layout_*.py: the layout plan tests (and the rank store tests) compare against these.

The rules (vLLM, model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe/layer.py):
q heads chunked over ranks; kv heads chunked, or, with fewer kv heads than ranks, kv head
r // (tp / kv_heads) on rank r; qkv_proj = cat(q, k, v); gate_up_proj = cat(gate, up); o_proj and
down_proj chunked on the input dim; vocabulary padded with zero rows to a multiple of 64 then chunked;
experts: w13_weight[e] = cat(gate_e, up_e) chunks, w2_weight[e] = down_e chunk on dim 1, or with expert
parallelism whole experts, rank r holding experts chunk(range(E), tp)[r].
"""

from __future__ import annotations

from typing import Any

import torch

from patchswarm.protocol.served import ServedModel


def llama_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 500,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def qwen2_config(**over: Any) -> dict[str, Any]:
    return llama_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **over)


def qwen3_moe_config(**over: Any) -> dict[str, Any]:
    cfg = llama_config(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=8,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
    )
    cfg.update(over)
    return cfg


def deepseek_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 2,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def canonical(cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tensors with the checkpoint names and shapes of ``cfg``'s family."""
    gen = torch.Generator().manual_seed(seed)
    h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    mt = cfg["model_type"]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _rand(gen, cfg["vocab_size"], h, dtype=dtype)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = _rand(gen, cfg["vocab_size"], h, dtype=dtype)
    t["model.norm.weight"] = _rand(gen, h, dtype=dtype)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _rand(gen, h, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = _rand(gen, h, dtype=dtype)
        if mt.startswith("deepseek"):
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            t[p + "self_attn.q_a_proj.weight"] = _rand(gen, cfg["q_lora_rank"], h, dtype=dtype)
            t[p + "self_attn.q_a_layernorm.weight"] = _rand(gen, cfg["q_lora_rank"], dtype=dtype)
            t[p + "self_attn.q_b_proj.weight"] = _rand(gen, nh * qk, cfg["q_lora_rank"], dtype=dtype)
            t[p + "self_attn.kv_a_proj_with_mqa.weight"] = _rand(
                gen, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h, dtype=dtype
            )
            t[p + "self_attn.kv_a_layernorm.weight"] = _rand(gen, cfg["kv_lora_rank"], dtype=dtype)
            t[p + "self_attn.kv_b_proj.weight"] = _rand(
                gen, nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"], dtype=dtype
            )
            t[p + "self_attn.o_proj.weight"] = _rand(gen, h, nh * cfg["v_head_dim"], dtype=dtype)
        else:
            t[p + "self_attn.q_proj.weight"] = _rand(gen, nh * hd, h, dtype=dtype)
            t[p + "self_attn.k_proj.weight"] = _rand(gen, kvh * hd, h, dtype=dtype)
            t[p + "self_attn.v_proj.weight"] = _rand(gen, kvh * hd, h, dtype=dtype)
            t[p + "self_attn.o_proj.weight"] = _rand(gen, h, nh * hd, dtype=dtype)
            if mt == "qwen2":
                for m in ("q", "k", "v"):
                    rows = t[p + f"self_attn.{m}_proj.weight"].shape[0]
                    t[p + f"self_attn.{m}_proj.bias"] = _rand(gen, rows, dtype=dtype)
            if mt in ("qwen3", "qwen3_moe"):
                t[p + "self_attn.q_norm.weight"] = _rand(gen, hd, dtype=dtype)
                t[p + "self_attn.k_norm.weight"] = _rand(gen, hd, dtype=dtype)
        moe = mt == "qwen3_moe" or (mt.startswith("deepseek") and i >= cfg["first_k_dense_replace"])
        if moe:
            ne = cfg["num_experts"] if mt == "qwen3_moe" else cfg["n_routed_experts"]
            mi = cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = _rand(gen, ne, h, dtype=dtype)
            for e in range(ne):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = _rand(gen, mi, h, dtype=dtype)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = _rand(gen, mi, h, dtype=dtype)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = _rand(gen, h, mi, dtype=dtype)
            if mt.startswith("deepseek"):
                t[p + "mlp.gate.e_score_correction_bias"] = _rand(gen, ne, dtype=torch.float32)
                si = mi * cfg["n_shared_experts"]
                t[p + "mlp.shared_experts.gate_proj.weight"] = _rand(gen, si, h, dtype=dtype)
                t[p + "mlp.shared_experts.up_proj.weight"] = _rand(gen, si, h, dtype=dtype)
                t[p + "mlp.shared_experts.down_proj.weight"] = _rand(gen, h, si, dtype=dtype)
        else:
            it = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = _rand(gen, it, h, dtype=dtype)
            t[p + "mlp.up_proj.weight"] = _rand(gen, it, h, dtype=dtype)
            t[p + "mlp.down_proj.weight"] = _rand(gen, h, it, dtype=dtype)
    return t


def model_of(tensors: dict[str, torch.Tensor]) -> ServedModel:
    return ServedModel.from_tensors(tensors)


def _kv_chunk(x: torch.Tensor, kvh: int, tp: int, r: int) -> torch.Tensor:
    if kvh >= tp:
        return torch.chunk(x, tp, dim=0)[r]
    return torch.chunk(x, kvh, dim=0)[r // (tp // kvh)]


def _vocab(x: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    padded_rows = -(-x.shape[0] // 64) * 64
    pad = torch.zeros(padded_rows - x.shape[0], *x.shape[1:], dtype=x.dtype)
    return torch.chunk(torch.cat([x, pad]), tp, dim=0)[r]


def expected_rank(
    cfg: dict[str, Any], t: dict[str, torch.Tensor], tp: int, r: int, *, ep: bool = False
) -> dict[str, torch.Tensor]:
    """Rank ``r``'s runtime tensors by the engine's rules, from the canonical tensors ``t``."""
    kvh = cfg["num_key_value_heads"]
    mt = cfg["model_type"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _vocab(t["model.embed_tokens.weight"], tp, r)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = _vocab(t["lm_head.weight"], tp, r)
    for name, x in t.items():
        if name.endswith("norm.weight") or name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight"):
            out[name] = x
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if mt.startswith("deepseek"):
            out[a + "fused_qkv_a_proj.weight"] = torch.cat(
                [t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]]
            )
            out[a + "q_b_proj.weight"] = torch.chunk(t[a + "q_b_proj.weight"], tp, dim=0)[r]
            out[a + "kv_b_proj.weight"] = torch.chunk(t[a + "kv_b_proj.weight"], tp, dim=0)[r]
        else:
            for kind in ("weight", "bias"):
                if a + f"q_proj.{kind}" in t:
                    out[a + f"qkv_proj.{kind}"] = torch.cat(
                        [
                            torch.chunk(t[a + f"q_proj.{kind}"], tp, dim=0)[r],
                            _kv_chunk(t[a + f"k_proj.{kind}"], kvh, tp, r),
                            _kv_chunk(t[a + f"v_proj.{kind}"], kvh, tp, r),
                        ]
                    )
        out[a + "o_proj.weight"] = torch.chunk(t[a + "o_proj.weight"], tp, dim=1)[r]
        for mlp in ("mlp.", "mlp.shared_experts."):
            if p + mlp + "gate_proj.weight" in t:
                out[p + mlp + "gate_up_proj.weight"] = torch.cat(
                    [
                        torch.chunk(t[p + mlp + "gate_proj.weight"], tp, dim=0)[r],
                        torch.chunk(t[p + mlp + "up_proj.weight"], tp, dim=0)[r],
                    ]
                )
                out[p + mlp + "down_proj.weight"] = torch.chunk(t[p + mlp + "down_proj.weight"], tp, dim=1)[r]
        if p + "mlp.experts.0.gate_proj.weight" in t:
            ne = sum(1 for n in t if n.startswith(p + "mlp.experts.") and n.endswith("gate_proj.weight"))
            if ep:
                mine = torch.chunk(torch.arange(ne), tp)[r].tolist()
                w13 = [
                    torch.cat([t[p + f"mlp.experts.{e}.gate_proj.weight"], t[p + f"mlp.experts.{e}.up_proj.weight"]])
                    for e in mine
                ]
                w2 = [t[p + f"mlp.experts.{e}.down_proj.weight"] for e in mine]
            else:
                w13 = [
                    torch.cat(
                        [
                            torch.chunk(t[p + f"mlp.experts.{e}.gate_proj.weight"], tp, dim=0)[r],
                            torch.chunk(t[p + f"mlp.experts.{e}.up_proj.weight"], tp, dim=0)[r],
                        ]
                    )
                    for e in range(ne)
                ]
                w2 = [torch.chunk(t[p + f"mlp.experts.{e}.down_proj.weight"], tp, dim=1)[r] for e in range(ne)]
            out[p + "mlp.experts.w13_weight"] = torch.stack(w13)
            out[p + "mlp.experts.w2_weight"] = torch.stack(w2)
    return out

"""fp8 scales in the built-in plans, against vLLM's loader layout written out here with chunk / cat:
per-tensor ``weight_scale`` of a fused linear becomes one element per source (w13_weight_scale [E, 2],
w2_weight_scale [E], o_proj's [1]); 128x128 block ``weight_scale_inv`` is cut with the weight's blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.served import ServedModel, TensorSpec
from tests.support.layout_models import canonical, expected_rank, llama_config, qwen3_moe_config

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_CACHE: dict[tuple[str, int, bool], dict[str, torch.Tensor]] = {}


def _fp8(cfg: dict[str, Any], block: bool) -> dict[str, torch.Tensor]:
    key = (cfg["model_type"], cfg["num_attention_heads"], block)
    if key not in _CACHE:
        _CACHE[key] = _make_fp8(cfg, block)
    return _CACHE[key]


def _make_fp8(cfg: dict[str, Any], block: bool) -> dict[str, torch.Tensor]:
    t = canonical(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    for name in list(t):
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEAR):
            w = t[name]
            t[name] = w.float().clamp(-400, 400).to(torch.float8_e4m3fn)
            module = name[: -len(".weight")]
            if block:
                shape = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                t[module + ".weight_scale_inv"] = torch.rand(*shape, generator=gen) + 0.5
            else:
                t[module + ".weight_scale"] = torch.rand((), generator=gen) + 0.5
    return t


def _kv(x: torch.Tensor, kvh: int, tp: int, r: int) -> torch.Tensor:
    return torch.chunk(x, tp)[r] if kvh >= tp else torch.chunk(x, kvh)[r // (tp // kvh)]


def _expected_scales(
    cfg: dict[str, Any], t: dict[str, torch.Tensor], tp: int, r: int, ep: bool, block: bool
) -> dict[str, torch.Tensor]:
    kvh = cfg["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if block:
            out[a + "qkv_proj.weight_scale_inv"] = torch.cat(
                [
                    torch.chunk(t[a + "q_proj.weight_scale_inv"], tp)[r],
                    _kv(t[a + "k_proj.weight_scale_inv"], kvh, tp, r),
                    _kv(t[a + "v_proj.weight_scale_inv"], kvh, tp, r),
                ]
            )
            out[a + "o_proj.weight_scale_inv"] = torch.chunk(t[a + "o_proj.weight_scale_inv"], tp, dim=1)[r]
        else:
            out[a + "qkv_proj.weight_scale"] = torch.stack([t[a + f"{m}_proj.weight_scale"] for m in "qkv"])
            out[a + "o_proj.weight_scale"] = t[a + "o_proj.weight_scale"].reshape(1)
        if p + "mlp.gate_proj.weight" in t:
            if block:
                out[p + "mlp.gate_up_proj.weight_scale_inv"] = torch.cat(
                    [torch.chunk(t[p + f"mlp.{m}_proj.weight_scale_inv"], tp)[r] for m in ("gate", "up")]
                )
                out[p + "mlp.down_proj.weight_scale_inv"] = torch.chunk(
                    t[p + "mlp.down_proj.weight_scale_inv"], tp, dim=1
                )[r]
            else:
                out[p + "mlp.gate_up_proj.weight_scale"] = torch.stack(
                    [t[p + "mlp.gate_proj.weight_scale"], t[p + "mlp.up_proj.weight_scale"]]
                )
                out[p + "mlp.down_proj.weight_scale"] = t[p + "mlp.down_proj.weight_scale"].reshape(1)
        if p + "mlp.experts.0.gate_proj.weight" in t:
            ne = cfg["num_experts"]
            mine = torch.chunk(torch.arange(ne), tp)[r].tolist() if ep else list(range(ne))
            e_ = f"{p}mlp.experts."
            if block:
                part = (lambda x, dim: x) if ep else (lambda x, dim: torch.chunk(x, tp, dim=dim)[r])
                out[e_ + "w13_weight_scale_inv"] = torch.stack(
                    [
                        torch.cat([part(t[f"{e_}{e}.{m}_proj.weight_scale_inv"], 0) for m in ("gate", "up")])
                        for e in mine
                    ]
                )
                out[e_ + "w2_weight_scale_inv"] = torch.stack(
                    [part(t[f"{e_}{e}.down_proj.weight_scale_inv"], 1) for e in mine]
                )
            else:
                out[e_ + "w13_weight_scale"] = torch.stack(
                    [
                        torch.stack([t[f"{e_}{e}.gate_proj.weight_scale"], t[f"{e_}{e}.up_proj.weight_scale"]])
                        for e in mine
                    ]
                )
                out[e_ + "w2_weight_scale"] = torch.stack([t[f"{e_}{e}.down_proj.weight_scale"] for e in mine])
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


DENSE = llama_config(
    hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=256,
    vocab_size=128, num_hidden_layers=1,
)  # fmt: skip
MOE = qwen3_moe_config(
    hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, moe_intermediate_size=256,
    num_experts=4, vocab_size=128, num_hidden_layers=1,
)  # fmt: skip


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize(("cfg", "tp", "ep"), [(DENSE, 1, False), (DENSE, 2, False), (MOE, 2, False), (MOE, 2, True)])
def test_fp8_scales_follow_the_weights(cfg: dict[str, Any], tp: int, ep: bool, block: bool) -> None:
    t = _fp8(cfg, block)
    model = ServedModel.from_tensors(t)
    plan = builtin_plan(cfg, model.specs, tp, expert_parallel=ep)
    for r in range(tp):
        got = rank_model(plan, model, r)
        want = {**expected_rank(cfg, t, tp, r, ep=ep), **_expected_scales(cfg, t, tp, r, ep, block)}
        assert [s.name for s in got.specs] == sorted(want)
        for i, s in enumerate(got.specs):
            assert s.shape == tuple(want[s.name].shape), s.name
            assert torch.equal(_bits(got.typed(i)), _bits(want[s.name])), f"rank {r} {s.name}"


def test_fp8_blocks_that_do_not_divide_refused() -> None:
    t = _fp8(DENSE, block=True)
    model = ServedModel.from_tensors(t)
    # 2 q heads of 128 rows on 4 ranks: heads do not divide (vLLM refuses too)
    with pytest.raises(PlanError, match=r"heads \(2\) does not divide by 4"):
        builtin_plan(DENSE, model.specs, 4)
    cfg = llama_config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, intermediate_size=256,
        vocab_size=128, num_hidden_layers=1,
    )  # fmt: skip
    model = ServedModel.from_tensors(_fp8(cfg, block=True))
    with pytest.raises(PlanError, match=r"self_attn.q_proj: 64 rows per rank do not fill 128-row blocks"):
        builtin_plan(cfg, model.specs, 4)


def _deepseek_v3_specs(layers: int) -> list[TensorSpec]:
    """DeepSeek-V3's real shapes (block fp8), first layer dense, the rest MoE; specs only, no bytes."""
    cd = lambda n: -(-n // 128)  # noqa: E731
    h, nh, ql, kl, rope, nope, vd, inter, mi, ne, vocab = 7168, 128, 1536, 512, 64, 128, 128, 18432, 2048, 256, 129280
    out: list[TensorSpec] = []

    def lin(name: str, rows: int, cols: int) -> None:
        out.append(TensorSpec(name + ".weight", "F8_E4M3", (rows, cols)))
        out.append(TensorSpec(name + ".weight_scale_inv", "F32", (cd(rows), cd(cols))))

    out += [
        TensorSpec("model.embed_tokens.weight", "BF16", (vocab, h)),
        TensorSpec("lm_head.weight", "BF16", (vocab, h)),
    ]
    out.append(TensorSpec("model.norm.weight", "BF16", (h,)))
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, size in [("input_layernorm", h), ("post_attention_layernorm", h)]:
            out.append(TensorSpec(f"{p}{n}.weight", "BF16", (size,)))
        for n, size in [("q_a_layernorm", ql), ("kv_a_layernorm", kl)]:
            out.append(TensorSpec(f"{p}self_attn.{n}.weight", "BF16", (size,)))
        lin(p + "self_attn.q_a_proj", ql, h)
        lin(p + "self_attn.q_b_proj", nh * (nope + rope), ql)
        lin(p + "self_attn.kv_a_proj_with_mqa", kl + rope, h)
        lin(p + "self_attn.kv_b_proj", nh * (nope + vd), kl)
        lin(p + "self_attn.o_proj", h, nh * vd)
        if i == 0:
            for n in ("gate_proj", "up_proj"):
                lin(f"{p}mlp.{n}", inter, h)
            lin(p + "mlp.down_proj", h, inter)
            continue
        out.append(TensorSpec(p + "mlp.gate.weight", "BF16", (ne, h)))
        out.append(TensorSpec(p + "mlp.gate.e_score_correction_bias", "F32", (ne,)))
        for m in ("shared_experts", *(f"experts.{e}" for e in range(ne))):
            lin(f"{p}mlp.{m}.gate_proj", mi, h)
            lin(f"{p}mlp.{m}.up_proj", mi, h)
            lin(f"{p}mlp.{m}.down_proj", h, mi)
    return sorted(out, key=lambda s: s.name)


@pytest.mark.parametrize("ep", [False, True])
def test_deepseek_v3_real_shapes_at_tp8(ep: bool) -> None:
    cfg = {"model_type": "deepseek_v3", "num_attention_heads": 128, "num_key_value_heads": 128}
    cfg |= {"n_routed_experts": 256, "num_hidden_layers": 2}
    plan = builtin_plan(cfg, _deepseek_v3_specs(2), 8, expert_parallel=ep)
    shapes = {s.name: (s.dtype, list(s.shape)) for s in plan.rank_specs(5)}
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    # vLLM: fused_qkv_a_proj replicated (1536 + 576 rows, scales 12 + 5 blocks), q_b / kv_b by heads
    assert shapes[a + "fused_qkv_a_proj.weight"] == ("F8_E4M3", [2112, 7168])
    assert shapes[a + "fused_qkv_a_proj.weight_scale_inv"] == ("F32", [17, 56])
    assert shapes[a + "q_b_proj.weight"] == ("F8_E4M3", [3072, 1536])
    assert shapes[a + "kv_b_proj.weight_scale_inv"] == ("F32", [32, 4])
    assert shapes[a + "o_proj.weight_scale_inv"] == ("F32", [56, 16])
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == ("F8_E4M3", [4608, 7168])
    assert shapes[m + "shared_experts.gate_up_proj.weight_scale_inv"] == ("F32", [4, 56])
    assert shapes["lm_head.weight"] == ("BF16", [16160, 7168])
    if ep:
        assert shapes[m + "experts.w13_weight"] == ("F8_E4M3", [32, 4096, 7168])
        assert shapes[m + "experts.w2_weight_scale_inv"] == ("F32", [32, 56, 16])
    else:
        assert shapes[m + "experts.w13_weight"] == ("F8_E4M3", [256, 512, 7168])
        assert shapes[m + "experts.w13_weight_scale_inv"] == ("F32", [256, 4, 56])
        assert shapes[m + "experts.w2_weight_scale_inv"] == ("F32", [256, 56, 2])

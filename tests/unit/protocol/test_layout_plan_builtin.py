"""Built-in layout plans against the engine's rules computed independently (tests/support/layout_models.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_builtin import builtin_plan, family_of
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.served import ServedModel
from tests.support.layout_models import (
    canonical,
    deepseek_config,
    expected_rank,
    llama_config,
    qwen2_config,
    qwen3_moe_config,
)


def _assert_ranks(cfg: dict[str, Any], tp: int, *, ep: bool = False, seed: int = 0) -> None:
    tensors = canonical(cfg, seed=seed)
    model = ServedModel.from_tensors(tensors)
    plan = builtin_plan(cfg, model.specs, tp, expert_parallel=ep)
    for r in range(tp):
        got = rank_model(plan, model, r)
        want = expected_rank(cfg, tensors, tp, r, ep=ep)
        assert [s.name for s in got.specs] == sorted(want), f"rank {r} parameter names"
        for i, s in enumerate(got.specs):
            w = want[s.name]
            assert s.shape == tuple(w.shape), s.name
            bits = torch.int16 if w.element_size() == 2 else torch.int32
            assert torch.equal(got.typed(i).view(bits), w.view(bits)), f"rank {r} {s.name}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_gqa(tp: int) -> None:
    _assert_ranks(llama_config(), tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_eight_heads_one_kv_head(tp: int) -> None:
    # 8 q heads, 1 kv head: kv replicated on every rank from TP=2 up; TP=8 divides
    _assert_ranks(llama_config(num_attention_heads=8, num_key_value_heads=1, head_dim=8), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_tied(tp: int) -> None:
    _assert_ranks(llama_config(tie_word_embeddings=True), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen2_biases(tp: int) -> None:
    _assert_ranks(qwen2_config(), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_moe_tensor_parallel(tp: int) -> None:
    _assert_ranks(qwen3_moe_config(), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_moe_expert_parallel(tp: int) -> None:
    _assert_ranks(qwen3_moe_config(), tp, ep=True)


@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_deepseek_mla(tp: int, ep: bool) -> None:
    _assert_ranks(deepseek_config(), tp, ep=ep)


def test_family_from_architectures_and_unknown_refused() -> None:
    assert family_of({"architectures": ["MistralForCausalLM"]}) == "mistral"
    assert family_of({"model_type": "qwen3"}) == "qwen3"
    with pytest.raises(PlanError, match="no built-in plan for model_type 'gpt2'"):
        family_of({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_heads_not_divisible_refused() -> None:
    cfg = llama_config()
    model = ServedModel.from_tensors(canonical(cfg))
    with pytest.raises(PlanError, match=r"q_proj: heads \(4\) does not divide by 8"):
        builtin_plan(cfg, model.specs, 8)


def test_experts_not_divisible_refused() -> None:
    cfg = qwen3_moe_config(num_experts=6)
    model = ServedModel.from_tensors(canonical(cfg))
    with pytest.raises(PlanError, match=r"experts over expert-parallel ranks \(6\) does not divide by 4"):
        builtin_plan(cfg, model.specs, 4, expert_parallel=True)


def test_intermediate_not_divisible_refused() -> None:
    cfg = llama_config(num_attention_heads=8, num_key_value_heads=8, head_dim=8, intermediate_size=100)
    model = ServedModel.from_tensors(canonical(cfg))
    with pytest.raises(PlanError, match=r"gate_proj: rows \(100\) does not divide by 8"):
        builtin_plan(cfg, model.specs, 8)


def test_unknown_tensor_refused() -> None:
    cfg = llama_config()
    t = canonical(cfg)
    t["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(
        PlanError, match=r"^layout plan: canonical tensor model.layers.0.self_attn.mystery.weight is mapped to no rank$"
    ):
        builtin_plan(cfg, ServedModel.from_tensors(t).specs, 2)


def test_dtype_mismatch_in_fused_parameter_refused() -> None:
    cfg = llama_config()
    t = canonical(cfg)
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"].to(torch.float16)
    with pytest.raises(
        PlanError, match=r"pieces of model.layers.1.self_attn.qkv_proj.weight on rank 0 have dtypes BF16 and F16"
    ):
        builtin_plan(cfg, ServedModel.from_tensors(t).specs, 2)


def test_shape_out_of_range_refused() -> None:
    cfg = llama_config()
    t = canonical(cfg)
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)  # gate has 128 rows
    with pytest.raises(PlanError, match=r"up_proj.weight -> .*gate_up_proj.weight: source region \[.*\] is outside"):
        builtin_plan(cfg, ServedModel.from_tensors(t).specs, 2)


def test_tied_checkpoint_keeping_lm_head_ignores_it() -> None:
    cfg = llama_config(tie_word_embeddings=True)
    t = canonical(cfg)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    plan = builtin_plan(cfg, ServedModel.from_tensors(t).specs, 2)
    assert "lm_head.weight" in plan.ignored
    assert all(s.name != "lm_head.weight" for s in plan.rank_specs(0))


def test_sglang_names_the_fused_mla_projection_its_way() -> None:
    cfg = deepseek_config()
    model = ServedModel.from_tensors(canonical(cfg))
    names = {s.name for s in builtin_plan(cfg, model.specs, 2, engine="sglang").rank_specs(1)}
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in names
    assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" not in names
    with pytest.raises(PlanError, match="engine 'trt' is not one of vllm, sglang"):
        builtin_plan(cfg, model.specs, 2, engine="trt")


def test_padded_vocabulary_not_divisible_refused() -> None:
    cfg = llama_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8, intermediate_size=96)
    model = ServedModel.from_tensors(canonical(cfg))
    with pytest.raises(
        PlanError, match=r"^layout plan: lm_head.weight: padded vocabulary \(512\) does not divide by 3$"
    ):
        builtin_plan(cfg, model.specs, 3)


def test_fewer_experts_than_the_config_says_refused() -> None:
    cfg = qwen3_moe_config()
    t = {n: x for n, x in canonical(cfg).items() if ".experts.7." not in n}
    with pytest.raises(
        PlanError, match=r"part of model.layers.0.mlp.experts.w13_weight on rank 0 is written by no piece"
    ):
        builtin_plan(cfg, ServedModel.from_tensors(t).specs, 2)


def test_absurd_config_sizes_refused() -> None:
    cfg = qwen3_moe_config(num_experts=1 << 40)
    with pytest.raises(PlanError, match=r"config.json num_experts is 1099511627776"):
        builtin_plan(cfg, ServedModel.from_tensors(canonical(qwen3_moe_config())).specs, 2)


def test_deepseek_mtp_layer_ignored() -> None:
    cfg = deepseek_config()
    t = canonical(cfg)
    extra = canonical({**cfg, "num_hidden_layers": 3}, seed=1)
    mtp = {n: x for n, x in extra.items() if n.startswith("model.layers.2.")}
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    mtp["model.layers.2.enorm.weight"] = torch.zeros(64, dtype=torch.bfloat16)
    plan = builtin_plan(cfg, ServedModel.from_tensors({**t, **mtp}).specs, 2)
    assert set(mtp) <= plan.ignored
    assert not any(s.name.startswith("model.layers.2.") for s in plan.rank_specs(0))

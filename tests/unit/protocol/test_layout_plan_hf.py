"""The built-in plans on checkpoints that Hugging Face transformers itself saves (tiny Llama and
Qwen3-MoE built from a config, no download): every tensor name it writes is mapped, and each rank's
bytes equal the engine's rules computed independently (tests/support/layout_models.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.served import ServedModel
from tests.support.layout_models import expected_rank

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 500,
}


def _saved(tmp_path: Path, model: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(tmp_path / "model.safetensors").items()}
    return config, tensors


def _check(config: dict[str, Any], tensors: dict[str, torch.Tensor], tp: int, ep: bool = False) -> None:
    model = ServedModel.from_tensors(tensors)
    plan = builtin_plan(config, model.specs, tp, expert_parallel=ep)
    for r in range(tp):
        got = rank_model(plan, model, r)
        want = expected_rank(config, tensors, tp, r, ep=ep)
        assert [s.name for s in got.specs] == sorted(want)
        for i, s in enumerate(got.specs):
            assert torch.equal(got.typed(i).view(torch.int16), want[s.name].view(torch.int16)), s.name


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama(tmp_path: Path, tied: bool) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)
    config, tensors = _saved(tmp_path, transformers.LlamaForCausalLM(cfg))
    assert ("lm_head.weight" in tensors) != tied
    for tp in (1, 2, 4):
        _check(config, tensors, tp)


def test_transformers_qwen3_moe(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    config, tensors = _saved(tmp_path, transformers.Qwen3MoeForCausalLM(cfg))
    for tp, ep in ((2, False), (4, False), (2, True), (4, True)):
        _check(config, tensors, tp, ep)

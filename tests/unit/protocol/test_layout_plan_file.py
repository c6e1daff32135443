"""Plan files: a file written for the tiny Llama / Qwen3-MoE gives the ranks the engine's rules give;
malformed or hostile files are refused with one PlanError line (hypothesis fuzz)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_file import MAX_FILE_BYTES, parse_plan_file
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.served import ServedModel
from tests.support.layout_models import canonical, expected_rank, llama_config, qwen3_moe_config

L = "model.layers.{L}."
QKV = [L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"]
GATE_UP = [L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"]


def _llama_rules(heads: int, kv_heads: int) -> list[dict[str, Any]]:
    return [
        {"match": "model.embed_tokens.weight", "rule": "vocab", "pad": 64},
        {"match": "lm_head.weight", "rule": "vocab"},
        *[
            {"match": m, "rule": "fuse", "into": L + "self_attn.qkv_proj.weight", "dim": 0, "order": QKV,
             "heads": [heads, kv_heads, kv_heads]}
            for m in QKV
        ],
        {"match": L + "self_attn.o_proj.weight", "rule": "split", "dim": 1},
        *[{"match": m, "rule": "fuse", "into": L + "mlp.gate_up_proj.weight", "dim": 0, "order": GATE_UP}
          for m in GATE_UP],
        {"match": L + "mlp.down_proj.weight", "rule": "split", "dim": 1},
        {"match": L + "mlp.gate.weight", "rule": "replicate"},
        *[
            {"match": L + f"mlp.experts.{{E}}.{proj}.weight", "rule": "experts",
             "into": L + f"mlp.experts.{into}", "expert": "E", "experts": 8, "dim": dim, "part": part, "parts": parts}
            for proj, into, dim, part, parts in [
                ("gate_proj", "w13_weight", 0, 0, 2),
                ("up_proj", "w13_weight", 0, 1, 2),
                ("down_proj", "w2_weight", 1, 0, 1),
            ]
        ],
        {"match": L + "self_attn.q_norm.weight", "rule": "replicate"},
        {"match": L + "self_attn.k_norm.weight", "rule": "replicate"},
        {"match": L + "input_layernorm.weight", "rule": "replicate"},
        {"match": L + "post_attention_layernorm.weight", "rule": "replicate"},
        {"match": "model.norm.weight", "rule": "replicate"},
        {"match": L + "self_attn.rotary_emb.inv_freq", "rule": "ignore"},
    ]  # fmt: skip


def _doc(rules: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    return {"format": "patchswarm-layout-plan", "version": 1, "rules": rules, **over}


@pytest.mark.parametrize(
    ("cfg", "tp", "ep"),
    [
        (llama_config(), 1, False),
        (llama_config(), 2, False),
        (llama_config(), 4, False),
        (qwen3_moe_config(), 2, False),
        (qwen3_moe_config(), 4, True),
    ],
)
def test_plan_file_gives_the_engine_layout(cfg: dict[str, Any], tp: int, ep: bool) -> None:
    t = canonical(cfg)
    model = ServedModel.from_tensors(t)
    data = json.dumps(_doc(_llama_rules(cfg["num_attention_heads"], cfg["num_key_value_heads"])))
    plan = parse_plan_file(data.encode()).expand(model.specs, tp, expert_parallel=ep)
    for r in range(tp):
        got = rank_model(plan, model, r)
        want = expected_rank(cfg, t, tp, r, ep=ep)
        assert [s.name for s in got.specs] == sorted(want)
        for i, s in enumerate(got.specs):
            assert torch.equal(got.typed(i).view(torch.int16), want[s.name].view(torch.int16)), f"rank {r} {s.name}"


def test_per_tensor_scales_fuse_into_a_vector() -> None:
    t = {
        "a.weight_scale": torch.tensor(2.0),
        "b.weight_scale": torch.tensor(3.0),
    }
    order = ["a.weight_scale", "b.weight_scale"]
    rules = [{"match": m, "rule": "fuse", "into": "ab.weight_scale", "dim": 0, "order": order} for m in order]
    model = ServedModel.from_tensors(t)
    plan = parse_plan_file(json.dumps(_doc(rules))).expand(model.specs, 2)
    for r in range(2):
        assert rank_model(plan, model, r).typed(0).tolist() == [2.0, 3.0]


def test_unmatched_tensor_refused_at_expand() -> None:
    model = ServedModel.from_tensors({"a": torch.zeros(4), "b": torch.zeros(4)})
    pf = parse_plan_file(json.dumps(_doc([{"match": "a", "rule": "split", "dim": 0}])))
    with pytest.raises(PlanError, match=r"^layout plan: canonical tensor b is mapped to no rank$"):
        pf.expand(model.specs, 2)
    with pytest.raises(PlanError, match=r"^layout plan: a dim 0 \(4\) does not divide by 3$"):
        pf.expand(model.specs[:1], 3)


@pytest.mark.parametrize(
    ("doc", "line"),
    [
        (b"\xff\xfe", r"^plan file: not JSON"),
        (b"[]", "must be a JSON object"),
        (_doc([], format="x"), "format must be"),
        (_doc([{"match": "a", "rule": "split", "dim": 0}], version=2), r"version 2 \(this build reads 1\)"),
        (_doc([]), "rules must be a non-empty list"),
        (_doc([{"match": "a", "rule": "teleport"}]), r"rules\[0\].rule must be one of"),
        (_doc([{"match": "a", "rule": "split"}]), r"rules\[0\].dim must be an integer 0..7"),
        (_doc([{"match": "a", "rule": "split", "dim": 0, "order": []}]), "does not belong to a split rule"),
        (_doc([{"match": "a/../b", "rule": "ignore"}]), r"rules\[0\].match must be a tensor name"),
        (_doc([{"match": "a.{L}.{L}", "rule": "ignore"}]), "placeholder twice"),
        (_doc([{"match": "a", "rule": "replicate", "as": "b.{L}"}]), r"uses \{L\}, which match does not capture"),
        (_doc([{"match": "a.{l}", "rule": "ignore"}]), "placeholders are"),
        (_doc([{"match": "a", "rule": "ignore"}] * 513), "more than 512 rules"),
        (_doc([{"match": "x.{E}", "rule": "experts", "into": "w.{E}", "expert": "E", "experts": 2, "dim": 0}]),
         "must not use the expert placeholder"),
        (_doc([{"match": "a", "rule": "fuse", "into": "f", "dim": 0, "order": ["a"], "heads": [1, 2]}]),
         "one head count per source"),
        (b"[" * 100000 + b"]" * 100000, r"^plan file: nested deeper than 64 levels$"),
        (b" " * (MAX_FILE_BYTES + 1), "larger than"),
    ],
)  # fmt: skip
def test_bad_files_refused_with_one_line(doc: Any, line: str) -> None:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(PlanError, match=line) as e:
        parse_plan_file(data)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


_GOOD = _doc(_llama_rules(4, 2))
_SMALL = ServedModel.from_tensors(canonical(llama_config(num_hidden_layers=1, vocab_size=64)))
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


@given(data=st.binary(max_size=400))
def test_fuzz_bytes(data: bytes) -> None:
    try:
        parse_plan_file(data)
    except PlanError as e:
        assert "\n" not in str(e)


@given(
    rule=st.integers(0, len(_GOOD["rules"]) - 1),
    key=st.sampled_from(
        ["match", "rule", "dim", "into", "order", "heads", "expert", "experts", "part", "parts", "as", "pad", "split"]
    ),
    value=_json,
)  # fmt: skip
def test_fuzz_fields(rule: int, key: str, value: Any) -> None:
    doc = copy.deepcopy(_GOOD)
    doc["rules"][rule][key] = value
    try:
        pf = parse_plan_file(json.dumps(doc))
        pf.expand(_SMALL.specs, 2)
    except PlanError as e:
        assert "\n" not in str(e)


def test_the_documented_example_parses_and_applies() -> None:
    page = (Path(__file__).resolve().parents[3] / "docs" / "models.md").read_text()
    block = page.split("## Layout plans", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    cfg = qwen3_moe_config(num_attention_heads=32, num_key_value_heads=4, head_dim=2, num_experts=128)
    cfg.update(hidden_size=64, moe_intermediate_size=4, num_hidden_layers=1, vocab_size=100)
    t = canonical(cfg)
    model = ServedModel.from_tensors(t)
    pf = parse_plan_file(block.encode())
    for ep in (False, True):
        plan = pf.expand(model.specs, 4, expert_parallel=ep)
        got = rank_model(plan, model, 3)
        want = expected_rank(cfg, t, 4, 3, ep=ep)
        assert [s.name for s in got.specs] == sorted(want)
        for i, s in enumerate(got.specs):
            assert torch.equal(got.typed(i).view(torch.int16), want[s.name].view(torch.int16)), s.name

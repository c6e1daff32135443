"""protocol/layout_inverse.py: a rank's canonical tensors rebuilt from its runtime entries (vLLM's TP plan
of a tiny Llama).  Expected values come from tests/support/rank_plans.py ``llama_rank`` (torch.chunk /
cat by vLLM's rules), independent of the plan: the rebuilt tensors, sharded again, give the rank's own
entries, and they hold nothing but the rank's slice."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_inverse import rebuild, routing_for, routing_from_json, routing_to_json
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.served import ServedModel, raw_bytes
from tests.support.rank_plans import LLAMA, llama_rank, llama_state

pytest.importorskip("transformers")


def versions() -> tuple[dict[str, torch.Tensor], str]:
    state, cfg = llama_state(5)
    return {k: v.to(torch.bfloat16) for k, v in sorted(state.items())}, cfg


@pytest.mark.parametrize("tp", [2, 4])  # (4: fewer kv heads than ranks, each replicated on two)
def test_each_ranks_rebuilt_tensors_shard_back_to_its_entries_and_hold_only_its_slice(tp: int) -> None:
    typed, cfg = versions()
    model = ServedModel.from_tensors(typed)
    plan = builtin_plan(json.loads(cfg), model.specs, tp)
    for rank in range(tp):
        entries = rank_model(plan, model, rank)
        index = {s.name: i for i, s in enumerate(entries.specs)}
        routing = routing_for(plan, model.specs, rank, [s.name for s in entries.specs])
        wire = routing_from_json(json.loads(json.dumps(routing_to_json(routing))))
        assert wire == routing
        got = dict(rebuild(wire, lambda n, e=entries, i=index: raw_bytes(e.data[i[n]])))
        assert sorted(got) == sorted(typed)  # every tensor this engine loads has a piece on every rank
        assert all(got[n].shape == t.shape and got[n].dtype == t.dtype for n, t in typed.items())
        want = llama_rank(typed, tp, rank)
        again = llama_rank(got, tp, rank)
        assert all(torch.equal(again[n], want[n]) for n in want), rank
        # nothing outside the rank's slice (the loader reads only its slice: the rest is zero)
        heads_share = {"q_proj": tp, "k_proj": min(tp, LLAMA["num_key_value_heads"])}
        heads_share["v_proj"] = heads_share["k_proj"]
        for n, t in typed.items():
            part = n.split(".")[-2]
            share = heads_share.get(part, tp if part in ("o_proj", "gate_proj", "up_proj", "down_proj") else 1)
            if "embed_tokens" in n or "lm_head" in n:
                continue  # (vocabulary rows: checked through llama_rank above)
            assert int((got[n] != 0).sum()) == t.numel() // share, (rank, n)


def test_rebuild_takes_only_the_sources_of_the_entries_asked() -> None:
    typed, cfg = versions()
    model = ServedModel.from_tensors(typed)
    plan = builtin_plan(json.loads(cfg), model.specs, 2)
    entries = rank_model(plan, model, 1)
    index = {s.name: i for i, s in enumerate(entries.specs)}
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    routing = routing_for(plan, model.specs, 1, [qkv])
    got = rebuild(routing, lambda n: raw_bytes(entries.data[index[n]]), [qkv])
    assert [n for n, _ in got] == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
    with pytest.raises(PlanError, match="no runtime parameter"):
        routing_for(plan, model.specs, 1, ["model.layers.1.self_attn.q_proj.weight"])


def test_malformed_routings_give_one_line() -> None:
    typed, cfg = versions()
    model = ServedModel.from_tensors(typed)
    plan = builtin_plan(json.loads(cfg), model.specs, 2)
    good = routing_to_json(routing_for(plan, model.specs, 0, ["model.layers.0.mlp.gate_up_proj.weight"]))
    src, par = good["sources"][0], good["params"][0]
    piece = good["pieces"][0]
    for bad in (
        None,
        {**good, "extra": 1},
        {**good, "rank": -1},
        {**good, "rank": True},
        {**good, "sources": [[src[0], "NOPE", src[2]]]},
        {**good, "sources": [[src[0], src[1], [-1]]]},
        {**good, "params": [[par[0], par[1], [1] * 9]]},
        {**good, "pieces": [[piece[0], "other", piece[2], piece[3]]]},
        {**good, "pieces": [[piece[0], piece[1], [[0, 10**9], [0, 1]], piece[3]]]},
        {**good, "pieces": [[piece[0], piece[1], piece[2], [[0, 1], [0, 1]]]]},
        {**good, "pieces": [[piece[0], piece[1], [[0, "1"]], piece[3]]]},
        {**good, "pieces": [[] for _ in range(3)]},
    ):
        with pytest.raises(PlanError, match=r"^routing: "):
            routing_from_json(json.loads(json.dumps(bad)))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {"rank": _json, "sources": _json, "params": _json, "pieces": _json},
    )
    | _json
)
def test_any_json_is_a_routing_or_one_plan_error(obj: object) -> None:
    try:
        routing_from_json(obj)
    except PlanError:
        pass

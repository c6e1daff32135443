"""Routing in one pass (protocol/layout_flat.py): each rank's run over its store's words, cut back into
one change per parameter, equals ``Router.route``'s changes exactly (which tests/unit/protocol/
test_layout_plan.py checks against ``rank_model``); the plans and changes it cannot route are handed
back (None), and bad changes are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_flat import FlatRouter
from patchswarm.protocol.layout_plan import LayoutPlan, PlanBuilder, full_box
from patchswarm.protocol.layout_route import Router, SlotChange
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view
from tests.support.layout_models import canonical, llama_config, qwen2_config, qwen3_moe_config

BF = "BF16"


def _bases(plan: LayoutPlan, gap: int = 3) -> list[list[int]]:
    """Each slot's first word, slots one after another with ``gap`` words between (as a store's
    alignment leaves), computed here from the rank specs."""
    out = []
    for r in range(plan.world):
        at, row = 0, []
        for s in plan.rank_specs(r):
            row.append(at)
            at += s.numel + gap
        out.append(row)
    return out


def _changes(model: ServedModel, gen: torch.Generator, density: float) -> list[SlotChange]:
    out = []
    for i, spec in enumerate(model.specs):
        words = word_view(model.data[i], spec)
        pos = (torch.rand(spec.numel, generator=gen) < density).nonzero().squeeze(1)
        if pos.numel():
            out.append(SlotChange(i, pos, words[pos] + 1, words[pos]))
    return out


def _same(plan: LayoutPlan, model: ServedModel, changes: list[SlotChange]) -> None:
    router = Router(plan, model.specs)
    bases = _bases(plan)
    flat = FlatRouter.compile(router, bases)
    assert flat is not None
    runs = flat.route(list(reversed(changes)))  # (any order of the canonical changes)
    assert runs is not None
    want = router.route(changes)
    for r in range(plan.world):
        run = runs[r]
        assert run.positions.numel() == sum(run.counts) == run.new.numel() == run.old.numel()
        assert bool((run.positions[1:] > run.positions[:-1]).all()), f"rank {r}: not ascending"
        got = run.per_slot(bases[r])
        assert [c.slot for c in got] == [c.slot for c in want[r]], f"rank {r}"
        for g, w in zip(got, want[r], strict=True):
            assert w.positions is not None
            assert torch.equal(g.positions, w.positions), f"rank {r} slot {g.slot}"
            assert torch.equal(g.new, w.new) and torch.equal(g.old, w.old), f"rank {r} slot {g.slot}"


CASES = [
    (llama_config(), 1),
    (llama_config(), 4),
    (llama_config(tie_word_embeddings=True), 2),
    (qwen2_config(), 4),
    (qwen3_moe_config(), 2),
]


@pytest.mark.parametrize(("cfg", "tp"), CASES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), density=st.sampled_from([0.0005, 0.01, 0.3, 1.0]))
def test_one_pass_routing_equals_routing_per_parameter(cfg: dict[str, Any], tp: int, seed: int, density: float) -> None:
    model = ServedModel.from_tensors(canonical(cfg, seed=1))
    plan = builtin_plan(cfg, model.specs, tp)
    _same(plan, model, _changes(model, torch.Generator().manual_seed(seed), density))


def test_no_changes_give_every_rank_an_empty_run() -> None:
    cfg = llama_config()
    model = ServedModel.from_tensors(canonical(cfg))
    plan = builtin_plan(cfg, model.specs, 2)
    flat = FlatRouter.compile(Router(plan, model.specs), _bases(plan))
    assert flat is not None
    runs = flat.route([])
    assert runs is not None and [(r.slots, r.positions.numel()) for r in runs] == [([], 0), ([], 0)]


def _two_ranks() -> tuple[LayoutPlan, list[TensorSpec]]:
    b = PlanBuilder(2)
    for r in range(2):
        b.param(r, "a", (2, 3), BF)
        b.place("a", r, "a", ((2 * r, 2 * r + 2), (0, 3)), ((0, 2), (0, 3)))
    return b.build(), [TensorSpec("a", BF, (4, 3))]


def test_dense_changes_and_mixed_word_widths_are_handed_back() -> None:
    plan, specs = _two_ranks()
    flat = FlatRouter.compile(Router(plan, specs), _bases(plan))
    assert flat is not None
    w = torch.arange(12, dtype=torch.int16)
    assert flat.route([SlotChange(0, None, w, w)]) is None
    b = PlanBuilder(1)
    b.param(0, "a", (2,), BF)
    b.place("a", 0, "a", full_box((2,)), full_box((2,)))
    b.param(0, "s", (1,), "F32")
    b.place("s", 0, "s", full_box((1,)), full_box((1,)))
    specs2 = [TensorSpec("a", BF, (2,)), TensorSpec("s", "F32", (1,))]
    flat2 = FlatRouter.compile(Router(b.build(), specs2), [[0, 2]])
    assert flat2 is not None
    one = torch.zeros(1, dtype=torch.int64)
    changes = [
        SlotChange(0, one, torch.ones(1, dtype=torch.int16), torch.zeros(1, dtype=torch.int16)),
        SlotChange(1, one, torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
    ]
    assert flat2.route(changes) is None


def test_a_piece_not_one_run_of_its_parameter_is_handed_back() -> None:
    # two tensors fused side by side (along the inner dim): each is one run of itself, not of the parameter
    b = PlanBuilder(1)
    b.param(0, "p", (2, 5), BF)
    b.place("a", 0, "p", full_box((2, 2)), ((0, 2), (0, 2)))
    b.place("b", 0, "p", full_box((2, 3)), ((0, 2), (2, 5)))
    specs = [TensorSpec("a", BF, (2, 2)), TensorSpec("b", BF, (2, 3))]
    plan = b.build()
    plan.check(specs)
    assert FlatRouter.compile(Router(plan, specs), [[0]]) is None


def test_bad_changes_are_refused() -> None:
    plan, specs = _two_ranks()
    flat = FlatRouter.compile(Router(plan, specs), _bases(plan))
    assert flat is not None
    two = torch.zeros(2, dtype=torch.int16)

    def ch(slot: int, pos: list[int]) -> SlotChange:
        return SlotChange(slot, torch.tensor(pos, dtype=torch.int64), two[: len(pos)], two[: len(pos)])

    with pytest.raises(PlanError, match="canonical slot 1 outside 1 tensors"):
        flat.route([ch(1, [0])])
    with pytest.raises(PlanError, match="two changes for a"):
        flat.route([ch(0, [0]), ch(0, [1])])
    for bad in ([12], [-1], [5, 5], [6, 2]):
        with pytest.raises(PlanError, match="out of range or not strictly ascending"):
            flat.route([ch(0, bad)])

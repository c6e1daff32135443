"""Layout plans: the checks refuse bad plans with one line; routed changes scattered into the ranks'
tensors equal the ranks built from the changed model (built-in plans and random n-d plans)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_plan import LayoutPlan, PlanBuilder, full_box, rank_model
from patchswarm.protocol.layout_route import Router, SlotChange
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view
from tests.support.layout_models import canonical, deepseek_config, llama_config, qwen2_config, qwen3_moe_config

BF = "BF16"


def _specs(**shapes: tuple[int, ...]) -> list[TensorSpec]:
    return [TensorSpec(n, BF, s) for n, s in sorted(shapes.items())]


def _split_rows(b: PlanBuilder, name: str, rows: int, cols: int, tp: int) -> None:
    n = rows // tp
    for r in range(tp):
        b.param(r, name, (n, cols), BF)
        b.place(name, r, name, ((r * n, (r + 1) * n), (0, cols)), ((0, n), (0, cols)))


# ---------------------------------------------------------------- refusals


def test_good_plan_passes() -> None:
    b = PlanBuilder(2)
    _split_rows(b, "a", 4, 3, 2)
    b.build().check(_specs(a=(4, 3)))


def test_unmapped_tensor_refused() -> None:
    b = PlanBuilder(2)
    _split_rows(b, "a", 4, 3, 2)
    with pytest.raises(PlanError, match=r"^layout plan: canonical tensor b is mapped to no rank$"):
        b.build().check(_specs(a=(4, 3), b=(2,)))


def test_part_unmapped_refused() -> None:
    b = PlanBuilder(2)
    b.param(0, "a", (2, 3), BF)
    b.place("a", 0, "a", ((0, 2), (0, 3)), ((0, 2), (0, 3)))
    b.param(1, "a", (2, 3), BF)
    b.place("a", 1, "a", ((0, 2), (0, 3)), ((0, 2), (0, 3)))  # rows 2..4 nowhere
    with pytest.raises(PlanError, match=r"^layout plan: part of a is mapped to no rank$"):
        b.build().check(_specs(a=(4, 3)))


def test_runtime_overlap_refused() -> None:
    b = PlanBuilder(1)
    b.param(0, "fused", (5, 3), BF)
    b.place("a", 0, "fused", full_box((3, 3)), ((0, 3), (0, 3)))
    b.place("b", 0, "fused", full_box((3, 3)), ((2, 5), (0, 3)))
    with pytest.raises(PlanError, match=r"^layout plan: a region of fused on rank 0 is written by two pieces$"):
        b.build().check(_specs(a=(3, 3), b=(3, 3)))


def test_mapped_twice_to_one_rank_refused() -> None:
    b = PlanBuilder(1)
    b.param(0, "x", (2, 3), BF)
    b.param(0, "y", (3, 3), BF)
    b.place("a", 0, "x", ((0, 2), (0, 3)), ((0, 2), (0, 3)))
    b.place("a", 0, "y", ((1, 4), (0, 3)), ((0, 3), (0, 3)))
    with pytest.raises(PlanError, match=r"^layout plan: a region of a is mapped twice to rank 0$"):
        b.build().check(_specs(a=(4, 3)))


def test_dtype_mismatch_refused() -> None:
    b = PlanBuilder(1)
    b.param(0, "x", (4, 3), "F16")
    b.place("a", 0, "x", full_box((4, 3)), full_box((4, 3)))
    with pytest.raises(PlanError, match=r"^layout plan: a -> x on rank 0: dtype BF16 into a F16 parameter$"):
        b.build().check(_specs(a=(4, 3)))


@pytest.mark.parametrize(
    ("src", "dst", "line"),
    [
        (((0, 5), (0, 3)), ((0, 4), (0, 3)), r"source region \[0:5, 0:3\] is outside a's shape \[4, 3\]"),
        (((0, 4), (0, 3)), ((1, 5), (0, 3)), r"region \[1:5, 0:3\] is outside the parameter's shape \[4, 3\]"),
        (((0, 4), (0, 3)), ((0, 4), (0, 3), (0, 1)), r"outside the parameter's shape"),
        (((0, 4), (0, 3)), ((0, 3), (0, 4)), r"region \[0:3, 0:4\] is outside"),
        (((0, 2), (0, 3)), ((0, 3), (0, 2)), r"source region \[0:2, 0:3\] and runtime region \[0:3, 0:2\] differ"),
    ],
)
def test_boxes_out_of_range_refused(src: Any, dst: Any, line: str) -> None:
    b = PlanBuilder(1)
    b.param(0, "x", (4, 3), BF)
    b.place("a", 0, "x", src, dst)
    with pytest.raises(PlanError, match=line) as e:
        b.build().check(_specs(a=(4, 3)))
    assert "\n" not in str(e.value)


def test_unknown_rank_and_parameter_refused() -> None:
    b = PlanBuilder(2)
    b.param(0, "x", (4,), BF)
    b.place("a", 1, "x", full_box((4,)), full_box((4,)))
    with pytest.raises(PlanError, match=r"^layout plan: a -> x: rank 1 has no parameter x$"):
        b.build().check(_specs(a=(4,)))
    with pytest.raises(PlanError, match="outside a world of 2"):
        b.param(2, "x", (4,), BF)
    with pytest.raises(PlanError, match="a world of 0 ranks"):
        PlanBuilder(0)


def test_maps_a_tensor_the_checkpoint_lacks_refused() -> None:
    b = PlanBuilder(1)
    b.param(0, "x", (4,), BF)
    b.place("a", 0, "x", full_box((4,)), full_box((4,)))
    b.place("zzz", 0, "x", full_box((4,)), full_box((4,)))
    with pytest.raises(PlanError, match=r"^layout plan: maps zzz, which the checkpoint does not have$"):
        b.build().check(_specs(a=(4,)))


def test_rank_specs_sorted_and_padding_zero() -> None:
    b = PlanBuilder(1)
    b.param(0, "z", (6,), BF, padded=True)
    b.param(0, "m", (1,), BF)
    b.place("a", 0, "z", ((0, 4),), ((1, 5),))
    b.place("s", 0, "m", (), ((0, 1),))
    plan = b.build()
    model = ServedModel.from_tensors({"a": torch.arange(1, 5).to(torch.bfloat16), "s": torch.tensor(7.0).bfloat16()})
    plan.check(model.specs)
    assert [s.name for s in plan.rank_specs(0)] == ["m", "z"]
    got = rank_model(plan, model, 0)
    assert got.typed(1).tolist() == [0, 1, 2, 3, 4, 0]
    assert got.typed(0).tolist() == [7]


# ---------------------------------------------------------------- routing


def _apply(rank: ServedModel, changes: list[SlotChange]) -> None:
    for ch in changes:
        words = word_view(rank.data[ch.slot], rank.specs[ch.slot])
        if ch.positions is None:
            assert ch.new.numel() == words.numel()
            words.copy_(ch.new)
        else:
            p = ch.positions
            assert p.dtype == torch.int64
            assert bool((p[1:] > p[:-1]).all()), "positions ascending, each once"
            assert torch.equal(words[p], ch.old), "old words are the rank's current words"
            words[p] = ch.new


def _random_changes(
    model: ServedModel, gen: torch.Generator, density: float, dense_every: int
) -> tuple[ServedModel, list[SlotChange]]:
    changed = model.clone()
    changes = []
    for i, spec in enumerate(model.specs):
        words = word_view(changed.data[i], spec)
        old_all = words.clone()
        if dense_every and i % dense_every == 0:
            new = torch.randint(-(1 << 15), 1 << 15, (spec.numel,), generator=gen).to(words.dtype)
            words.copy_(new)
            changes.append(SlotChange(i, None, new, old_all))
            continue
        mask = torch.rand(spec.numel, generator=gen) < density
        pos = mask.nonzero().squeeze(1)
        if pos.numel() == 0:
            continue
        new = torch.randint(-(1 << 15), 1 << 15, (pos.numel(),), generator=gen).to(words.dtype)
        words[pos] = new
        changes.append(SlotChange(i, pos, new, old_all[pos]))
    return changed, changes


def _check_routing(plan: LayoutPlan, model: ServedModel, seed: int, density: float, dense_every: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    changed, changes = _random_changes(model, gen, density, dense_every)
    routed = Router(plan, model.specs).route(changes)
    assert len(routed) == plan.world
    for r in range(plan.world):
        rank = rank_model(plan, model, r)
        slots = [c.slot for c in routed[r]]
        assert slots == sorted(set(slots))
        _apply(rank, routed[r])
        assert rank.bitwise_equal(rank_model(plan, changed, r)), f"rank {r}"


CASES = [
    (llama_config(), 4, False),
    (llama_config(tie_word_embeddings=True), 2, False),
    (qwen2_config(), 4, False),
    (qwen3_moe_config(), 2, False),
    (qwen3_moe_config(), 4, True),
    (deepseek_config(), 2, True),
]


@pytest.mark.parametrize(("cfg", "tp", "ep"), CASES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), density=st.sampled_from([0.0005, 0.01, 0.3]), dense_every=st.sampled_from([0, 1, 7]))
def test_routing_builtin(cfg: dict[str, Any], tp: int, ep: bool, seed: int, density: float, dense_every: int) -> None:
    model = ServedModel.from_tensors(canonical(cfg, seed=1))
    plan = builtin_plan(cfg, model.specs, tp, expert_parallel=ep)
    _check_routing(plan, model, seed, density, dense_every)


@st.composite
def nd_plans(draw: st.DrawFn) -> tuple[LayoutPlan, ServedModel]:
    """A random n-d tensor split along a random dim over tp ranks, fused after a partner tensor in a
    runtime parameter with an extra dim of extent 1 (so neither box is one flat run), plus a 0-d tensor
    replicated into a slot of a vector on every rank."""
    ndim = draw(st.integers(1, 4))
    tp = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[d] *= tp
    n = shape[d] // tp
    partner = draw(st.integers(1, 3))
    b = PlanBuilder(tp)
    local = list(shape)
    local[d] = n + partner
    for r in range(tp):
        b.param(r, "p", (*local[:d], 1, *local[d:]), BF)
        pshape = [*shape]
        pshape[d] = partner
        # partner first (rows [0, partner) along d), the split tensor after it
        b.place("b", r, "p", full_box(pshape), (*full_box(local[:d]), (0, 1), (0, partner), *full_box(local[d + 1 :])))
        src = (*full_box(shape[:d]), (r * n, (r + 1) * n), *full_box(shape[d + 1 :]))
        dst = (*full_box(local[:d]), (0, 1), (partner, partner + n), *full_box(local[d + 1 :]))
        b.place("a", r, "p", src, dst)
        b.param(r, "s", (3,), BF, padded=True)
        b.place("c", r, "s", (), ((r % 3, r % 3 + 1),))
    pshape = list(shape)
    pshape[d] = partner
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    model = ServedModel.from_tensors(
        {
            "a": torch.randn(*shape, generator=gen).bfloat16(),
            "b": torch.randn(*pshape, generator=gen).bfloat16(),
            "c": torch.randn((), generator=gen).bfloat16(),
        }
    )
    # b is held whole by every rank: replicated
    return b.build(), model


@settings(max_examples=60, deadline=None)
@given(case=nd_plans(), seed=st.integers(0, 2**31), density=st.sampled_from([0.05, 0.5, 1.0]), dense=st.booleans())
def test_routing_nd(case: tuple[LayoutPlan, ServedModel], seed: int, density: float, dense: bool) -> None:
    plan, model = case
    plan.check(model.specs)
    _check_routing(plan, model, seed, density, 2 if dense else 0)


def test_replicated_change_reaches_every_rank() -> None:
    cfg = llama_config()
    model = ServedModel.from_tensors(canonical(cfg))
    plan = builtin_plan(cfg, model.specs, 4)
    i = [s.name for s in model.specs].index("model.layers.0.self_attn.k_proj.weight")
    words = word_view(model.data[i], model.specs[i])
    pos = torch.tensor([0, 16 * 64 + 5])  # kv head 0 and kv head 1
    routed = Router(plan, model.specs).route([SlotChange(i, pos, words[pos] + 1, words[pos])])
    # 2 kv heads on 4 ranks: head 0 on ranks 0, 1; head 1 on ranks 2, 3; k rows follow 16 q rows per rank
    for r in range(4):
        (ch,) = routed[r]
        assert ch.positions is not None
        assert ch.positions.tolist() == [16 * 64 + (5 if r >= 2 else 0)]


def test_route_refuses_bad_slots() -> None:
    b = PlanBuilder(1)
    _split_rows(b, "a", 4, 3, 1)
    plan = b.build()
    router = Router(plan, _specs(a=(4, 3)))
    one = torch.zeros(1, dtype=torch.int16)
    with pytest.raises(PlanError, match="canonical slot 3 outside 1 tensors"):
        router.route([SlotChange(3, torch.zeros(1, dtype=torch.int64), one, one)])
    with pytest.raises(PlanError, match="two changes for a"):
        ch = SlotChange(0, torch.zeros(1, dtype=torch.int64), one, one)
        router.route([ch, ch])


def test_crowded_boxes_checked_on_the_grid() -> None:
    # 80 column strips of one row range: more open boxes than the sweep keeps, the grid decides
    b = PlanBuilder(1)
    b.param(0, "x", (2, 80), BF)
    for k in range(80):
        b.place(f"c{k:02d}", 0, "x", full_box((2, 1)), ((0, 2), (k, k + 1)))
    specs = [TensorSpec(f"c{k:02d}", BF, (2, 1)) for k in range(80)]
    b.build().check(specs)
    b2 = PlanBuilder(1)
    b2.param(0, "x", (2, 80), BF)
    for k in range(80):
        b2.place(f"c{k:02d}", 0, "x", full_box((2, 1)), ((0, 2), (min(k, 78), min(k, 78) + 1)))
    with pytest.raises(PlanError, match="a region of x on rank 0 is written by two pieces"):
        b2.build().check(specs)


def test_overlapping_pieces_across_ranks_cover() -> None:
    b = PlanBuilder(2)
    b.param(0, "x", (3, 2), BF)
    b.param(1, "x", (3, 2), BF)
    b.place("a", 0, "x", ((0, 3), (0, 2)), full_box((3, 2)))
    b.place("a", 1, "x", ((1, 4), (0, 2)), full_box((3, 2)))
    b.build().check(_specs(a=(4, 2)))
    b.pieces.pop()
    b.place("a", 1, "x", ((0, 3), (0, 2)), full_box((3, 2)))
    with pytest.raises(PlanError, match="part of a is mapped to no rank"):
        b.build().check(_specs(a=(4, 2)))


def test_dense_changes_covering_a_parameter_go_whole() -> None:
    cfg = llama_config()
    model = ServedModel.from_tensors(canonical(cfg))
    plan = builtin_plan(cfg, model.specs, 2)
    names = [s.name for s in model.specs]
    router = Router(plan, model.specs)

    def dense(name: str) -> SlotChange:
        i = names.index(name)
        w = word_view(model.data[i], model.specs[i])
        return SlotChange(i, None, w + 1, w)

    a = "model.layers.0.self_attn."
    routed = router.route([dense(a + "q_proj.weight"), dense(a + "k_proj.weight"), dense(a + "v_proj.weight")])
    assert [c.positions for c in routed[1]] == [None]  # qkv_proj whole
    routed = router.route([dense(a + "q_proj.weight"), dense(a + "k_proj.weight")])
    (qkv,) = routed[0]
    assert qkv.positions is not None and qkv.positions.numel() == (32 + 16) * 64  # v untouched
    # the embedding's padded rows are sent as zeros in a whole update
    (emb,) = router.route([dense("model.embed_tokens.weight")])[1]
    assert emb.positions is None and emb.new.numel() == 256 * 64
    assert not bool(emb.new.reshape(256, 64)[500 - 256 :].any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routing_on_cuda_matches_host() -> None:
    cfg = qwen3_moe_config()
    model = ServedModel.from_tensors(canonical(cfg))
    plan = builtin_plan(cfg, model.specs, 4)
    gen = torch.Generator().manual_seed(5)
    _, changes = _random_changes(model, gen, 0.05, 5)
    host = Router(plan, model.specs).route(changes)
    cuda = [
        SlotChange(c.slot, None if c.positions is None else c.positions.cuda(), c.new.cuda(), c.old.cuda())
        for c in changes
    ]
    dev = Router(plan, model.specs).route(cuda)
    for h, d in zip(host, dev, strict=True):
        assert [c.slot for c in h] == [c.slot for c in d]
        for a, b in zip(h, d, strict=True):
            assert b.new.device.type == "cuda"
            assert (a.positions is None) == (b.positions is None)
            if a.positions is not None and b.positions is not None:
                assert torch.equal(a.positions, b.positions.cpu())
            assert torch.equal(a.new, b.new.cpu()) and torch.equal(a.old, b.old.cpu())
    gpu_model = ServedModel(list(model.specs), [d.cuda() for d in model.data])
    assert rank_model(plan, gpu_model, 2).data[0].device.type == "cuda"


def test_hole_outside_padding_refused() -> None:
    b = PlanBuilder(1)
    b.param(0, "z", (6,), BF)
    b.place("a", 0, "z", ((0, 4),), ((1, 5),))
    with pytest.raises(PlanError, match=r"^layout plan: part of z on rank 0 is written by no piece \(not padding\)$"):
        b.build().check(_specs(a=(4,)))

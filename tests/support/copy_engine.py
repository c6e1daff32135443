"""Rank stores and model versions for the copy-engine tests (daemon/param_sync.py): a tiny Llama in two
versions, an identity plan (runtime names = checkpoint names) and the regions a version changed."""

from __future__ import annotations

from pathlib import Path

import torch

from patchswarm.daemon.engine import EngineView
from patchswarm.daemon.engine_driver import Region
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.protocol.layout_plan import LayoutPlan, PlanBuilder, full_box
from patchswarm.protocol.served import ServedModel, TensorSpec
from tests.support.rank_plans import llama_state


def identity_plan(specs: list[TensorSpec]) -> LayoutPlan:
    """One rank whose runtime parameters are the checkpoint's tensors (a transformers model's names)."""
    b = PlanBuilder(1, "identity")
    for s in specs:
        b.param(0, s.name, s.shape, s.dtype)
        b.place(s.name, 0, s.name, full_box(s.shape), full_box(s.shape))
    return b.build()


def llama_versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions of the tiny Llama in bf16: v2 changes a few rows of some tensors (lm_head among them)."""
    state, _ = llama_state(3)
    v1 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    v2 = {k: v.clone() for k, v in v1.items()}
    g = torch.Generator().manual_seed(7)
    for k in ("lm_head.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        v2[k][3:5] += torch.randn(v2[k][3:5].shape, generator=g).to(torch.bfloat16)
    v2["model.norm.weight"][7] = 2.5
    return v1, v2


def served(typed: dict[str, torch.Tensor]) -> ServedModel:
    return ServedModel.from_tensors(dict(sorted(typed.items())))


def stores(name: str, tmp: Path, plan: LayoutPlan, model: ServedModel) -> RankStores:
    jd = tmp / "journal"
    jd.mkdir(exist_ok=True)
    rs = RankStores(name, plan.world, jd, engine_kind=False)
    rs.prepare(plan, model.specs)
    rs.apply(1, model, None)
    return rs


def changed_regions(view: EngineView, before: torch.Tensor) -> list[Region]:
    """Each entry's first..last changed byte (what the daemon would name, coarser than needed)."""
    out = []
    for s in view.layout.slots:
        diff = (view.data[s.offset : s.offset + s.nbytes] != before[s.offset : s.offset + s.nbytes]).nonzero()
        if len(diff):
            out.append(Region(s.name, int(diff[0]), int(diff[-1]) + 1))
    return out

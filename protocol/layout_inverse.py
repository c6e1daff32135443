"""Canonical tensors rebuilt from one rank's runtime entries: what an engine's checkpoint loader takes.

A copy engine's ``load_weights`` (vLLM, SGLang) takes checkpoint tensors under their checkpoint names,
at full size, and cuts its own rank's slice itself: vLLM's ``QKVParallelLinear.weight_loader`` narrows
a ``q_proj``/``k_proj``/``v_proj`` tensor (shard id "q", "k", "v") to this rank's heads, and the Llama
model's ``load_weights`` maps those names onto ``qkv_proj`` through its ``stacked_params_mapping``
(vllm/model_executor/layers/linear.py, vllm/model_executor/models/llama.py,
https://github.com/vllm-project/vllm/tree/main/vllm/model_executor).  A rank store holds runtime entries
(the rank's shard, fused), which such a loader cannot take at TP > 1.  So for the entries that must go
through the loader, the worker rebuilds every canonical tensor with a piece in them at full size, the
rank's own pieces filled (from every entry of the rank they land in) and the rest zero: the loader
reads only its rank's slice.

``Routing`` is the part of a layout plan (protocol/layout_plan.py) one rank needs for that: the pieces
of the canonical tensors that reach some given runtime parameters, and those tensors' specs; it
travels as bounded JSON (``routing_to_json`` / ``routing_from_json``).  No IO here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from patchswarm.protocol.dtypes import BY_NAME
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import MAX_DIMS, Box, LayoutPlan, Piece, box_extents, box_in
from patchswarm.protocol.served import TensorSpec, typed_view, word_view

MAX_ROUTED_PIECES = 1 << 16  # one rank's loader entries: a fused projection has a few pieces per layer
MAX_ROUTED_ELEMENTS = 1 << 34  # the canonical tensors rebuilt at full size, together


@dataclass(frozen=True, slots=True)
class Routing:
    """For rank ``rank``: the canonical tensors (``sources``) with a piece in the routed parameters, and
    every piece of those tensors on this rank (also those landing in parameters that were not asked)."""

    rank: int
    sources: dict[str, TensorSpec]
    pieces: tuple[Piece, ...]
    params: dict[str, TensorSpec]  # the rank's runtime parameters the pieces land in


def routing_for(plan: LayoutPlan, canonical: Iterable[TensorSpec], rank: int, params: Iterable[str]) -> Routing:
    """The routing of runtime parameters ``params`` of ``rank`` (the plan passed ``check`` for ``canonical``)."""
    by_name = {s.name: s for s in canonical}
    wanted = set(params)
    unknown = sorted(wanted - set(plan.params[rank]))
    if unknown:
        raise PlanError(f"routing: rank {rank} has no runtime parameter {unknown[0]}")
    sources = sorted({p.source for p in plan.pieces if p.rank == rank and p.param in wanted})
    pieces = tuple(p for s in sources for p in plan.pieces_of(s) if p.rank == rank)
    if len(pieces) > MAX_ROUTED_PIECES:
        raise PlanError(f"routing: rank {rank}'s loader entries have more than {MAX_ROUTED_PIECES} pieces")
    return Routing(
        rank,
        {s: by_name[s] for s in sources},
        pieces,
        {p.param: plan.params[rank][p.param] for p in pieces},
    )


def routing_to_json(r: Routing) -> dict[str, Any]:
    def box(b: Box) -> list[list[int]]:
        return [[a, z] for a, z in b]

    return {
        "rank": r.rank,
        "sources": [s.to_wire() for s in r.sources.values()],
        "params": [s.to_wire() for s in r.params.values()],
        "pieces": [[p.source, p.param, box(p.src), box(p.dst)] for p in r.pieces],
    }


def _spec(obj: object, what: str) -> TensorSpec:
    if (
        not isinstance(obj, list)
        or len(obj) != 3
        or not isinstance(obj[0], str)
        or obj[1] not in BY_NAME
        or not isinstance(obj[2], list)
        or len(obj[2]) > MAX_DIMS
        or not all(type(n) is int and 0 <= n < 1 << 40 for n in obj[2])
    ):
        raise PlanError(f"routing: a {what} must be [name, dtype, shape]")
    return TensorSpec(obj[0], obj[1], tuple(obj[2]))


def _box(obj: object, shape: tuple[int, ...]) -> Box:
    if not isinstance(obj, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in obj
    ):
        raise PlanError("routing: a box must be [[start, stop], ...]")
    box = tuple((s[0], s[1]) for s in obj)
    if not box_in(box, shape):
        raise PlanError(f"routing: box {list(obj)} lies outside shape {list(shape)}")
    return box


def routing_from_json(obj: object) -> Routing:
    """A ``Routing`` from untrusted JSON; PlanError (one line) when it is malformed or too large."""
    if not isinstance(obj, dict) or set(obj) != {"rank", "sources", "params", "pieces"}:
        raise PlanError("routing: must be {rank, sources, params, pieces}")
    rank, raw_sources, raw_params, raw_pieces = obj["rank"], obj["sources"], obj["params"], obj["pieces"]
    if type(rank) is not int or rank < 0:
        raise PlanError("routing: rank must be a whole number")
    if not all(isinstance(x, list) and len(x) <= MAX_ROUTED_PIECES for x in (raw_sources, raw_params, raw_pieces)):
        raise PlanError(f"routing: sources, params and pieces are lists of at most {MAX_ROUTED_PIECES}")
    sources = {s.name: s for s in (_spec(x, "source") for x in raw_sources)}
    params = {s.name: s for s in (_spec(x, "parameter") for x in raw_params)}
    if sum(s.numel for s in sources.values()) > MAX_ROUTED_ELEMENTS:
        raise PlanError("routing: the canonical tensors to rebuild are too large")
    pieces = []
    for x in raw_pieces:
        if not isinstance(x, list) or len(x) != 4 or x[0] not in sources or x[1] not in params:
            raise PlanError("routing: a piece must be [source, param, src box, dst box] of listed tensors")
        src, dst = _box(x[2], sources[x[0]].shape), _box(x[3], params[x[1]].shape)
        if sources[x[0]].dtype != params[x[1]].dtype or _numel(src) != _numel(dst):
            raise PlanError(f"routing: a piece of {x[0]} does not match {x[1]} (dtype or element count)")
        pieces.append(Piece(x[0], rank, x[1], src, dst))
    return Routing(rank, sources, tuple(pieces), params)


def _numel(box: Box) -> int:
    n = 1
    for e in box_extents(box):
        n *= e
    return n


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def rebuild(
    r: Routing, entry_bytes: Callable[[str], torch.Tensor], params: Iterable[str] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Each routed canonical tensor with a piece in ``params`` (None: all) at full size, typed, with this
    rank's pieces copied in from its runtime entries (``entry_bytes(param)``: the entry's bytes, uint8)
    and zero elsewhere."""
    wanted = None if params is None else set(params)
    sources = {p.source for p in r.pieces if wanted is None or p.param in wanted}
    words: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    cache: dict[str, torch.Tensor] = {}
    for p in r.pieces:
        if p.source not in sources:
            continue
        src_spec, dst_spec = r.sources[p.source], r.params[p.param]
        if p.source not in out:
            data = torch.zeros(src_spec.nbytes, dtype=torch.uint8, device=entry_bytes(p.param).device)
            out[p.source] = data
            words[p.source] = word_view(data, src_spec).reshape(src_spec.shape)
        if p.param not in cache:
            raw = entry_bytes(p.param)
            if raw.numel() != dst_spec.nbytes:
                raise PlanError(f"routing: entry {p.param} holds {raw.numel()} bytes, not {dst_spec.nbytes}")
            cache[p.param] = word_view(raw, dst_spec).reshape(dst_spec.shape)
        piece = cache[p.param][_index(p.dst)]
        words[p.source][_index(p.src)] = piece.reshape(box_extents(p.src))
    return [(n, typed_view(out[n], r.sources[n])) for n in r.sources if n in out]

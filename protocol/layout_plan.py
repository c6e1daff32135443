"""Layout plans: where each canonical tensor's elements live among N ranks' runtime parameters.

A serving engine that runs a model on N GPUs (tensor or expert parallel) does not hold the checkpoint's
tensors: each rank holds its own runtime parameters, named and shaped as the engine's model code makes
them (vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and keeps only this rank's heads;
it pads the vocabulary and keeps only this rank's rows of ``embed_tokens``).  A plan says, for every
canonical tensor (Hugging Face checkpoint name), which *pieces* of it go where: a piece is a box (start,
stop per dim) of the canonical tensor copied to a box of the same elements in one rank's runtime
parameter.  The two boxes hold the same elements in the same row-major order; they may differ in
dims of extent 1 (a per-expert ``[2I, H]`` slice lands in ``w13_weight[e]``, a per-tensor scale of
shape ``[]`` lands in one element of a scale vector).  Runtime regions no piece covers are padding:
zero, owned by no canonical tensor.  A canonical tensor held whole by several ranks (norms, a kv head
replicated because there are fewer kv heads than ranks) has one piece per rank: a change reaches every copy.

``LayoutPlan.check`` refuses a plan that cannot be right, with one line, before any store is written;
``rank_model`` builds a rank's bytes from a canonical model; routing changes is ``layout_route.py``;
the built-in plans are ``layout_builtin.py``; plan files ``layout_file.py``.  No IO here.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from patchswarm.protocol.dtypes import BY_NAME
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view

Span = tuple[int, int]
Box = tuple[Span, ...]

MAX_WORLD = 4096  # ranks of one host; far above any node
MAX_DIMS = 8
MAX_GRID_CELLS = 1 << 22  # bound on the compressed grid of one tensor's check (a plan cut into dust)


@dataclass(frozen=True, slots=True)
class Piece:
    """``source[src]`` is copied to ``param[dst]`` on ``rank`` (boxes of the same elements, row-major)."""

    source: str
    rank: int
    param: str
    src: Box
    dst: Box


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def box_extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def squeezed(extents: Sequence[int]) -> tuple[int, ...]:
    return tuple(e for e in extents if e != 1)


def box_in(box: Box, shape: Sequence[int]) -> bool:
    return len(box) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(box, shape, strict=True))


def box_is_full(box: Box, shape: Sequence[int]) -> bool:
    return all(a == 0 and b == n for (a, b), n in zip(box, shape, strict=True))


def box_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """Whether the box is one run of the tensor's row-major flat order: leading dims of extent 1,
    then one dim of any extent, then full dims."""
    dims = len(shape)
    j = 0
    while j < dims and box[j][1] - box[j][0] == 1:
        j += 1
    return all(box[k] == (0, shape[k]) for k in range(j + 1, dims))


def strides_of(shape: Sequence[int]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * shape[k + 1]
    return tuple(out)


def box_flat_start(box: Box, shape: Sequence[int]) -> int:
    return sum(a * s for (a, _), s in zip(box, strides_of(shape), strict=True))


@dataclass(slots=True)
class LayoutPlan:
    """A plan for ``world`` ranks: each rank's runtime parameters (name -> spec) and the pieces.

    ``ignored`` names canonical tensors the engine does not load (``rotary_emb.inv_freq``, an
    ``lm_head.weight`` kept in a checkpoint whose embeddings are tied): they stay in the canonical
    store and reach no rank.  ``family`` says which rule built the plan (for messages and docs).
    """

    world: int
    params: list[dict[str, TensorSpec]]
    pieces: list[Piece]
    ignored: frozenset[str] = frozenset()
    family: str = ""
    padded: frozenset[tuple[int, str]] = frozenset()  # (rank, param) that may hold padding (vocabulary rows)
    _by_source: dict[str, list[Piece]] | None = field(default=None, repr=False, compare=False)

    def rank_specs(self, rank: int) -> list[TensorSpec]:
        """Runtime parameters of ``rank``, sorted by name (the order of that rank's store)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return [self.params[rank][n] for n in sorted(self.params[rank])]

    def pieces_of(self, source: str) -> list[Piece]:
        if self._by_source is None:
            by: dict[str, list[Piece]] = defaultdict(list)
            for p in self.pieces:
                by[p.source].append(p)
            self._by_source = dict(by)
        return self._by_source.get(source, [])

    def rank_nbytes(self, rank: int) -> int:
        return sum(s.nbytes for s in self.params[rank].values())

    def check(self, canonical_specs: Sequence[TensorSpec]) -> None:
        """Refuse, with one line, a plan that does not map these canonical tensors exactly."""
        check_plan(self, canonical_specs)


class PlanBuilder:
    """Collects runtime parameters and pieces; the built-in plans and the plan file both use it.

    A parameter declared twice on one rank with another shape or dtype is refused at once; every
    other fault (a hole, an overlap, an out-of-range box) is left to ``LayoutPlan.check``.
    """

    def __init__(self, world: int, family: str = "", max_pieces: int = 1 << 24) -> None:
        if not 1 <= world <= MAX_WORLD:
            raise PlanError(f"layout plan: a world of {world} ranks is outside 1..{MAX_WORLD}")
        self.world = world
        self.family = family
        self.max_pieces = max_pieces
        self.params: list[dict[str, TensorSpec]] = [{} for _ in range(world)]
        self.pieces: list[Piece] = []
        self.ignored: set[str] = set()
        self.padded: set[tuple[int, str]] = set()

    def param(self, rank: int, name: str, shape: Sequence[int], dtype: str, *, padded: bool = False) -> None:
        """Declare a runtime parameter; ``padded``: regions no piece covers are padding (else refused)."""
        if not 0 <= rank < self.world:
            raise PlanError(f"layout plan: {name}: rank {rank} outside a world of {self.world}")
        spec = TensorSpec(name, dtype, tuple(int(n) for n in shape))
        if padded:
            self.padded.add((rank, name))
        have = self.params[rank].get(name)
        if have is None:
            if len(spec.shape) > MAX_DIMS or any(n < 0 for n in spec.shape):
                raise PlanError(f"layout plan: {name}: bad shape {list(spec.shape)}")
            self.params[rank][name] = spec
        elif have.shape == spec.shape and have.dtype != spec.dtype:
            raise PlanError(
                f"layout plan: the pieces of {name} on rank {rank} have dtypes {have.dtype} and {spec.dtype}"
            )
        elif have != spec:
            raise PlanError(
                f"layout plan: {name} on rank {rank} declared twice, as {have.dtype}{list(have.shape)}"
                f" and {spec.dtype}{list(spec.shape)}"
            )

    def place(self, source: str, rank: int, param: str, src: Box, dst: Box) -> None:
        if len(self.pieces) >= self.max_pieces:
            raise PlanError(f"layout plan: more than {self.max_pieces} pieces")
        self.pieces.append(Piece(source, rank, param, tuple(src), tuple(dst)))

    def ignore(self, source: str) -> None:
        self.ignored.add(source)

    def build(self) -> LayoutPlan:
        return LayoutPlan(
            self.world,
            [dict(p) for p in self.params],
            list(self.pieces),
            frozenset(self.ignored),
            self.family,
            frozenset(self.padded),
        )


# ---------------------------------------------------------------- checking


def check_plan(plan: LayoutPlan, canonical_specs: Sequence[TensorSpec]) -> None:
    by_name = {s.name: s for s in canonical_specs}
    if len(plan.params) != plan.world:
        raise PlanError(f"layout plan: {len(plan.params)} ranks of parameters for a world of {plan.world}")
    for name in sorted(plan.ignored):
        if name not in by_name:
            raise PlanError(f"layout plan: ignores {name}, which the checkpoint does not have")
    for spec in canonical_specs:
        if spec.name in plan.ignored:
            if plan.pieces_of(spec.name):
                raise PlanError(f"layout plan: {spec.name} is both ignored and mapped")
        elif not plan.pieces_of(spec.name):
            raise PlanError(f"layout plan: canonical tensor {spec.name} is mapped to no rank")
    for rank, params in enumerate(plan.params):
        for name, pspec in params.items():
            if pspec.dtype not in BY_NAME:
                raise PlanError(f"layout plan: {name} on rank {rank}: unsupported dtype {pspec.dtype}")
    runtime_boxes: dict[tuple[int, str], list[Box]] = defaultdict(list)
    for p in plan.pieces:
        _check_piece(plan, p, by_name)
        runtime_boxes[(p.rank, p.param)].append(p.dst)
    for spec in canonical_specs:
        pieces = plan.pieces_of(spec.name)
        if pieces:
            _check_coverage(spec, pieces)
    for (rank, param), boxes in sorted(runtime_boxes.items()):
        if len(boxes) > 1 and not _disjoint(plan.params[rank][param].shape, boxes, f"{param} on rank {rank}"):
            raise PlanError(f"layout plan: a region of {param} on rank {rank} is written by two pieces")
    # disjoint now: pieces adding up to less than the parameter's size leave a hole
    for rank, params in enumerate(plan.params):
        for name, pspec in sorted(params.items()):
            if (rank, name) in plan.padded:
                continue
            covered = sum(math.prod(box_extents(b)) for b in runtime_boxes.get((rank, name), ()))
            if covered < pspec.numel:
                raise PlanError(f"layout plan: part of {name} on rank {rank} is written by no piece (not padding)")


def _check_piece(plan: LayoutPlan, p: Piece, by_name: dict[str, TensorSpec]) -> None:
    spec = by_name.get(p.source)
    where = f"layout plan: {p.source} -> {p.param}"
    if spec is None:
        raise PlanError(f"layout plan: maps {p.source}, which the checkpoint does not have")
    if not 0 <= p.rank < plan.world:
        raise PlanError(f"{where}: rank {p.rank} outside a world of {plan.world}")
    pspec = plan.params[p.rank].get(p.param)
    if pspec is None:
        raise PlanError(f"{where}: rank {p.rank} has no parameter {p.param}")
    if not box_in(p.src, spec.shape):
        raise PlanError(f"{where}: source region {_fmt(p.src)} is outside {p.source}'s shape {list(spec.shape)}")
    if not box_in(p.dst, pspec.shape):
        raise PlanError(f"{where}: region {_fmt(p.dst)} is outside the parameter's shape {list(pspec.shape)}")
    if squeezed(box_extents(p.src)) != squeezed(box_extents(p.dst)):
        raise PlanError(f"{where}: source region {_fmt(p.src)} and runtime region {_fmt(p.dst)} differ in shape")
    if spec.dtype != pspec.dtype:
        raise PlanError(f"{where} on rank {p.rank}: dtype {spec.dtype} into a {pspec.dtype} parameter")


def _check_coverage(spec: TensorSpec, pieces: list[Piece]) -> None:
    """Every element reaches at least one rank, and no rank receives an element twice."""
    per_rank: dict[int, list[Box]] = defaultdict(list)
    for p in pieces:
        per_rank[p.rank].append(p.src)
    for rank, boxes in sorted(per_rank.items()):
        if len(boxes) > 1 and not _disjoint(spec.shape, boxes, spec.name):
            raise PlanError(f"layout plan: a region of {spec.name} is mapped twice to rank {rank}")
    distinct = sorted({p.src for p in pieces})
    if len(distinct) == 1 and box_is_full(distinct[0], spec.shape):
        return
    if _disjoint(spec.shape, distinct, spec.name):
        covered = sum(math.prod(box_extents(b)) for b in distinct) == spec.numel
    else:
        covered = int(_grid_counts(spec.shape, distinct, spec.name).min()) > 0
    if not covered:
        raise PlanError(f"layout plan: part of {spec.name} is mapped to no rank")


SWEEP_ACTIVE = 64  # past this many boxes open at once, the sweep gives way to the grid


def _disjoint(shape: Sequence[int], boxes: list[Box], what: str) -> bool:
    """Whether no two boxes share an element: a sweep along dim 0 comparing only boxes whose dim-0
    spans overlap (nearly linear for the plans engines make), the grid when too many overlap there."""
    if len(boxes) < 2:
        return True
    if not shape:
        return False  # two boxes of a 0-d tensor are the same element
    active: list[Box] = []
    for box in sorted(boxes):
        start = box[0][0]
        active = [a for a in active if a[0][1] > start]
        for a in active:
            if all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, box, strict=True)):
                return False
        active.append(box)
        if len(active) > SWEEP_ACTIVE:
            return int(_grid_counts(shape, boxes, what).max()) <= 1
    return True


def _grid_counts(shape: Sequence[int], boxes: Iterable[Box], what: str) -> torch.Tensor:
    """How many boxes cover each cell of the grid cut at every box edge (coordinate compression)."""
    boxes = list(boxes)
    cuts = [sorted({0, n, *(b[k][0] for b in boxes), *(b[k][1] for b in boxes)}) for k, n in enumerate(shape)]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > MAX_GRID_CELLS:
        raise PlanError(f"layout plan: {what} is cut into more than {MAX_GRID_CELLS} regions")
    counts = torch.zeros(grid, dtype=torch.int32)
    for box in boxes:
        idx = tuple(
            slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b)) for c, (a, b) in zip(cuts, box, strict=True)
        )
        counts[idx] += 1
    return counts


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


# ---------------------------------------------------------------- full loads


def _words(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return word_view(data, spec).reshape(spec.shape)


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def rank_model(plan: LayoutPlan, model: ServedModel, rank: int) -> ServedModel:
    """Rank ``rank``'s runtime parameters built from a whole canonical model (padding left zero),
    on the model's device.  The plan must have passed ``check`` for the model's specs."""
    specs = plan.rank_specs(rank)
    device = model.data[0].device if model.data else torch.device("cpu")
    out = ServedModel.zeros_like(specs, device=device)
    slots = {s.name: i for i, s in enumerate(specs)}
    for cspec, cdata in model:
        if cspec.numel == 0:
            continue
        src_words = _words(cdata, cspec)
        for p in plan.pieces_of(cspec.name):
            if p.rank != rank:
                continue
            slot = slots[p.param]
            dst_words = _words(out.data[slot], specs[slot])
            dst_words[_index(p.dst)] = src_words[_index(p.src)].reshape(box_extents(p.dst))
    return out

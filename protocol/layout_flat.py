"""Routing a version's sparse changes to every rank in one pass, as runs over each rank store's words.

``layout_route.Router.route`` hands each rank one change per runtime parameter; with N ranks that
is hundreds of parameters, and the work per parameter (a binary search, a slice, an offset, a
concatenation of a fused parameter's parts, then per parameter again when staging and scattering)
made TP=8 cost twice TP=1 although the bytes are the same (docs/benchmarks.md, issue 33).  Here the
plan is compiled once, for the rank stores' layouts, into a table of segments: every piece of a
canonical tensor becomes one segment of some rank's output, and each rank's segments are listed in
the order of its store's words (slot, then position).  A version's changes are then routed with a
fixed number of vectorized operations whatever the number of ranks and parameters:

1. all canonical changes concatenated into one ascending array of global positions (each tensor
   offset by the elements before it);
2. one binary search of every row-split piece's bounds in it (the pieces that are flat runs at
   both ends: row splits, fused q/k/v and gate/up parts, replicated norms); the pieces split along
   an inner dim go through their tensor's grid (``layout_route._Grid``: one sort per tensor);
3. one gather of every segment, in output order, with each segment's offset added: the result,
   split by rank, is each rank's positions in its store's words (ascending), new and old words.

A plan this cannot express (a piece that is a run of its source but not of its parameter, pieces of
one parameter that interleave, canonical tensors of several word widths, a rank whose store words
are not one width) or a dense change makes ``FlatRouter.compile`` / ``route`` answer None, and the
caller uses ``Router.route``; both give the same writes (tests/unit/protocol/test_layout_flat.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import strides_of
from patchswarm.protocol.layout_route import Router, SlotChange


@dataclass(frozen=True, slots=True)
class RankChanges:
    """One rank's changes as one run over its store's words.

    ``positions``: int64 word indices into the rank store (the slot's first word + the element's
    flat position in its parameter), strictly ascending; ``new``/``old``: the words; ``slots`` the
    slots changed (ascending) and ``counts`` how many changes each has, in order."""

    slots: list[int]
    counts: list[int]
    positions: torch.Tensor
    new: torch.Tensor
    old: torch.Tensor

    def within(self, bases: Sequence[int]) -> torch.Tensor:
        """The positions within each slot's parameter (``bases[slot]``: the slot's first word)."""
        if not self.slots:
            return self.positions.clone()
        starts = torch.tensor([bases[s] for s in self.slots], dtype=torch.int64, device=self.positions.device)
        counts = torch.tensor(self.counts, dtype=torch.int64, device=starts.device)
        return self.positions - torch.repeat_interleave(starts, counts, output_size=self.positions.numel())

    def per_slot(self, bases: Sequence[int]) -> list[SlotChange]:
        """The same changes one per slot, positions within the parameter (``Router.route``'s form)."""
        rel = self.within(bases)
        return [
            SlotChange(s, p, n, o)
            for s, p, n, o in zip(
                self.slots,
                torch.split(rel, self.counts),
                torch.split(self.new, self.counts),
                torch.split(self.old, self.counts),
                strict=True,
            )
        ]


class FlatRouter:
    """A checked plan's routing compiled for the rank stores' layouts (``bases[r][slot]``: the word
    index where slot ``slot`` of rank ``r``'s store starts)."""

    def __init__(self, router: Router, bases: Sequence[Sequence[int]]) -> None:
        self.router = router
        self.world = router.plan.world
        # per canonical tensor, the flat bounds of its pieces that are runs at both ends (one binary
        # search of them per change), and its grid's pieces' numbers
        bounds: list[list[int]] = [[] for _ in router.specs]
        # every segment: (rank, slot, dst first, dst last, canonical tensor, kind, a, b, shift); kind
        # 0: the changes between bounds a and b of the tensor; kind 1: the tensor's grid piece a
        segs: list[tuple[int, int, int, int, int, int, int, int, int]] = []
        for i, routes in enumerate(router.routes):
            grid = router.grids[i]
            for r in routes:
                first = r.dst_base
                last = sum((b - 1) * s for (_, b), s in zip(r.dst, strides_of(r.dst_shape), strict=True))
                base = bases[r.rank][r.slot]
                if r.src_contiguous and r.dst_contiguous:
                    at = len(bounds[i])
                    bounds[i] += [r.src_flat, r.src_stop]
                    segs.append((r.rank, r.slot, first, last, i, 0, at, at + 1, base + r.dst_base - r.src_flat))
                elif not r.src_contiguous and grid is not None and grid.complete:
                    segs.append((r.rank, r.slot, first, last, i, 1, grid.routes.index(r), 0, base))
                else:
                    raise _Unsupported
        segs.sort(key=lambda t: (t[0], t[1], t[2]))
        for x, y in itertools.pairwise(segs):
            if (x[0], x[1]) == (y[0], y[1]) and x[3] >= y[2]:
                raise _Unsupported  # (two pieces of one parameter interleave: the output would need a sort)
        self.bounds = [torch.tensor(b, dtype=torch.int64) if b else None for b in bounds]
        # per rank, its segments in the order of its store's words: (slot, tensor, kind, a, b, shift)
        self.segments: list[list[tuple[int, int, int, int, int, int]]] = [[] for _ in range(self.world)]
        for t in segs:
            self.segments[t[0]].append((t[1], *t[4:]))

    @staticmethod
    def compile(router: Router, bases: Sequence[Sequence[int]]) -> FlatRouter | None:
        """The compiled routing, or None when the plan has pieces this cannot route (see the module)."""
        try:
            return FlatRouter(router, bases)
        except _Unsupported:
            return None

    def route(self, changes: Sequence[SlotChange]) -> list[RankChanges] | None:
        """Every rank's changes (one per rank, even if empty); None for a dense change or changes of
        several word dtypes (``Router.route`` handles those).  PlanError: a change the canonical
        layout cannot hold (a slot twice or out of range, positions out of range or not ascending)."""
        specs = self.router.specs
        by = self.router.by_slot(changes)
        if any(c.positions is None for c in by.values()):
            return None
        words = {c.new.dtype for c in by.values()} | {c.old.dtype for c in by.values()}
        if len(words) > 1:
            return None
        # per changed tensor: its positions (checked), the spans of its run pieces, its grid's pieces
        pos: dict[int, torch.Tensor] = {}
        spans: dict[int, list[int]] = {}
        grids: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = {}
        for i, c in by.items():
            p = c.positions
            assert p is not None
            p = p if p.dtype == torch.int64 else p.long()
            n = p.numel()
            if p.dim() != 1 or c.new.shape != (n,) or c.old.shape != (n,):
                raise PlanError(f"layout route: {specs[i].name}: positions, new and old must be flat, one each")
            if n and (int(p[0]) < 0 or int(p[-1]) >= specs[i].numel or (n > 1 and not bool((p[1:] > p[:-1]).all()))):
                raise PlanError(f"layout route: {specs[i].name}: positions out of range or not strictly ascending")
            pos[i] = p
            bounds = self.bounds[i]
            if bounds is not None:
                spans[i] = torch.searchsorted(p, bounds.to(p.device)).tolist()
            grid = self.router.grids[i]
            if grid is not None and n:
                dst, take, per = grid.sorted_by_piece(specs[i], p, [])
                starts = [0]
                for k in per:
                    starts.append(starts[-1] + k)
                grids[i] = (dst, torch.index_select(c.new, 0, take), torch.index_select(c.old, 0, take), starts)
        # each source as arrays to cut: numpy views on the host (a numpy slice costs a tenth of a
        # torch one, and a rank at TP=8 has ~40 segments of 3 arrays each), tensors elsewhere
        host = all(c.new.device.type == "cpu" for c in by.values())
        cut: Callable[[torch.Tensor], Any] = (lambda t: t.numpy()) if host else (lambda t: t)
        runs = {i: (cut(pos[i]), cut(by[i].new), cut(by[i].old)) for i in pos}
        cells = {i: (cut(d), cut(n), cut(o), starts) for i, (d, n, o, starts) in grids.items()}
        out: list[RankChanges] = []
        for k in range(self.world):
            ps: list[Any] = []
            ns: list[Any] = []
            os_: list[Any] = []
            shifts: list[int] = []
            lengths: list[int] = []
            slots: list[int] = []
            counts: list[int] = []
            for slot, i, kind, a, b, shift in self.segments[k]:
                if kind == 0:
                    if i not in runs:
                        continue
                    lo, hi = spans[i][a], spans[i][b]
                    p, n, o = runs[i]
                else:
                    if i not in cells:
                        continue
                    p, n, o, starts = cells[i]
                    lo, hi = starts[a], starts[a + 1]
                if lo == hi:
                    continue
                ps.append(p[lo:hi])
                ns.append(n[lo:hi])
                os_.append(o[lo:hi])
                shifts.append(shift)
                lengths.append(hi - lo)
                if slots and slots[-1] == slot:
                    counts[-1] += hi - lo
                else:
                    slots.append(slot)
                    counts.append(hi - lo)
            if not ps:
                empty = torch.empty(0, dtype=torch.int64)
                none = torch.empty(0, dtype=next(iter(words), torch.int16))
                out.append(RankChanges([], [], empty, none, none))
                continue
            if host:
                positions = torch.from_numpy(np.concatenate(ps))
                positions += torch.from_numpy(np.repeat(np.array(shifts, dtype=np.int64), lengths))
                new, old = torch.from_numpy(np.concatenate(ns)), torch.from_numpy(np.concatenate(os_))
            else:
                positions = torch.cat(ps)
                device = positions.device
                positions += torch.repeat_interleave(
                    torch.tensor(shifts, dtype=torch.int64, device=device),
                    torch.tensor(lengths, dtype=torch.int64, device=device),
                    output_size=positions.numel(),
                )
                new, old = torch.cat(ns), torch.cat(os_)
            out.append(RankChanges(slots, counts, positions, new, old))
        return out


class _Unsupported(Exception):
    """A plan the flat routing cannot express (Router.route routes it)."""

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import box_extents, strides_of
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
        specs = router.specs
        self.world = router.plan.world
        self.numel = [s.numel for s in specs]
        goff = [0]
        for s in specs:
            goff.append(goff[-1] + s.numel)
        self.goff = goff
        self.bound_values: list[int] = []
        # every segment: (rank, slot, dst first, dst last, kind, a, b, delta); kind 0: a run of the
        # concatenated changes between bounds a and b (indices into bound_values); kind 1: grid piece
        # b of canonical tensor a
        segs: list[tuple[int, int, int, int, int, int, int, int]] = []
        for i, routes in enumerate(router.routes):
            grid = router.grids[i]
            for r in routes:
                first = r.dst_base
                last = sum((b - 1) * s for (_, b), s in zip(r.dst, strides_of(r.dst_shape), strict=True))
                base = bases[r.rank][r.slot]
                if r.src_contiguous and r.dst_contiguous:
                    n = 1
                    for e in box_extents(r.src):
                        n *= e
                    lo = goff[i] + r.src_flat
                    a, b = len(self.bound_values), len(self.bound_values) + 1
                    self.bound_values += [lo, lo + n]
                    segs.append((r.rank, r.slot, first, last, 0, a, b, base + r.dst_base - lo))
                elif not r.src_contiguous and grid is not None and grid.complete:
                    segs.append((r.rank, r.slot, first, last, 1, i, grid.routes.index(r), base))
                else:
                    raise _Unsupported
        segs.sort(key=lambda t: (t[0], t[1], t[2]))
        for x, y in itertools.pairwise(segs):
            if (x[0], x[1]) == (y[0], y[1]) and x[3] >= y[2]:
                raise _Unsupported  # (two pieces of one parameter interleave: the output would need a sort)
        # grid pieces numbered across tensors, in canonical order, then piece order
        self.grid_first: dict[int, int] = {}
        ngrid = 0
        for i, grid in enumerate(router.grids):
            if grid is not None:
                self.grid_first[i] = ngrid
                ngrid += len(grid.routes)
        self.ngrid = ngrid
        self.kind = torch.tensor([t[4] for t in segs], dtype=torch.bool)
        self.bound_a = torch.tensor([t[5] if t[4] == 0 else 0 for t in segs], dtype=torch.int64)
        self.bound_b = torch.tensor([t[6] if t[4] == 0 else 0 for t in segs], dtype=torch.int64)
        self.grid_id = torch.tensor([self.grid_first[t[5]] + t[6] if t[4] == 1 else 0 for t in segs], dtype=torch.int64)
        self.delta = torch.tensor([t[7] for t in segs], dtype=torch.int64)
        self.bounds = torch.tensor(self.bound_values, dtype=torch.int64)
        # groups: one per (rank, slot), in output order
        groups: list[tuple[int, int]] = []
        gid: list[int] = []
        for t in segs:
            if not groups or groups[-1] != (t[0], t[1]):
                groups.append((t[0], t[1]))
            gid.append(len(groups) - 1)
        self.groups = groups
        self.group_of = torch.tensor(gid, dtype=torch.int64)
        self.rank_groups = [[g for g, (r, _) in enumerate(groups) if r == k] for k in range(self.world)]

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
        order = sorted(changes, key=lambda c: c.slot)
        for a, b in itertools.pairwise(order):
            if a.slot == b.slot:
                raise PlanError(f"layout route: two changes for {specs[a.slot].name}")
        if order and not (order[0].slot >= 0 and order[-1].slot < len(specs)):
            bad = order[0].slot if order[0].slot < 0 else order[-1].slot
            raise PlanError(f"layout route: canonical slot {bad} outside {len(specs)} tensors")
        if any(c.positions is None for c in order):
            return None
        if not order:
            empty = torch.empty(0, dtype=torch.int64)
            return [RankChanges([], [], empty, empty, empty) for _ in range(self.world)]
        wd = order[0].new.dtype
        if any(c.new.dtype != wd or c.old.dtype != wd for c in order):
            return None
        device = order[0].new.device
        for c in order:
            pos = c.positions
            assert pos is not None
            if pos.dim() != 1 or pos.shape != c.new.shape or c.old.shape != c.new.shape:
                raise PlanError(f"layout route: {specs[c.slot].name}: positions, new and old must be flat, one each")
        counts = [c.new.numel() for c in order]
        total = sum(counts)
        cnt = torch.tensor(counts, dtype=torch.int64, device=device)
        offs = torch.tensor([self.goff[c.slot] for c in order], dtype=torch.int64, device=device)
        ends = torch.tensor([self.goff[c.slot + 1] for c in order], dtype=torch.int64, device=device)
        glob = torch.cat([c.positions.long() for c in order if c.positions is not None])
        glob += torch.repeat_interleave(offs, cnt, output_size=total)
        # each tensor's positions inside it (first and last, with the whole ascending)
        if total:
            nz = cnt > 0
            last = torch.cumsum(cnt, 0) - 1
            first = last - cnt + 1
            outside = (glob[first[nz]] < offs[nz]) | (glob[last[nz]] >= ends[nz])
            if bool(outside.any()) or (total > 1 and not bool((glob[1:] > glob[:-1]).all())):
                raise PlanError("layout route: change positions out of range or not strictly ascending")
        new = torch.cat([c.new for c in order])
        old = torch.cat([c.old for c in order])
        spans = torch.searchsorted(glob, self.bounds.to(device))
        lo = spans[self.bound_a.to(device)]
        hi = spans[self.bound_b.to(device)]
        take_all: torch.Tensor | None = None
        pos_all = glob
        if self.ngrid:
            glo = torch.zeros(self.ngrid, dtype=torch.int64)
            ghi = torch.zeros(self.ngrid, dtype=torch.int64)
            ext_pos: list[torch.Tensor] = []
            ext_take: list[torch.Tensor] = []
            at, start = total, 0
            for c, n in zip(order, counts, strict=True):
                grid = self.router.grids[c.slot]
                if grid is not None and n:
                    assert c.positions is not None
                    dst, take, per = grid.sorted_by_piece(specs[c.slot], c.positions, [])
                    ext_pos.append(dst)
                    ext_take.append(take + start)
                    f = self.grid_first[c.slot]
                    cum = torch.tensor(per, dtype=torch.int64).cumsum(0)
                    ghi[f : f + len(per)] = cum + at
                    glo[f : f + len(per)] = cum - torch.tensor(per, dtype=torch.int64) + at
                    at += int(cum[-1]) if len(per) else 0
                start += n
            if ext_pos:  # (grid segments of unchanged tensors: bounds 0..0, empty)
                kind = self.kind.to(device)
                gid = self.grid_id.to(device)
                lo = torch.where(kind, glo.to(device)[gid], lo)
                hi = torch.where(kind, ghi.to(device)[gid], hi)
                pos_all = torch.cat([glob, *ext_pos])
                take_all = torch.cat([torch.arange(total, dtype=torch.int64, device=device), *ext_take])
        length = hi - lo
        out_n = int(length.sum())
        start_of = torch.cumsum(length, 0) - length
        shift = torch.repeat_interleave(self.delta.to(device), length, output_size=out_n)
        if take_all is None and out_n == total and bool((lo == start_of).all()):
            # every change once, in the order it came (one rank, no replicated piece): no gather
            positions, new_out, old_out = glob, new, old
            positions += shift
        else:
            idx = torch.arange(out_n, dtype=torch.int64, device=device)
            idx += torch.repeat_interleave(lo - start_of, length, output_size=out_n)
            positions = torch.index_select(pos_all, 0, idx)
            positions += shift
            take = idx if take_all is None else torch.index_select(take_all, 0, idx)
            new_out, old_out = torch.index_select(new, 0, take), torch.index_select(old, 0, take)
        per_group = torch.zeros(len(self.groups), dtype=torch.int64, device=device)
        per_group.index_add_(0, self.group_of.to(device), length)
        group_counts = per_group.tolist()
        out: list[RankChanges] = []
        at = 0
        for k in range(self.world):
            slots = [self.groups[g][1] for g in self.rank_groups[k] if group_counts[g]]
            ns = [group_counts[g] for g in self.rank_groups[k] if group_counts[g]]
            n = sum(ns)
            out.append(RankChanges(slots, ns, positions[at : at + n], new_out[at : at + n], old_out[at : at + n]))
            at += n
        return out


class _Unsupported(Exception):
    """A plan the flat routing cannot express (Router.route routes it)."""

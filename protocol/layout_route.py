"""Routing a version's changes from canonical tensors to the ranks' runtime parameters.

A change to a canonical tensor (sparse: flat positions ascending with new and old words; dense: the
whole tensor) becomes, for every rank holding a piece of it, a change to one runtime parameter at the
positions of the same elements there.  Everything is vectorized torch on the changes' own device,
never a loop over elements: the pieces that are flat runs of the canonical tensor (row splits) find
their changes with one binary search per tensor; those split along an inner dim (column splits) are
routed together in one pass per tensor (``_Grid``: cell by binary search, piece by table, one stable
sort by piece), so the work per change does not grow with the number of ranks.  A replicated
piece (a norm, a kv head shared by several ranks) yields a change on every rank that holds it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import (
    LayoutPlan,
    Piece,
    box_contiguous,
    box_extents,
    box_flat_start,
    box_is_full,
    strides_of,
)
from patchswarm.protocol.served import TensorSpec


@dataclass(frozen=True, slots=True)
class SlotChange:
    """New values for one tensor: at flat ``positions`` (int64, ascending), or the whole tensor when
    ``positions`` is None.  ``new`` and ``old`` are words (``served.word_view`` dtype), absolute values.

    For canonical changes ``slot`` indexes the canonical specs; for rank changes, that rank's
    ``rank_specs``.  (The daemon's ``store_format.TensorUpdate`` has the same fields.)"""

    slot: int
    positions: torch.Tensor | None
    new: torch.Tensor
    old: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Route:
    """One piece, with what routing needs precomputed (all Python ints)."""

    rank: int
    slot: int
    src: tuple[tuple[int, int], ...]
    src_flat: int  # flat start of the source box (when contiguous)
    src_contiguous: bool
    src_full: bool
    dst: tuple[tuple[int, int], ...]
    dst_base: int  # flat position of the runtime box's first element
    dst_extents: tuple[int, ...]
    dst_shape: tuple[int, ...]
    dst_full: bool
    dst_contiguous: bool
    # per source dim: the runtime stride its coordinate moves by (0 for a dim of extent 1)
    dst_stride_of_src_dim: tuple[int, ...]

    @property
    def src_stop(self) -> int:
        """The flat end of the source box (when contiguous: it is the run [src_flat, src_stop))."""
        return self.src_flat + math.prod(box_extents(self.src))


class Router:
    """Routes canonical changes to ranks for one (checked) plan and one canonical layout."""

    def __init__(self, plan: LayoutPlan, canonical_specs: Sequence[TensorSpec]) -> None:
        self.plan = plan
        self.specs = list(canonical_specs)
        self.slots = [{s.name: i for i, s in enumerate(plan.rank_specs(r))} for r in range(plan.world)]
        self.routes: list[list[_Route]] = [[self._compile(s, p) for p in plan.pieces_of(s.name)] for s in self.specs]
        # per canonical tensor, the flat bounds of its pieces that are one run of it: a sparse change
        # finds all its pieces' spans with one binary search (not one per rank)
        self.cuts: list[torch.Tensor | None] = []
        for routes in self.routes:
            bounds = [b for r in routes if _runs(r) for b in (r.src_flat, r.src_stop)]
            self.cuts.append(torch.tensor(bounds, dtype=torch.int64) if bounds else None)
        # per canonical tensor, its pieces that are not one run of it (column splits), routed together
        self.grids = [
            _Grid.compile(spec, [r for r in routes if not r.src_contiguous])
            for spec, routes in zip(self.specs, self.routes, strict=True)
        ]
        # pieces per (rank, slot): a parameter whose every piece changes densely is sent whole
        self.piece_count: dict[tuple[int, int], int] = defaultdict(int)
        for routes in self.routes:
            for r in routes:
                self.piece_count[(r.rank, r.slot)] += 1

    def by_slot(self, changes: Sequence[SlotChange]) -> dict[int, SlotChange]:
        """Canonical ``changes`` by slot, in their order; PlanError for a slot out of range or twice."""
        by: dict[int, SlotChange] = {}
        for ch in changes:
            if not 0 <= ch.slot < len(self.specs):
                raise PlanError(f"layout route: canonical slot {ch.slot} outside {len(self.specs)} tensors")
            if ch.slot in by:
                raise PlanError(f"layout route: two changes for {self.specs[ch.slot].name}")
            by[ch.slot] = ch
        return by

    def _compile(self, spec: TensorSpec, p: Piece) -> _Route:
        pshape = self.plan.params[p.rank][p.param].shape
        dstrides = strides_of(pshape)
        src_ext = box_extents(p.src)
        dst_ext = box_extents(p.dst)
        dst_dims = [k for k, e in enumerate(dst_ext) if e != 1]
        pairs: list[int] = []
        j = 0
        for e in src_ext:
            if e == 1:
                pairs.append(0)
            else:
                pairs.append(dstrides[dst_dims[j]])
                j += 1
        return _Route(
            rank=p.rank,
            slot=self.slots[p.rank][p.param],
            src=p.src,
            src_flat=box_flat_start(p.src, spec.shape),
            src_contiguous=box_contiguous(p.src, spec.shape),
            src_full=box_is_full(p.src, spec.shape),
            dst=p.dst,
            dst_base=box_flat_start(p.dst, pshape),
            dst_extents=dst_ext,
            dst_shape=pshape,
            dst_full=box_is_full(p.dst, pshape),
            dst_contiguous=box_contiguous(p.dst, pshape),
            dst_stride_of_src_dim=tuple(pairs),
        )

    def route(self, changes: Sequence[SlotChange]) -> list[list[SlotChange]]:
        """Per rank, the changes to its runtime parameters, one per slot, sorted by slot, positions ascending."""
        parts: dict[tuple[int, int], list[SlotChange]] = defaultdict(list)
        dense: dict[tuple[int, int], list[tuple[TensorSpec, _Route, SlotChange]]] = defaultdict(list)
        for ch in self.by_slot(changes).values():
            spec = self.specs[ch.slot]
            coords: list[torch.Tensor] = []  # the changes' coordinates, shared by this tensor's pieces
            grid = self.grids[ch.slot]
            cuts = self.cuts[ch.slot]
            spans: list[int] = []
            if ch.positions is not None and cuts is not None:
                spans = torch.searchsorted(ch.positions.long(), cuts.to(ch.positions.device)).tolist()
            j = 0
            for r in self.routes[ch.slot]:
                if ch.positions is None:
                    dense[(r.rank, r.slot)].append((spec, r, ch))
                    continue
                if grid is not None and not r.src_contiguous:
                    continue  # (routed below, all such pieces in one pass)
                span = None
                if _runs(r):
                    span, j = (spans[j], spans[j + 1]), j + 2
                part = _sparse(spec, r, ch, coords, span)
                if part is not None:
                    parts[(r.rank, r.slot)].append(part)
            if grid is not None and ch.positions is not None:
                for r, part in grid.route(spec, ch, coords):
                    parts[(r.rank, r.slot)].append(part)
        for key, ds in dense.items():
            if len(ds) == self.piece_count[key] and key not in parts:
                # every piece of the parameter changes whole: one whole update, padding zero, no positions
                parts[key].append(_whole(ds))
            else:
                parts[key].extend(_dense(spec, r, ch) for spec, r, ch in ds)
        out: list[list[SlotChange]] = [[] for _ in range(self.plan.world)]
        for (rank, slot), ps in sorted(parts.items()):
            out[rank].append(_merge(slot, ps))
        return out


MAX_GRID_CELLS = 1 << 16  # more cells than this (a pathological plan): one mask per piece instead


@dataclass(frozen=True, slots=True)
class _Grid:
    """A canonical tensor's pieces that are not one flat run of it (split along an inner dim), routed
    in one pass: the pieces' box bounds cut every dim into intervals, so the tensor into cells; each
    change finds its cell by one binary search per cut dim, its piece(s) by a table lookup, its
    runtime position from the piece's offset and strides, and one stable sort by piece (positions stay
    ascending within a piece) and one split hand each piece its changes.  The cost per change is the
    same whatever the number of pieces; a mask per piece made it grow with the ranks."""

    routes: tuple[_Route, ...]
    cuts: tuple[tuple[int, torch.Tensor, int], ...]  # (dim, inner bounds, cell radix) of the dims cut
    widths: tuple[int, ...]  # per cut: the intervals' width when all are equal (a division, not a search), else 0
    table: torch.Tensor  # [cells, cover]: the pieces covering each cell, -1 past the last
    complete: bool  # every cell is covered by exactly one piece
    offset: torch.Tensor  # per piece: dst_base - sum(src start * runtime stride)
    strides: torch.Tensor  # [pieces, dims]: runtime stride of each source coordinate
    uniform: tuple[int, ...] | None  # the strides when every piece has the same

    @property
    def split_matrix(self) -> bool:
        """A matrix cut along one dim into equal widths, one piece per cell, one set of strides."""
        return (
            self.complete
            and self.uniform is not None
            and len(self.uniform) == 2
            and len(self.cuts) == 1
            and bool(self.widths[0])
        )

    @staticmethod
    def compile(spec: TensorSpec, routes: list[_Route]) -> _Grid | None:
        if not routes:
            return None
        bounds = [sorted({0, n} | {x for r in routes for x in r.src[d]}) for d, n in enumerate(spec.shape)]
        cells = math.prod(len(b) - 1 for b in bounds)
        if cells > MAX_GRID_CELLS:
            return None
        radix = strides_of(tuple(len(b) - 1 for b in bounds))
        cover: list[list[int]] = [[] for _ in range(cells)]
        for i, r in enumerate(routes):
            ranges = [range(b.index(a), b.index(e)) for b, (a, e) in zip(bounds, r.src, strict=True)]
            for cell in _product(ranges, radix):
                cover[cell].append(i)
        width = max(len(c) for c in cover)
        table = torch.full((cells, width), -1, dtype=torch.int64)
        for cell, c in enumerate(cover):
            table[cell, : len(c)] = torch.tensor(c, dtype=torch.int64)
        cuts = tuple(
            (d, torch.tensor(b[1:-1], dtype=torch.int64), radix[d]) for d, b in enumerate(bounds) if len(b) > 2
        )
        widths = tuple(b[1] if all(x == i * b[1] for i, x in enumerate(b)) else 0 for b in bounds if len(b) > 2)
        offsets = [
            r.dst_base - sum(a * s for (a, _), s in zip(r.src, r.dst_stride_of_src_dim, strict=True)) for r in routes
        ]
        strides = {r.dst_stride_of_src_dim for r in routes}
        return _Grid(
            routes=tuple(routes),
            cuts=cuts,
            widths=widths,
            table=table,
            complete=all(len(c) == 1 for c in cover),
            offset=torch.tensor(offsets, dtype=torch.int64),
            strides=torch.tensor([r.dst_stride_of_src_dim for r in routes], dtype=torch.int64),
            uniform=next(iter(strides)) if len(strides) == 1 else None,
        )

    def route(self, spec: TensorSpec, ch: SlotChange, coords: list[torch.Tensor]) -> list[tuple[_Route, SlotChange]]:
        assert ch.positions is not None
        dst, take, counts = self.sorted_by_piece(spec, ch.positions, coords)
        out: list[tuple[_Route, SlotChange]] = []
        at = 0
        new, old = ch.new[take], ch.old[take]
        for r, n in zip(self.routes, counts, strict=True):
            if n:
                out.append((r, SlotChange(r.slot, dst[at : at + n], new[at : at + n], old[at : at + n])))
            at += n
        return out

    def sorted_by_piece(
        self, spec: TensorSpec, positions: torch.Tensor, coords: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The changes at ``positions`` grouped by piece (in ``routes`` order, positions ascending
        within each): their runtime positions, which change each one is (indices into
        ``positions``), and how many each piece has."""
        pos = positions if positions.dtype == torch.int64 else positions.long()
        device = pos.device
        if self.split_matrix and not coords:
            # (the usual column split: a matrix cut along one dim into equal widths) the same
            # arithmetic with one division for the coordinates and one for the piece
            cols = spec.shape[1]
            row = torch.div(pos, cols, rounding_mode="floor")
            col = pos - row * cols
            assert self.uniform is not None
            d = self.cuts[0][0]  # (one cut dim, the other whole: the cell is the interval)
            piece = self.table[:, 0].to(device)[
                torch.div(row if d == 0 else col, self.widths[0], rounding_mode="floor")
            ]
            dst = self.offset.to(device)[piece]
            for c, st in ((row, self.uniform[0]), (col, self.uniform[1])):
                if st:
                    dst += c * st
            order = stable_order(piece, len(self.routes))
            counts = torch.bincount(piece, minlength=len(self.routes)).tolist()
            return torch.index_select(dst, 0, order), order, counts
        if not coords:
            coords.extend(_coords(pos, spec.shape))
        cell = torch.zeros_like(pos)
        for (d, inner, radix), width in zip(self.cuts, self.widths, strict=True):
            if width:
                cell += torch.div(coords[d], width, rounding_mode="floor") * radix
            else:
                cell += torch.searchsorted(inner.to(device), coords[d], right=True) * radix
        table = self.table.to(device)
        idx: torch.Tensor | None = None  # which changes (None: all, in order) ...
        if self.complete:
            piece = table[cell, 0]
        else:  # ... each once per piece covering its cell
            sel, pcs = [], []
            for layer in range(table.shape[1]):
                p = table[cell, layer]
                keep = (p >= 0).nonzero().squeeze(1)
                sel.append(keep)
                pcs.append(p[keep])
            idx, piece = torch.cat(sel), torch.cat(pcs)
            coords = [c[idx] for c in coords]
        dst = self.offset.to(device)[piece]
        if self.uniform is not None:
            for c, s in zip(coords, self.uniform, strict=True):
                if s:
                    dst += c * s
        else:
            strides = self.strides.to(device)[piece]
            for d, c in enumerate(coords):
                dst += c * strides[:, d]
        order = stable_order(piece, len(self.routes))
        counts = torch.bincount(piece, minlength=len(self.routes)).tolist()
        take = order if idx is None else torch.index_select(idx, 0, order)
        return torch.index_select(dst, 0, order), take, counts


def stable_order(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """The permutation that sorts ``keys`` (int64 in [0, bound)) stably.  On the host, numpy's
    stable sort of 8- or 16-bit integers is a radix sort: 7-14x faster than torch's for 14-76 K keys
    (measured, issue 33)."""
    if keys.device.type == "cpu" and bound <= 1 << 15:
        small = keys.to(torch.uint8 if bound <= 1 << 8 else torch.int16).numpy()
        return torch.from_numpy(np.argsort(small, kind="stable")).to(torch.int64)
    return torch.sort(keys, stable=True).indices


def _product(ranges: list[range], radix: tuple[int, ...]) -> list[int]:
    """The cell numbers of a box of cells (one range of interval indices per dim)."""
    cells = [0]
    for rng, step in zip(ranges, radix, strict=True):
        cells = [c + i * step for c in cells for i in rng]
    return cells


def route_changes(
    plan: LayoutPlan, canonical_specs: Sequence[TensorSpec], changes: Sequence[SlotChange]
) -> list[list[SlotChange]]:
    return Router(plan, canonical_specs).route(changes)


def _coords(positions: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    out = []
    for n, s in zip(shape, strides_of(shape), strict=True):
        out.append(torch.div(positions, s, rounding_mode="floor") % n if n > 1 else torch.zeros_like(positions))
    return out


def _runs(r: _Route) -> bool:
    """Whether ``_sparse`` finds the piece's changes by binary search (one run, not the whole tensor)."""
    return r.src_contiguous and not (r.src_full and r.dst_full)


def _sparse(
    spec: TensorSpec, r: _Route, ch: SlotChange, shared: list[torch.Tensor], span: tuple[int, int] | None
) -> SlotChange | None:
    """``span``: where the piece's run lies in ``ch.positions`` (for a ``_runs`` piece).  ``shared``:
    the coordinates of all of ``ch``'s positions once computed (filled here when empty), so that
    the pieces of a tensor split along an inner dim compute them once, not once per rank."""
    assert ch.positions is not None
    pos = ch.positions if ch.positions.dtype == torch.int64 else ch.positions.long()
    if r.src_full and r.dst_full:
        return SlotChange(r.slot, pos, ch.new, ch.old)
    if r.src_contiguous:
        assert span is not None
        lo, hi = span
        if lo == hi:
            return None
        sel = pos[lo:hi]
        new, old = ch.new[lo:hi], ch.old[lo:hi]
        if r.dst_contiguous:
            return SlotChange(r.slot, sel - r.src_flat + r.dst_base, new, old)
        coords = _coords(sel, spec.shape)
        chosen = sel
    else:
        if not shared:
            shared.extend(_coords(pos, spec.shape))
        coords = shared
        mask = torch.ones_like(pos, dtype=torch.bool)
        for c, (a, b), n in zip(coords, r.src, spec.shape, strict=True):
            if (a, b) != (0, n):
                mask &= (c >= a) & (c < b)
        idx = mask.nonzero().squeeze(1)
        if idx.numel() == 0:
            return None
        coords = [c[idx] for c in coords]
        new, old = ch.new[idx], ch.old[idx]
        chosen = pos[idx]
    dst = torch.full_like(chosen, r.dst_base)
    for c, (a, _), stride in zip(coords, r.src, r.dst_stride_of_src_dim, strict=True):
        if stride:
            dst += (c - a) * stride
    return SlotChange(r.slot, dst, new, old)


def _dense(spec: TensorSpec, r: _Route, ch: SlotChange) -> SlotChange:
    box = tuple(slice(a, b) for a, b in r.src)
    new = ch.new.reshape(spec.shape)[box].reshape(-1)
    old = ch.old.reshape(spec.shape)[box].reshape(-1)
    if r.dst_full:
        return SlotChange(r.slot, None, new, old)
    device = ch.new.device
    if r.dst_contiguous:
        pos = torch.arange(r.dst_base, r.dst_base + new.numel(), dtype=torch.int64, device=device)
        return SlotChange(r.slot, pos, new, old)
    strides = strides_of(r.dst_shape)
    pos = torch.full((), r.dst_base, dtype=torch.int64, device=device)
    for k, (e, s) in enumerate(zip(r.dst_extents, strides, strict=True)):
        view = [1] * len(r.dst_extents)
        view[k] = e
        pos = pos + (torch.arange(e, dtype=torch.int64, device=device) * s).reshape(view)
    return SlotChange(r.slot, pos.reshape(-1), new, old)


def _whole(ds: list[tuple[TensorSpec, _Route, SlotChange]]) -> SlotChange:
    """One runtime parameter assembled whole from dense changes covering all its pieces."""
    first = ds[0][1]
    if len(ds) == 1 and first.dst_full:
        return _dense(*ds[0])
    ch0 = ds[0][2]
    new = torch.zeros(first.dst_shape, dtype=ch0.new.dtype, device=ch0.new.device)
    old = torch.zeros_like(new)
    for spec, r, ch in ds:
        src = tuple(slice(a, b) for a, b in r.src)
        dst = tuple(slice(a, b) for a, b in r.dst)
        new[dst] = ch.new.reshape(spec.shape)[src].reshape(r.dst_extents)
        old[dst] = ch.old.reshape(spec.shape)[src].reshape(r.dst_extents)
    return SlotChange(first.slot, None, new.reshape(-1), old.reshape(-1))


def _merge(slot: int, parts: list[SlotChange]) -> SlotChange:
    if len(parts) == 1:
        return parts[0]
    if any(p.positions is None for p in parts):
        raise PlanError("layout route: a whole-parameter change meets another change of the same parameter")
    # (each part ascending: the parts in order of their first and last positions need no sort when
    # they do not interleave, the usual case: the pieces of a fused parameter lie one after another)
    bounds = sorted(
        (int(p.positions[0]), int(p.positions[-1]), i)
        for i, p in enumerate(parts)
        if p.positions is not None and p.positions.numel()
    )
    parts = [parts[i] for _, _, i in bounds] or parts[:1]
    pos = torch.cat([p.positions for p in parts if p.positions is not None])
    new = torch.cat([p.new for p in parts])
    old = torch.cat([p.old for p in parts])
    if any(a[1] >= b[0] for a, b in itertools.pairwise(bounds)):
        order = torch.argsort(pos)
        pos, new, old = pos[order], new[order], old[order]
    return SlotChange(slot, pos, new, old)

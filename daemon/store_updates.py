"""The in-place writes of one version into a weight store's buffer: the updates between two
versions, their checks against the store's layout, their move to its device (per slot, or as one
run over the store's words), and the scatter that reads its values back.

``WeightStore`` (daemon/weightstore.py) calls these on its layout and buffer; the fence, the
journal and the version flip around them are its own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

from patchswarm.daemon.store_format import StoreLayout, StoreLayoutMismatch, TensorUpdate
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.layout_flat import RankChanges
from patchswarm.protocol.served import ServedModel, word_view
from patchswarm.protocol.sparse_apply import DENSE_FRACTION  # (a tensor changed more than this is written whole)

__all__ = ["FLAT_SLOT", "device_sync", "diff_updates", "torch_threads"]

FLAT_SLOT = -1  # a staged update of the whole store's words (``flatten``)


def diff_updates(old: ServedModel, new: ServedModel, dense_fraction: float = DENSE_FRACTION) -> list[TensorUpdate]:
    """The in-place writes that turn ``old`` into ``new`` (protocol.diffscan per tensor)."""
    if old.specs != new.specs:
        raise StoreLayoutMismatch("the two versions do not have the same tensor names, dtypes and shapes")
    out: list[TensorUpdate] = []
    for i, spec in enumerate(old.specs):
        a, b = word_view(old.data[i], spec), word_view(new.data[i], spec)
        ch = scan(a, b)
        if len(ch) == 0:
            continue
        if len(ch) > dense_fraction * spec.numel:
            out.append(TensorUpdate(i, None, b, a))
        else:
            out.append(TensorUpdate(i, ch.positions, ch.new, ch.old))
    return out


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _halves(pos: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> list[TensorUpdate]:
    """Sparse updates of the whole store's words (``FLAT_SLOT``) as two, so that the "mid_write"
    crash point falls between them."""
    half = pos.numel() // 2
    return [
        TensorUpdate(FLAT_SLOT, p, n, o)
        for p, n, o in ((pos[:half], new[:half], old[:half]), (pos[half:], new[half:], old[half:]))
    ]


def stage_updates(layout: StoreLayout, data: torch.Tensor, updates: list[TensorUpdate]) -> list[TensorUpdate]:
    """Check updates against the layout and move them to the buffer's device (before the pause)."""
    device = data.device
    out: list[TensorUpdate] = []
    seen: set[int] = set()
    for u in updates:
        if not 0 <= u.slot < len(layout.slots) or u.slot in seen:
            raise ValueError(f"update for slot {u.slot}: no such slot, or given twice")
        seen.add(u.slot)
        spec = layout.slots[u.slot].spec
        wd = spec.dt.word_dtype
        if u.new.dtype != wd or u.old.dtype != wd or u.new.shape != u.old.shape or u.new.dim() != 1:
            raise ValueError(f"update for {spec.name}: new/old must be flat {wd} tensors of equal length")
        if u.positions is None:
            if u.new.numel() != spec.numel:
                raise ValueError(f"dense update for {spec.name} has {u.new.numel()} of {spec.numel} elements")
            pos = None
        else:
            p = u.positions
            if p.dtype != torch.int64 or p.shape != u.new.shape:
                raise ValueError(f"update for {spec.name}: positions must be int64, one per value")
            if p.numel():
                lo, hi = torch.aminmax(p)
                if int(lo) < 0 or int(hi) >= spec.numel:
                    raise ValueError(f"update for {spec.name}: position out of range")
            pos = p.to(device, non_blocking=True)
        out.append(TensorUpdate(u.slot, pos, u.new.to(device, non_blocking=True), u.old.to(device)))
    out = flatten(layout, data, out)
    device_sync(device)
    return out


def stage_run(layout: StoreLayout, data: torch.Tensor, run: RankChanges) -> list[TensorUpdate] | None:
    """``stage_updates`` for updates given as one run over the store's words (positions: word
    indices, ``StoreLayout.word_bases``; protocol/layout_flat.py routes them so): checked against
    the parameter each is given for (not only the store's words: a position past its parameter
    would land in the next one) and moved to its device as two updates of the whole store's words
    (``FLAT_SLOT``), so that the "mid_write" crash point falls between them.  None: the store's
    words are not one width or its buffer is not aligned to it (stage them per slot)."""
    bases = layout.word_bases()
    if bases is None or data.data_ptr() % layout.slots[0].spec.dt.width:
        return None
    positions, new, old = run.positions, run.new, run.old
    if not run.slots and positions.numel() == new.numel() == old.numel() == 0:
        return []  # (no change: its empty words' dtype says nothing of this store's)
    wd = layout.slots[0].spec.dt.word_dtype
    if new.dtype != wd or old.dtype != wd or new.shape != old.shape or new.dim() != 1:
        raise ValueError(f"store updates: new/old must be flat {wd} tensors of equal length")
    if positions.dtype != torch.int64 or positions.shape != new.shape:
        raise ValueError("store updates: positions must be int64, one per value")
    n = positions.numel()
    if len(run.slots) != len(run.counts) or sum(run.counts) != n or any(c <= 0 for c in run.counts):
        raise ValueError("store updates: the run's slots and counts do not cover its positions")
    nslots = len(layout.slots)
    if any(not 0 <= s < nslots for s in run.slots) or any(a >= b for a, b in itertools.pairwise(run.slots)):
        raise ValueError("store updates: the run's slots are out of range or not ascending")
    if n:
        sizes = torch.tensor([layout.slots[s].spec.numel for s in run.slots], dtype=torch.int64)
        ends = torch.repeat_interleave(sizes.to(positions.device), torch.tensor(run.counts).to(positions.device))
        rel = run.within(bases)
        if not bool(((rel >= 0) & (rel < ends)).all()):
            raise ValueError("store updates: a position outside its parameter")
    device = data.device
    pos = positions.to(device, non_blocking=True)
    out = _halves(pos, new.to(device, non_blocking=True), old.to(device))
    device_sync(device)
    return out


def flatten(layout: StoreLayout, data: torch.Tensor, staged: list[TensorUpdate]) -> list[TensorUpdate]:
    """The sparse updates as two updates of the whole store's words (``FLAT_SLOT``; positions
    offset by each slot's start) when every slot has one word width: a rank store has hundreds
    of parameters, and a scatter, gather and compare per parameter cost more than the values.
    Two, so that the "mid_write" crash point falls between them."""
    sparse = [u for u in staged if u.positions is not None]
    widths = {sl.spec.dt.width for sl in layout.slots}
    if len(sparse) < 3 or len(widths) != 1 or data.data_ptr() % (w := widths.pop()):
        return staged
    if any(sl.offset % w for sl in layout.slots):
        return staged
    pos = torch.cat([u.positions + layout.slots[u.slot].offset // w for u in sparse if u.positions is not None])
    new = torch.cat([u.new for u in sparse])
    old = torch.cat([u.old for u in sparse])
    return [u for u in staged if u.positions is None] + _halves(pos, new, old)


def store_words(layout: StoreLayout, data: torch.Tensor, slot: int) -> torch.Tensor:
    """A slot's words, or (``FLAT_SLOT``) all of the store's words (one width: ``flatten``)."""
    if slot != FLAT_SLOT:
        s = layout.slots[slot]
        return word_view(data[s.offset : s.offset + s.nbytes], s.spec)
    end = max(sl.offset + sl.nbytes for sl in layout.slots)
    return data[:end].view(layout.slots[0].spec.dt.word_dtype)


def scatter_checked(
    layout: StoreLayout, data: torch.Tensor, staged: list[TensorUpdate], *, new: bool, fault: Callable[[str], None]
) -> bool:
    """Scatter new (or old) values, then gather and compare them; True if all read back equal.

    Must run inside the fence.  On a GPU this is one sync at the end (the comparison); ``fault``
    is called with "mid_write" between the two halves of the writes (crash tests)."""
    bad = torch.zeros((), dtype=torch.int64, device=data.device)
    for k, u in enumerate(staged):
        w = store_words(layout, data, u.slot)
        vals = u.new if new else u.old
        if u.positions is None:
            w.copy_(vals)
        else:
            w.index_copy_(0, u.positions, vals)
        if k == (len(staged) - 1) // 2:
            fault("mid_write")
    for u in staged:
        w = store_words(layout, data, u.slot)
        vals = u.new if new else u.old
        got = w if u.positions is None else torch.index_select(w, 0, u.positions)
        bad += torch.count_nonzero(got != vals)
    return int(bad) == 0

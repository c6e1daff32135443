"""The changed byte ranges of an activation, per store entry, as an engine driver hands them to a
copy engine (daemon/engine_driver.py ``Activation.regions``).

A version's changes are word positions (daemon/store_format.py ``TensorUpdate``); a copy engine
wants few, large copies.  Runs of changed words are merged when the bytes between them are fewer
than ``MERGE_GAP_BYTES`` (copying a gap costs less than another call), and an entry whose changes
still make more than ``MAX_RANGES_PER_ENTRY`` runs is handed over whole: the number of regions per
entry is bounded whatever the patch, and every changed byte lies in exactly one region.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from patchswarm.daemon.engine_driver import Region
from patchswarm.protocol.served import TensorSpec

MERGE_GAP_BYTES = 64 << 10
MAX_RANGES_PER_ENTRY = 64


def entry_regions(
    name: str,
    word_bytes: int,
    nbytes: int,
    positions: torch.Tensor | None,
    *,
    gap: int = MERGE_GAP_BYTES,
    max_ranges: int = MAX_RANGES_PER_ENTRY,
) -> tuple[Region, ...]:
    """The regions of entry ``name`` (``nbytes`` long, words of ``word_bytes``) covering the words at
    ``positions`` (int64 word indices; None: the whole entry), sorted and disjoint."""
    if nbytes <= 0:
        return ()
    if positions is None:
        return (Region(name, 0, nbytes),)
    if positions.numel() == 0:
        return ()
    # numpy, one thread: torch's element-wise ops on a busy host's shared cores cost 100x more here
    pos = positions.detach().to("cpu", torch.int64).reshape(-1).numpy()
    if pos.size > 1 and not bool((pos[1:] > pos[:-1]).all()):
        pos = np.unique(pos)  # (sorted; the stores' changes already are, strictly ascending)
    if int(pos[0]) < 0 or (int(pos[-1]) + 1) * word_bytes > nbytes:
        raise ValueError(f"{name}: a changed word lies outside the entry's {nbytes} bytes")
    # A new run starts where the bytes skipped since the previous changed word reach the gap.
    skipped = (pos[1:] - pos[:-1] - 1) * word_bytes
    breaks = np.flatnonzero(skipped >= gap)
    if breaks.size + 1 > max_ranges:
        return (Region(name, 0, nbytes),)
    firsts = np.concatenate([pos[:1], pos[breaks + 1]]).tolist()
    lasts = np.concatenate([pos[breaks], pos[-1:]]).tolist()
    return tuple(Region(name, a * word_bytes, (b + 1) * word_bytes) for a, b in zip(firsts, lasts, strict=True))


def store_regions(
    specs: Sequence[TensorSpec], changes: Iterable[tuple[int, torch.Tensor | None]]
) -> tuple[Region, ...]:
    """The regions of one store from its changes ``(slot, word positions or None)``, in entry order."""
    by_slot: dict[int, list[torch.Tensor | None]] = {}
    for slot, positions in changes:
        by_slot.setdefault(slot, []).append(positions)
    out: list[Region] = []
    for slot in sorted(by_slot):
        spec, parts = specs[slot], by_slot[slot]
        whole = any(p is None for p in parts)
        positions = None if whole else (parts[0] if len(parts) == 1 else torch.cat([p for p in parts if p is not None]))
        width = spec.dt.word_dtype.itemsize
        out += entry_regions(spec.name, width, spec.nbytes, positions)
    return tuple(out)


def whole_regions(specs: Sequence[TensorSpec]) -> tuple[Region, ...]:
    """Every entry of a store, whole (a store loaded in full)."""
    return tuple(Region(s.name, 0, s.nbytes) for s in specs if s.nbytes > 0)

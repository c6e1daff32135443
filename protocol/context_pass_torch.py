"""The SPARSE_CTX context pass over the base in torch ops, on the device where the base lives
(protocol/context_coding.py holds the format, the bit-stream reader and writer, and the numpy pass).

A store in GPU memory encodes and decodes format-2 records without copying its base to the host.
Per batch of blocks, one vectorized scan gives each element its group (exponent field, bucketized
by the thresholds), and one stable sort of the keys (block, group) puts each block's elements in
group order, and in position order within a group.  Element ``i`` of a block's stretch of that
order is then the member of flat rank ``i`` (members of earlier groups + rank in its group): the
decoder's ranks select their positions with one gather, the encoder's changes find their ranks
through the inverse of the order, and the group sizes are where each key starts in the sorted keys.
Only the group sizes (blocks x groups integers) and the ranks cross between host and device.

CPU bases keep the numpy pass (``ON_CPU`` off): side by side it is faster there
(docs/benchmarks.md, issue 37).
"""

from __future__ import annotations

import numpy as np
import torch

from patchswarm.protocol import context_coding
from patchswarm.protocol.context_coding import MAX_GROUPS, decode_ctx, encode_ctx, exponent_field, sample_step
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import Piece, StreamReader

# Elements scanned per batch: temporaries are about 24 bytes an element (exponent field, bucket
# index, key, sorted key, int64 order, the sort's scratch; the encoder adds the order's int64
# inverse), ~200-270 MB at this size.
BATCH_ELEMENTS = 1 << 23
# Whether CPU bases use this pass too (else numpy's); tests set it to run the CPU twin end to end.
ON_CPU = False


def use_torch_pass(base: torch.Tensor) -> bool:
    """Whether a record over ``base`` decodes with this pass (a device base always does)."""
    return ON_CPU or base.device.type != "cpu"


class TorchPass:
    """:class:`protocol.context_coding.ContextPass` over ``words`` (a base's signed word view, any device)."""

    def __init__(self, words: torch.Tensor, m: int, e: int, thresholds: np.ndarray, k: int, block: int) -> None:
        self.words, self.m, self.e, self.block = words, m, e, block
        self.groups = thresholds.size + 1
        self.thresholds = torch.from_numpy(thresholds).to(words.device)
        # (blocks of a batch x (groups + 1) sort keys fit an int16)
        self.per_batch = max(1, min(BATCH_ELEMENTS // block, ((1 << 15) - 2) // (MAX_GROUPS + 1)))
        self.out = torch.empty(k, dtype=torch.int64, device=words.device)
        self.done = 0
        self.first = -1  # first block of the batch held (none yet)
        self.order: torch.Tensor | None = None  # the batch's elements by (block, group, position)
        self.place: torch.Tensor | None = None  # encoding: where each element of the batch sits in ``order``
        self.sizes_host = np.zeros((0, self.groups), dtype=np.int64)
        self.pending: list[np.ndarray] = []  # flat ranks of the batch's changes, offset by row * block

    def _exponents(self, words: torch.Tensor) -> torch.Tensor:
        return (words >> self.m) & ((1 << self.e) - 1)

    def _load(self, first: int) -> None:
        """Group keys, their order and the group sizes of the batch of blocks from ``first``."""
        self._flush()
        lo = first * self.block
        hi = min(self.words.numel(), lo + self.per_batch * self.block)
        rows = -(-(hi - lo) // self.block)
        self.first = first
        self.place = None
        if self.groups == 1:  # one group: every element's flat rank is its block position
            self.order = None
            self.sizes_host = np.full((rows, 1), self.block, dtype=np.int64)
            self.sizes_host[-1, 0] = hi - lo - (rows - 1) * self.block
            return
        # One key per element, row (block of the batch) major, group minor: a single stable sort then
        # orders each block's elements by group, and by position within a group.  Past the tensor's
        # end (the last block's tail) the key is the row's ``groups``: sorted last, never selected.
        span = rows * (self.groups + 1)
        kind = torch.uint8 if span < 255 else torch.int16
        device = self.words.device
        keys = torch.full((rows, self.block), self.groups, dtype=kind, device=device)
        flat = keys.view(-1)
        ex = self._exponents(self.words[lo:hi])
        flat[: hi - lo] = torch.bucketize(ex, self.thresholds.to(ex.dtype), right=True, out_int32=True)
        del ex
        keys += (torch.arange(rows, dtype=kind, device=device) * (self.groups + 1))[:, None]
        sorted_keys, self.order = torch.sort(flat, stable=True)
        del keys, flat
        starts = torch.searchsorted(sorted_keys, torch.arange(span + 1, dtype=kind, device=device))
        self.sizes_host = (starts[1:] - starts[:-1]).view(rows, self.groups + 1)[:, : self.groups].cpu().numpy()

    def _flush(self) -> None:
        """The positions of the batch's pending ranks, ascending, into ``out``."""
        if not self.pending:
            return
        flat = torch.from_numpy(np.concatenate(self.pending)).to(self.words.device)
        self.pending = []
        if self.order is not None:  # (the order holds each element's index in the batch)
            flat = self.order[flat]
        flat += self.first * self.block
        pos = torch.sort(flat).values  # blocks come in order; within one, the groups' members interleave
        self.out[self.done : self.done + pos.numel()] = pos
        self.done += pos.numel()

    def sizes(self, block: int) -> np.ndarray:
        if not 0 <= block - self.first < self.per_batch or self.first < 0:
            self._load(block)
        out: np.ndarray = self.sizes_host[block - self.first]
        return out

    def select(self, block: int, flat_ranks: np.ndarray) -> None:
        self.pending.append(flat_ranks + (block - self.first) * self.block)

    def changes(self, block: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row = block - self.first
        device = self.words.device
        at = torch.from_numpy(local + row * self.block).to(device)  # indices in the batch
        ex = self._exponents(self.words[at + self.first * self.block])
        group = torch.bucketize(ex, self.thresholds.to(ex.dtype), right=True)
        if self.order is None:
            return group.cpu().numpy(), local
        if self.place is None:
            self.place = torch.empty_like(self.order)
            self.place[self.order] = torch.arange(self.order.numel(), device=device)
        sizes = self.sizes_host[row]
        before = torch.from_numpy(np.cumsum(sizes) - sizes + row * self.block).to(device)
        rank = self.place[at] - before[group]  # flat rank in the block, less the earlier groups' members
        return group.cpu().numpy(), rank.cpu().numpy()

    def finish(self) -> torch.Tensor:
        self._flush()
        self.order = self.place = None
        return self.out

    def covers(self, thresholds: np.ndarray) -> bool:
        ex = self._exponents(self.words[self.out]).to(torch.int64)
        return bool(torch.isin(self.thresholds, ex).all())


def read_ctx_positions_torch(reader: StreamReader, spec: TensorSpec, k: int, words: torch.Tensor) -> torch.Tensor:
    """The ascending changed positions (int64, on ``words``' device) of a SPARSE_CTX record;
    ``words`` is the verified base's signed word view, where it lives."""
    m, e = exponent_field(spec)
    return decode_ctx(reader, spec, k, lambda th, block: TorchPass(words, m, e, th, k, block))


def ctx_fields_torch(spec: TensorSpec, words: torch.Tensor, pos: np.ndarray) -> list[Piece] | None:
    """:func:`protocol.context_coding.ctx_fields` (the encoder's thresholds) of a base whose signed
    word view ``words`` lives on any device: the same fields, the base read where it is (only its
    strided sample and the words of the changes cross to the host)."""
    step = sample_step(spec.numel)
    changed = words[torch.from_numpy(pos).to(words.device)]
    thresholds = context_coding.thresholds_of(spec, words[::step].cpu().numpy(), changed.cpu().numpy())
    if thresholds.size == 0:
        return None
    m, e = exponent_field(spec)
    return encode_ctx(spec, pos, thresholds, TorchPass(words, m, e, thresholds, 0, context_coding.CTX_BLOCK))

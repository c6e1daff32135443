"""The patch codec: ``encode_patch(base, target)`` and ``apply_patch(base, payload)``, bitwise exact.

Each tensor gets the smallest of its representations (see docs/format.md):
SAME (costs one header entry), SPARSE_ULP (floats: position gaps + ordered-line deltas),
SPARSE_CTX (payload format 2, where allowed: SPARSE_ULP with positions coded per magnitude range
of the base value, protocol/context_coding.py),
SPARSE_RAW (integers: position gaps + new raw words), XOR (dense: base ^ target byte planes)
or FULL (target byte planes; the only one an anchor, which has no base, uses).
Encoding and decoding go tensor by tensor, so extra memory is one tensor plus the patch (and,
when applying to CPU tensors, a bounded backlog of decoded changes, see ``APPLY_INFLIGHT``).

Sparse tensors (``k`` of ``n`` elements changed) write, in this order:

- bit stream ``bits``: the ``k`` gaps ``g`` between changed positions (``g = pos - prev - 1``,
  ``prev`` starting at -1) as Rice codes with the parameter ``r = rice_bits(n, k)``, which both
  sides derive from ``n`` and ``k``: first the ``k`` unary quotients ``g >> r`` (that many one
  bits, then a zero bit), then the ``k`` remainders ``g & (2**r - 1)`` in ``r`` bits each; for
  floats, then the ``k`` sign bits of the ordered-line deltas ``d = key(new) - key(old)`` (1: d < 0);
- floats: bit stream ``ulp.big``: ``k`` bits, 1 where ``|d| >= 2``; byte stream ``ulp.mag``: one
  byte ``min(|d| - 2, 255)`` per such change; byte planes ``ulpx.{w}.{p}``: the new raw words of
  the changes whose byte is 255 (escapes: ``|d| >= 257``, or a delta that does not fit an int64);
- integers: byte planes ``raw.{w}.{p}``: the ``k`` new raw words.

A Rice code with this parameter costs within about 1% of ``log2 C(n, k)`` bits when the changes
are spread at random, and the per-tensor parameter keeps tensors of very different change
densities from sharing one poorly fitting code.

Where the parts live: the container (prefix, header, records) in protocol/patch_format.py, the
position coding in protocol/position_coding.py, the value coding in protocol/value_coding.py;
here, the choice of encoding per tensor and the streaming of encode and apply.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch

from patchswarm.protocol.diffscan import Changes, scan
from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.patch_format import (
    EncodedPatch,
    Encoding,
    TensorStat,
    TensorUpdate,
    anchor_header,
    pack_payload,
    read_header,
)
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT, PAYLOAD_FORMATS
from patchswarm.protocol.position_coding import _read_positions
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view
from patchswarm.protocol.streams import Fields, Piece, StreamReader, StreamWriter, compressed_size
from patchswarm.protocol.value_coding import (
    APPLY_CHUNK,
    _apply_ulp_cpu,
    _dense_pieces,
    _full_size,
    _read_dense,
    _read_ulp,
    _sparse_pieces,
    _ulp_update,
    _UlpSteps,
    _write_full,
    to_host,
)

# Tensors with at least this fraction changed also try the dense encodings and keep the smallest.
DENSE_PROBE = 0.05


Progress = Callable[[int], None]  # called with the byte size of each tensor done


# ---------------------------------------------------------------- encoding
#
# Encoding is two steps, so that the expensive per-tensor part can run anywhere (another thread,
# another rank of a sharded trainer) and only its small result travels:
#
# - ``diff_tensor``: one tensor's record and stream pieces (scan, encoding choice): O(tensor);
# - ``assemble``: the pieces of every tensor, in layout order, into the shared compressed
#   streams and the payload: O(patch).
#
# ``encode_patch`` is exactly ``assemble(diff_tensor(...) for each tensor)``, streamed.


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """One tensor's share of a patch: its record and the stream pieces it writes, in write order.

    ``full`` (FULL records only) references the target's bytes instead of holding byte planes:
    they are cut into planes as they are compressed, so an anchor never holds a second copy.
    """

    spec: TensorSpec
    encoding: Encoding
    changed: int
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    full: torch.Tensor | None = None
    # A host copy of a device target made while choosing the encoding (else None): a caller that
    # needs the target's bytes on the host (its digest) reuses it instead of copying again.
    host: torch.Tensor | None = None

    @property
    def stat(self) -> TensorStat:
        return TensorStat(self.spec.name, self.encoding, self.changed, self.spec.numel)

    @property
    def nbytes(self) -> int:
        """Bytes this delta holds (its pieces; a referenced ``full`` tensor is not counted)."""
        total = 0
        for parts in self.pieces.values():
            for p in parts:
                total += p.values.nbytes if isinstance(p, Fields) else p.nbytes
        return total


def diff_tensor(
    spec: TensorSpec,
    base: torch.Tensor | None,
    target: torch.Tensor,
    level: int = 3,
    *,
    changes: Changes | None = None,
    payload_format: int = DEFAULT_FORMAT,
) -> TensorDelta:
    """One tensor's delta: ``target`` against ``base`` (flat uint8 tensors of ``spec``), or FULL without a base.

    ``payload_format`` 2 lets a float tensor's positions be coded under base contexts (SPARSE_CTX)
    where that is smaller; 1 keeps every record readable by format-1 readers.

    ``changes``, when given, must be what ``protocol.diffscan.scan`` returns for these two
    tensors' word views (a caller that scanned block by block, e.g. while the blocks were in
    cache, passes its result instead of scanning again).
    """
    for what, data in (("target", target), ("base", base)):
        if data is not None and (data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != spec.nbytes):
            raise ValueError(f"{spec.name}: {what} must be a flat uint8 tensor of {spec.nbytes} bytes")
    if base is None:
        return TensorDelta(spec, Encoding.FULL, spec.numel, {}, target)
    if spec.numel == 0:
        return TensorDelta(spec, Encoding.SAME, 0)
    ch = changes if changes is not None else scan(word_view(base, spec), word_view(target, spec))
    k = len(ch)
    if k == 0:
        return TensorDelta(spec, Encoding.SAME, 0)
    if payload_format not in PAYLOAD_FORMATS:
        raise ValueError(f"payload format {payload_format} is not one of {PAYLOAD_FORMATS}")
    enc, pieces = _sparse_pieces(spec, ch, base if payload_format >= 2 else None)
    if k < DENSE_PROBE * spec.numel:
        return TensorDelta(spec, enc, k, pieces)
    # Dense candidates.  A device target crosses to the host once: its FULL planes are sized from
    # that copy, which is also what a FULL record writes (the XOR crosses once, as the XOR).
    host = to_host(target)
    copy = host if host is not target else None
    options: list[tuple[Encoding, dict[str, list[Piece]] | None]] = [
        (enc, pieces),
        (Encoding.XOR, _dense_pieces("xor", spec, base, target)),
        (Encoding.FULL, None),
    ]
    best = min(
        options,
        key=lambda o: compressed_size(o[1], level) if o[1] is not None else _full_size(spec, host, level),
    )
    if best[1] is None:
        return TensorDelta(spec, Encoding.FULL, k, {}, host, copy)
    return TensorDelta(spec, best[0], k, best[1], host=copy)


def assemble(deltas: Iterable[TensorDelta], level: int = 3, *, progress: Progress | None = None) -> EncodedPatch:
    """The payload of the given deltas, one per tensor of the layout, in layout (name) order.

    Deltas are consumed one at a time (a generator keeps at most one in memory); ``level`` is
    the zstd level, which must be the one the deltas were chosen with for identical output.
    """
    writer = StreamWriter(level)
    records: list[list[int]] = []
    stats: list[TensorStat] = []
    last: str | None = None
    for d in deltas:
        if last is not None and d.spec.name <= last:
            raise ValueError(f"deltas must be in layout order with unique names: {d.spec.name!r} after {last!r}")
        last = d.spec.name
        if d.full is not None:
            _write_full(writer, d.spec, d.full)
        else:
            writer.emit(d.pieces)
        records.append([int(d.encoding), d.changed])
        stats.append(d.stat)
        if progress:
            progress(d.spec.nbytes)
    table, raw_size = writer.finish()
    return EncodedPatch(pack_payload(records, table, level), stats, raw_size)


def encode_patch(
    base: ServedModel | None,
    target: ServedModel,
    *,
    level: int = 3,
    progress: Progress | None = None,
    payload_format: int = DEFAULT_FORMAT,
) -> EncodedPatch:
    """Encode target against base (or, with no base, as a full anchor); see :func:`diff_tensor`
    for ``payload_format`` (the payload declares the lowest format that holds its records)."""
    if base is not None:
        base.same_layout(target)
    deltas = (
        diff_tensor(spec, base.data[i] if base is not None else None, tdata, level, payload_format=payload_format)
        for i, (spec, tdata) in enumerate(target)
    )
    return assemble(deltas, level, progress=progress)


# ---------------------------------------------------------------- decoding


def _decode(
    payload: bytes | memoryview, specs: list[TensorSpec], base: ServedModel | None, *, into: ServedModel | None = None
) -> Iterator[TensorUpdate | _UlpSteps]:
    """Decoded records in layout order.  With ``into`` (the model being patched, possibly ``base`` itself),
    dense records are decoded straight into its tensors, and their updates carry those very tensors."""
    header = read_header(payload, specs)
    reader = StreamReader(header.streams)
    for i, (spec, (enc, k)) in enumerate(zip(specs, header.records, strict=True)):
        if enc == Encoding.SAME:
            continue
        if base is None and enc != Encoding.FULL:
            raise FormatError(f"{spec.name}: patch needs a base version but none was given")
        device = base.data[i].device if base is not None else torch.device("cpu")
        if enc == Encoding.FULL:
            out = into.data[i] if into is not None else None
            yield TensorUpdate(i, enc, None, _read_dense(reader, "full", spec, None, device, out))
        elif enc == Encoding.XOR:
            assert base is not None
            out = into.data[i] if into is not None else None
            yield TensorUpdate(i, enc, None, _read_dense(reader, "xor", spec, base.data[i], device, out))
        elif enc == Encoding.SPARSE_RAW:
            pos = torch.from_numpy(_read_positions(reader, spec, k)).to(device)
            yield TensorUpdate(
                i, enc, pos, torch.from_numpy(reader.read_planes("raw", k, spec.dt.width).copy()).to(device)
            )
        elif enc == Encoding.SPARSE_CTX:
            assert base is not None
            yield _read_ulp(reader, spec, i, k, base.data[i])
        else:
            yield _read_ulp(reader, spec, i, k)
    reader.finish()


def iter_updates(
    payload: bytes | memoryview, specs: list[TensorSpec], base: ServedModel | None, *, into: ServedModel | None = None
) -> Iterator[TensorUpdate]:
    """Decode a payload tensor by tensor.  Reads base values (for ulp and xor) but writes nothing,
    except with ``into``: see :func:`_decode` (apply each update to ``into`` before the next is read)."""
    for u in _decode(payload, specs, base, into=into):
        if isinstance(u, _UlpSteps):
            assert base is not None
            yield _ulp_update(u, specs[u.index], base.data[u.index])
        else:
            yield u


# Most decoded changes waiting for the CPU appliers (about 20 bytes each).
APPLY_INFLIGHT = 1 << 23


@cache
def _apply_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="apply")


def apply_update(model: ServedModel, update: TensorUpdate) -> None:
    """Write one decoded update into ``model`` in place (touches only changed positions when sparse)."""
    spec = model.specs[update.index]
    if update.positions is None:
        if update.values is not model.data[update.index]:  # else decoded in place (``into``)
            model.data[update.index].copy_(update.values)
    else:
        word_view(model.data[update.index], spec)[update.positions] = update.values


def apply_patch(base: ServedModel | None, payload: bytes | memoryview, specs: list[TensorSpec]) -> ServedModel:
    """Apply in place to ``base`` (or build a new model from an anchor) and return it.

    Digests are the caller's business (see :mod:`protocol.patchfile`): check the base digest
    before, the target digest after; a failed check means the model must be discarded.
    """
    if base is not None and base.specs != specs:
        from patchswarm.protocol.errors import LayoutMismatchError

        raise LayoutMismatchError("patch layout differs from the base's layout")
    if base is None:
        anchor_header(payload, specs)  # before allocating what the (maybe unsigned) layout declares
    model = base if base is not None else ServedModel.zeros_like(specs)
    # Sparse float updates of CPU tensors go to a thread pool, in slices, while the next
    # tensors are decoded (at most APPLY_INFLIGHT changes ahead, which bounds the memory of
    # decoded records); every job is waited for before returning (or raising).
    jobs: collections.deque[tuple[Future[None], int]] = collections.deque()
    inflight = 0
    try:
        for u in _decode(payload, specs, base, into=model):
            if not isinstance(u, _UlpSteps):
                apply_update(model, u)
                continue
            spec, data = specs[u.index], model.data[u.index]
            if data.device.type != "cpu" or not isinstance(u.positions, np.ndarray):
                apply_update(model, _ulp_update(u, spec, data))
                continue
            words = word_view(data, spec).numpy()
            k = u.positions.size
            parts = max(1, min(_apply_pool()._max_workers, k // APPLY_CHUNK))
            bounds = [k * j // parts for j in range(parts + 1)]
            for lo, hi in itertools.pairwise(bounds):
                jobs.append((_apply_pool().submit(_apply_ulp_cpu, words, u, spec.dt.width, lo, hi), hi - lo))
                inflight += hi - lo
            while inflight > APPLY_INFLIGHT:
                job, n = jobs.popleft()
                job.result()
                inflight -= n
    finally:
        wait([job for job, _ in jobs])
    for job, _ in jobs:
        job.result()
    return model

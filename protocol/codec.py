"""The patch codec: ``encode_patch(base, target)`` and ``apply_patch(base, payload)``, bitwise exact.

Each tensor gets the smallest of four representations (see docs/format.md):
SAME (costs one header entry), SPARSE_ULP (floats: position gaps + ordered-line deltas),
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
"""

from __future__ import annotations

import collections
import itertools
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cache

import msgpack
import numpy as np
import torch
import zstandard

from patchswarm.protocol import ordered
from patchswarm.protocol.diffscan import Changes, scan
from patchswarm.protocol.docfields import read_prefix
from patchswarm.protocol.errors import FormatError, LimitExceededError, TruncatedError
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view
from patchswarm.protocol.streams import (
    MAX_EXPANSION,
    MAX_WINDOW,
    Fields,
    Piece,
    StreamReader,
    StreamWriter,
    check_frame,
    compressed_size,
    le_words,
    unary_bits,
)

PAYLOAD_MAGIC = b"PSWP"
PAYLOAD_FORMAT = 1
_PREFIX = struct.Struct("<4sB3xI")  # magic, format, reserved, compressed header length
MAG_ESCAPE = 255
# Tensors with at least this fraction changed also try the dense encodings and keep the smallest.
DENSE_PROBE = 0.05
# Dense encodings are written in slices of this many elements to bound temporary memory.
SLICE = 1 << 24


class Encoding(IntEnum):
    SAME = 0
    SPARSE_ULP = 1
    SPARSE_RAW = 2
    XOR = 3
    FULL = 4


@dataclass(frozen=True, slots=True)
class TensorStat:
    name: str
    encoding: Encoding
    changed: int
    numel: int


@dataclass(frozen=True, slots=True)
class EncodedPatch:
    payload: bytes
    tensors: list[TensorStat]
    raw_size: int  # bytes of all streams before compression

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


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
) -> TensorDelta:
    """One tensor's delta: ``target`` against ``base`` (flat uint8 tensors of ``spec``), or FULL without a base.

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
    enc, pieces = _sparse_pieces(spec, ch)
    if k < DENSE_PROBE * spec.numel:
        return TensorDelta(spec, enc, k, pieces)
    options: list[tuple[Encoding, dict[str, list[Piece]] | None]] = [
        (enc, pieces),
        (Encoding.XOR, _dense_pieces("xor", spec, base, target)),
        (Encoding.FULL, None),
    ]
    best = min(
        options,
        key=lambda o: compressed_size(o[1], level) if o[1] is not None else _full_size(spec, target, level),
    )
    if best[1] is None:
        return TensorDelta(spec, Encoding.FULL, k, {}, target)
    return TensorDelta(spec, best[0], k, best[1])


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
    header = msgpack.packb([records, [[name, raw, len(comp)] for name, raw, comp in table]])
    header_z = zstandard.ZstdCompressor(level=level).compress(header)
    parts = [_PREFIX.pack(PAYLOAD_MAGIC, PAYLOAD_FORMAT, len(header_z)), header_z]
    parts.extend(comp for _, _, comp in table)
    return EncodedPatch(b"".join(parts), stats, raw_size)


def encode_patch(
    base: ServedModel | None, target: ServedModel, *, level: int = 3, progress: Progress | None = None
) -> EncodedPatch:
    """Encode target against base (or, with no base, as a full anchor)."""
    if base is not None:
        base.same_layout(target)
    deltas = (
        diff_tensor(spec, base.data[i] if base is not None else None, tdata, level)
        for i, (spec, tdata) in enumerate(target)
    )
    return assemble(deltas, level, progress=progress)


def rice_bits(n: int, k: int) -> int:
    """Rice parameter of the position gaps of ``k`` changes among ``n`` elements (``1 <= k <= n``).

    The smallest ``r`` with ``2**r >= 0.4812 * (2n - k) / (2k)``: for geometric gaps of success
    rate ``p = k/n``, ``r`` beats ``r + 1`` once ``(1-p)**(2**r) <= (sqrt(5)-1)/2``, i.e.
    ``2**r >= ln(golden ratio) / -ln(1-p)``, with ``-ln(1-p) ~ 2p/(2-p)``.  Integers only, so
    encoder and decoder always agree.
    """
    t = -(-4812 * (2 * n - k) // (20000 * k))
    return (t - 1).bit_length() if t > 1 else 0


def _key_dtype(width: int) -> type[np.signedinteger]:
    # Keys of 1- and 2-byte floats plus any stored delta (|d| <= 256) fit an int32.
    return np.int32 if width <= 2 else np.int64


def _np_key(words: np.ndarray, width: int) -> np.ndarray:
    """numpy twin of :func:`protocol.ordered.ordered_key` (same integers, narrower dtype when it fits)."""
    key = words.astype(_key_dtype(width))
    flip = key >> (8 * width - 1)  # in place from here: one temporary
    flip &= (1 << (8 * width - 1)) - 1
    key ^= flip
    return key


def _np_from_key(key: np.ndarray, width: int, word: np.dtype[np.signedinteger]) -> np.ndarray:
    """numpy twin of :func:`protocol.ordered.from_ordered_key`: wraps exactly as the torch version does."""
    flip = key >> (8 * key.dtype.itemsize - 1)
    flip &= (1 << (8 * width - 1)) - 1
    flip ^= key
    return flip.astype(word)


def _planes(prefix: str, words: np.ndarray, into: dict[str, list[Piece]]) -> None:
    width = words.dtype.itemsize
    u8 = words.astype(le_words(width), copy=False).view(np.uint8).reshape(-1, width)
    for p in range(width):
        into.setdefault(f"{prefix}.{width}.{p}", []).append(np.ascontiguousarray(u8[:, p]))


def _np_delta(old: np.ndarray, new: np.ndarray, width: int) -> np.ndarray:
    """``key(new) - key(old)`` along the ordered line, as :func:`_np_key` gives them (the same integers)."""
    if width > 2:
        d: np.ndarray = _np_key(new, width).astype(np.int64) - _np_key(old, width)
        return d
    # Keys of 1- and 2-byte words fit the words' own type, and their difference an int32: fewer passes.
    sign_free = (1 << (8 * width - 1)) - 1
    kn = new >> (8 * width - 1)
    kn &= sign_free
    kn ^= new
    ko = old >> (8 * width - 1)
    ko &= sign_free
    ko ^= old
    d = kn.astype(np.int32)
    d -= ko
    return d


def _sparse_pieces(spec: TensorSpec, ch: Changes) -> tuple[Encoding, dict[str, list[Piece]]]:
    pieces: dict[str, list[Piece]] = {}
    pos = ch.positions.cpu().numpy()
    gaps = np.empty_like(pos)  # pos - prev - 1, prev starting at -1
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    r = rice_bits(spec.numel, len(pos))
    bits: list[Piece] = [Fields(unary_bits(gaps >> r), 1), Fields(gaps & ((1 << r) - 1), r)]
    width = spec.dt.width
    if not spec.dt.is_float:
        pieces["bits"] = bits
        _planes("raw", ch.new.cpu().numpy(), pieces)
        return Encoding.SPARSE_RAW, pieces
    if ch.new.device.type == "cpu":
        d = _np_delta(ch.old.numpy(), ch.new.numpy(), width)
    else:
        d = (ordered.ordered_key(ch.new, width) - ordered.ordered_key(ch.old, width)).cpu().numpy()
    bits.append(Fields((d < 0).view(np.uint8), 1))
    pieces["bits"] = bits
    mag = np.abs(d)  # stays negative for -2**63 (a 64-bit wrap-around): escaped below
    big = mag != 1
    pieces["ulp.big"] = [Fields(big.view(np.uint8), 1)]
    where_big = np.flatnonzero(big)
    if where_big.size:
        m = mag.take(where_big) - 2
        escaped = (m >= MAG_ESCAPE) | (m < 0)
        pieces["ulp.mag"] = [np.where(escaped, MAG_ESCAPE, m).astype(np.uint8)]
        if escaped.any():
            _planes("ulpx", ch.new.cpu().numpy().take(where_big[escaped]), pieces)
    return Encoding.SPARSE_ULP, pieces


def _dense_pieces(prefix: str, spec: TensorSpec, bdata: torch.Tensor, tdata: torch.Tensor) -> dict[str, list[Piece]]:
    pieces: dict[str, list[Piece]] = {}
    a, b = word_view(bdata, spec), word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        _planes(prefix, (a[s : s + SLICE] ^ b[s : s + SLICE]).cpu().numpy(), pieces)
    return pieces


def _full_size(spec: TensorSpec, tdata: torch.Tensor, level: int) -> int:
    pieces: dict[str, list[Piece]] = {}
    words = word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        _planes("full", words[s : s + SLICE].cpu().numpy(), pieces)
    return compressed_size(pieces, level)


def _write_full(writer: StreamWriter, spec: TensorSpec, tdata: torch.Tensor) -> Encoding:
    words = word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        writer.write_planes("full", words[s : s + SLICE].cpu().numpy())
    return Encoding.FULL


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class TensorUpdate:
    """What one tensor becomes: new words at positions (sparse), or all of its new bytes (dense)."""

    index: int
    encoding: Encoding
    positions: torch.Tensor | None  # int64, ascending; None for dense updates
    values: torch.Tensor  # words (sparse) or flat uint8 bytes of the whole tensor (dense)

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        return n + (self.positions.numel() * 8 if self.positions is not None else 0)


@dataclass(frozen=True, slots=True)
class PatchHeader:
    records: list[tuple[Encoding, int]]
    streams: list[tuple[str, int, memoryview]]


def raw_bound(spec: TensorSpec, enc: Encoding, k: int) -> int:
    """Most stream bytes one tensor record may legitimately consume (decompression bound)."""
    w = spec.dt.width
    if enc == Encoding.SAME:
        return 0
    if enc in (Encoding.XOR, Encoding.FULL):
        return spec.numel * w
    n = spec.numel
    r = rice_bits(n, k) if 0 < k <= n else 0
    # Rice codes: k terminators, quotients summing to at most (n-k) >> r, k*r remainder bits;
    # floats add k sign bits, k big bits and at most k magnitude bytes.  +1: a partial byte
    # carried over from the tensor before.
    bits = k + ((n - k) >> r) + k * r
    if enc == Encoding.SPARSE_ULP:
        return (bits + k + 7) // 8 + 1 + (k + 7) // 8 + 1 + k + k * w
    return (bits + 7) // 8 + 1 + k * w


def read_header(payload: bytes | memoryview, specs: list[TensorSpec]) -> PatchHeader:
    """Parse and bound-check a payload's header against the layout it is meant for."""
    mv = memoryview(payload)
    (hlen,) = read_prefix(_PREFIX, mv, PAYLOAD_MAGIC, PAYLOAD_FORMAT, "patch payload")
    if any(mv[5:8]):
        raise FormatError("patch payload reserved bytes are not zero")
    body = mv[_PREFIX.size :]
    if hlen > len(body):
        raise TruncatedError("patch payload ends inside its header")
    max_header = 1 << 16 | 32 * len(specs)
    check_frame("patch header", body[:hlen])
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        with dctx.stream_reader(body[:hlen]) as r:
            raw = r.read(max_header + 1)
        if len(raw) > max_header:
            raise LimitExceededError("patch header larger than its layout allows")
        records_raw, streams_raw = msgpack.unpackb(raw, use_list=True, strict_map_key=True)
    except (zstandard.ZstdError, ValueError, TypeError, msgpack.UnpackException) as e:
        raise FormatError(f"patch header is corrupt ({type(e).__name__})") from None
    if not isinstance(records_raw, list) or len(records_raw) != len(specs):
        raise FormatError("patch header does not list one record per tensor of the layout")
    records: list[tuple[Encoding, int]] = []
    bound = 0
    for spec, rec in zip(specs, records_raw, strict=True):
        if not (isinstance(rec, list) and len(rec) == 2 and all(type(x) is int for x in rec)):
            raise FormatError(f"{spec.name}: malformed patch record")
        enc_i, k = rec
        try:
            enc = Encoding(enc_i)
        except ValueError:
            raise FormatError(f"{spec.name}: unknown encoding {enc_i}") from None
        if not 0 <= k <= spec.numel or ((enc == Encoding.SAME) != (k == 0) and enc != Encoding.FULL):
            raise FormatError(f"{spec.name}: change count {k} impossible for {spec.numel} elements")
        if enc == Encoding.SPARSE_ULP and not spec.dt.is_float:
            raise FormatError(f"{spec.name}: ulp coding used on non-float dtype {spec.dtype}")
        records.append((enc, k))
        bound += raw_bound(spec, enc, k)
    if not isinstance(streams_raw, list):
        raise FormatError("patch stream table is malformed")
    streams: list[tuple[str, int, memoryview]] = []
    offset = hlen
    total_raw = 0
    for entry in streams_raw:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and type(entry[1]) is int
            and type(entry[2]) is int
            and entry[1] >= 0
            and entry[2] >= 0
        ):
            raise FormatError("patch stream table entry is malformed")
        name, raw_len, comp_len = entry
        if offset + comp_len > len(body):
            raise TruncatedError(f"stream {name!r} runs past the end of the patch")
        streams.append((name, raw_len, body[offset : offset + comp_len]))
        offset += comp_len
        total_raw += raw_len
    if offset != len(body):
        raise FormatError(f"{len(body) - offset} unexpected bytes after the last stream")
    if total_raw > bound:
        raise LimitExceededError(f"patch declares {total_raw} stream bytes; its records allow at most {bound}")
    for name, raw_len, comp in streams:
        if raw_len > MAX_EXPANSION * len(comp):
            raise LimitExceededError(f"stream {name!r} declares {raw_len} bytes; {len(comp)} zstd bytes hold fewer")
    _check_dense_streams(specs, records, streams)
    return PatchHeader(records, streams)


def _check_dense_streams(
    specs: list[TensorSpec], records: list[tuple[Encoding, int]], streams: list[tuple[str, int, memoryview]]
) -> None:
    """Dense records (FULL, XOR) read every word of their tensor: the byte planes they read must
    declare exactly that many bytes (what ``StreamReader.finish`` would find at the end, known now)."""
    need: dict[tuple[str, int], int] = {}
    for spec, (enc, _) in zip(specs, records, strict=True):
        if enc in (Encoding.FULL, Encoding.XOR):
            key = ("full" if enc == Encoding.FULL else "xor", spec.dt.width)
            need[key] = need.get(key, 0) + spec.numel
    declared = {name: raw_len for name, raw_len, _ in streams}
    for (prefix, width), n in need.items():
        for p in range(width):
            name = f"{prefix}.{width}.{p}"
            got = declared.get(name)
            if got is None and n:
                raise FormatError(f"patch needs stream {name!r}, which it does not contain")
            if got is not None and got != n:
                raise FormatError(f"stream {name!r} declares {got} bytes; its records read exactly {n}")


def anchor_header(payload: bytes | memoryview, specs: list[TensorSpec]) -> PatchHeader:
    """The header of an anchor's payload, checked before the model it builds is allocated.

    Every record must be FULL (docs/format.md section 2): then the model's size is exactly what
    the payload's ``full`` streams declare, at most MAX_EXPANSION times the payload's length, so
    a forged manifest cannot make a reader allocate more than its payload can fill.
    """
    header = read_header(payload, specs)
    for spec, (enc, _) in zip(specs, header.records, strict=True):
        if enc != Encoding.FULL:
            raise FormatError(f"{spec.name}: a {enc.name} record needs a base version (an anchor's are all FULL)")
    return header


@dataclass(frozen=True, slots=True)
class _UlpSteps:
    """A decoded SPARSE_ULP record, before the base is read: where, and how many steps."""

    index: int
    positions: np.ndarray  # int64, ascending
    steps: np.ndarray  # signed steps along the ordered line (int32 for widths <= 2, else int64)
    escaped: np.ndarray  # indices into positions whose new words are stored raw, ascending
    escaped_words: np.ndarray  # those new words


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


def _read_dense(
    reader: StreamReader,
    prefix: str,
    spec: TensorSpec,
    bdata: torch.Tensor | None,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # Element s of the output depends only on element s of the base: ``out`` may be ``bdata`` itself.
    if out is None:
        out = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    words = word_view(out, spec)
    base = word_view(bdata, spec) if bdata is not None else None
    w = spec.dt.width
    for s in range(0, spec.numel, SLICE):
        n = min(SLICE, spec.numel - s)
        planes = reader.read_planes(prefix, n, w)
        if device.type == "cpu":
            # One pass from the decoded bytes straight into the output (read-only planes need no copy).
            dst = words[s : s + n].numpy()
            if base is None:
                np.copyto(dst, planes)
            else:
                np.bitwise_xor(planes, base[s : s + n].numpy(), out=dst)
            continue
        part = torch.from_numpy(planes.copy()).to(device)
        if base is not None:
            part ^= base[s : s + n]
        words[s : s + n] = part
    return out


def _read_positions(reader: StreamReader, spec: TensorSpec, k: int) -> np.ndarray:
    n = spec.numel
    if not 0 < k <= n:
        raise FormatError(f"{spec.name}: change count {k} impossible for {n} elements")
    r = rice_bits(n, k)
    q = reader.read_unary("bits", k)
    # Legitimate quotients sum to at most (n-k) >> r: checked before shifting, so nothing overflows.
    if int(q.sum()) > (n - k) >> r:
        raise FormatError(f"{spec.name}: change positions fall outside the tensor")
    pos = q  # in place, one pass each: pos = cumsum(gaps + 1) - 1, gaps = q << r | remainder >= 0
    pos <<= r
    pos |= reader.read_fields("bits", k, r)
    pos += 1
    np.cumsum(pos, out=pos)
    pos -= 1  # strictly ascending
    if pos[-1] >= n:
        raise FormatError(f"{spec.name}: change positions fall outside the tensor")
    return pos


def _read_ulp(reader: StreamReader, spec: TensorSpec, index: int, k: int) -> _UlpSteps:
    pos = _read_positions(reader, spec, k)
    w = spec.dt.width
    negative = reader.read_bits("bits", k)
    big = reader.read_bits("ulp.big", k)
    steps = big.astype(_key_dtype(w)) + 1
    escaped = np.empty(0, dtype=np.int64)
    nbig = int(np.count_nonzero(big))
    if nbig:
        where_big = np.flatnonzero(big)
        mag = np.frombuffer(reader.read("ulp.mag", nbig), dtype=np.uint8)
        steps[where_big] = mag.astype(steps.dtype) + 2
        escaped = where_big[mag == MAG_ESCAPE]
    steps *= 1 - 2 * negative.astype(steps.dtype)
    escaped_words = reader.read_planes("ulpx", escaped.size, w) if escaped.size else np.empty(0, le_words(w))
    return _UlpSteps(index, pos, steps, escaped, escaped_words)


def _ulp_update(u: _UlpSteps, spec: TensorSpec, bdata: torch.Tensor) -> TensorUpdate:
    """The new words of a SPARSE_ULP record, computed with torch on the base's device."""
    w = spec.dt.width
    device = bdata.device
    pos = torch.from_numpy(u.positions).to(device)
    old = word_view(bdata, spec)[pos]
    new = ordered.from_ordered_key(
        ordered.ordered_key(old, w) + torch.from_numpy(u.steps).to(device), w, spec.dt.word_dtype
    )
    if u.escaped.size:
        new[torch.from_numpy(u.escaped).to(device)] = torch.from_numpy(u.escaped_words.copy()).to(device)
    return TensorUpdate(u.index, Encoding.SPARSE_ULP, pos, new)


# Changes applied per step of the CPU path: the cache lines read stay cached until written back.
APPLY_CHUNK = 1 << 15
# Most decoded changes waiting for the CPU appliers (about 20 bytes each).
APPLY_INFLIGHT = 1 << 23


@cache
def _apply_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="apply")


def _apply_ulp_cpu(words: np.ndarray, u: _UlpSteps, width: int, lo: int, hi: int) -> None:
    """Apply changes ``lo:hi`` of a SPARSE_ULP record to the CPU words in place (numpy, GIL released)."""
    esc_lo, esc_hi = np.searchsorted(u.escaped, [lo, hi])
    for s in range(lo, hi, APPLY_CHUNK):
        e = min(s + APPLY_CHUNK, hi)
        pos = u.positions[s:e]
        key = _np_key(words[pos], width)
        key += u.steps[s:e]
        new = _np_from_key(key, width, words.dtype)
        if esc_lo < esc_hi:
            a, b = np.searchsorted(u.escaped[esc_lo:esc_hi], [s, e]) + esc_lo
            new[u.escaped[a:b] - s] = u.escaped_words[a:b]
        words[pos] = new


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
            if data.device.type != "cpu":
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

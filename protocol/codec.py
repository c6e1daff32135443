"""The patch codec: ``encode_patch(base, target)`` and ``apply_patch(base, payload)``, bitwise exact.

Each tensor gets the smallest of four representations (see docs/format.md):
SAME (costs one header entry), SPARSE_ULP (floats: position gaps + ordered-line deltas),
SPARSE_RAW (integers: position gaps + new raw words), XOR (dense: base ^ target byte planes)
or FULL (target byte planes; the only one an anchor, which has no base, uses).
Encoding and decoding go tensor by tensor, so extra memory is one tensor plus the patch.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

import msgpack
import numpy as np
import torch
import zstandard

from protocol import ordered
from protocol.diffscan import Changes, scan
from protocol.errors import FormatError, LimitExceededError, TruncatedError, UnsupportedFormatError
from protocol.served import ServedModel, TensorSpec, word_view
from protocol.streams import (
    MAX_WINDOW,
    StreamReader,
    StreamWriter,
    check_frame,
    compressed_size,
    le_words,
)

PAYLOAD_MAGIC = b"PSWP"
PAYLOAD_FORMAT = 1
_PREFIX = struct.Struct("<4sB3xI")  # magic, format, reserved, compressed header length
GAP_ESCAPE = 0xFFFF
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


def encode_patch(
    base: ServedModel | None, target: ServedModel, *, level: int = 3, progress: Progress | None = None
) -> EncodedPatch:
    """Encode target against base (or, with no base, as a full anchor)."""
    if base is not None:
        base.same_layout(target)
    writer = StreamWriter(level)
    records: list[list[int]] = []
    stats: list[TensorStat] = []
    for i, (spec, tdata) in enumerate(target):
        if base is None:
            enc, k = _write_full(writer, spec, tdata), spec.numel
        else:
            enc, k = _encode_tensor(writer, spec, base.data[i], tdata, level)
        records.append([int(enc), k])
        stats.append(TensorStat(spec.name, enc, k, spec.numel))
        if progress:
            progress(spec.nbytes)
    table, raw_size = writer.finish()
    header = msgpack.packb([records, [[name, raw, len(comp)] for name, raw, comp in table]])
    header_z = zstandard.ZstdCompressor(level=level).compress(header)
    parts = [_PREFIX.pack(PAYLOAD_MAGIC, PAYLOAD_FORMAT, len(header_z)), header_z]
    parts.extend(comp for _, _, comp in table)
    return EncodedPatch(b"".join(parts), stats, raw_size)


def _encode_tensor(
    writer: StreamWriter, spec: TensorSpec, bdata: torch.Tensor, tdata: torch.Tensor, level: int
) -> tuple[Encoding, int]:
    if spec.numel == 0:
        return Encoding.SAME, 0
    ch = scan(word_view(bdata, spec), word_view(tdata, spec))
    k = len(ch)
    if k == 0:
        return Encoding.SAME, 0
    sparse = _sparse_pieces(spec, ch)
    if k < DENSE_PROBE * spec.numel:
        _emit(writer, sparse[1])
        return sparse[0], k
    options = [sparse, (Encoding.XOR, _dense_pieces("xor", spec, bdata, tdata)), (Encoding.FULL, None)]
    best = min(
        options,
        key=lambda o: compressed_size(o[1], level) if o[1] is not None else _full_size(spec, tdata, level),
    )
    if best[1] is None:
        _write_full(writer, spec, tdata)
    else:
        _emit(writer, best[1])
    return best[0], k


def _emit(writer: StreamWriter, pieces: dict[str, list[np.ndarray]]) -> None:
    for name, parts in pieces.items():
        for p in parts:
            writer.write(name, p)


def _planes(prefix: str, words: np.ndarray, into: dict[str, list[np.ndarray]]) -> None:
    width = words.dtype.itemsize
    u8 = words.astype(le_words(width), copy=False).view(np.uint8).reshape(-1, width)
    for p in range(width):
        into.setdefault(f"{prefix}.{width}.{p}", []).append(np.ascontiguousarray(u8[:, p]))


def _sparse_pieces(spec: TensorSpec, ch: Changes) -> tuple[Encoding, dict[str, list[np.ndarray]]]:
    pieces: dict[str, list[np.ndarray]] = {}
    pos = ch.positions.cpu().numpy()
    gaps = np.diff(pos, prepend=-1) - 1
    big = gaps >= GAP_ESCAPE
    _planes("gap", np.minimum(gaps, GAP_ESCAPE).astype(np.uint16).view(np.int16), pieces)
    if big.any():
        _planes("gapx", gaps[big].astype(np.int64), pieces)
    width = spec.dt.width
    if spec.dt.is_float:
        codes, escaped = ordered.ulp_codes(ch.old, ch.new, width)
        pieces["ulp"] = [codes.cpu().numpy()]
        if bool(escaped.any()):
            _planes("ulpx", ch.new[escaped].cpu().numpy(), pieces)
        return Encoding.SPARSE_ULP, pieces
    _planes("raw", ch.new.cpu().numpy(), pieces)
    return Encoding.SPARSE_RAW, pieces


def _dense_pieces(
    prefix: str, spec: TensorSpec, bdata: torch.Tensor, tdata: torch.Tensor
) -> dict[str, list[np.ndarray]]:
    pieces: dict[str, list[np.ndarray]] = {}
    a, b = word_view(bdata, spec), word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        _planes(prefix, (a[s : s + SLICE] ^ b[s : s + SLICE]).cpu().numpy(), pieces)
    return pieces


def _full_size(spec: TensorSpec, tdata: torch.Tensor, level: int) -> int:
    pieces: dict[str, list[np.ndarray]] = {}
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
    return k * (2 + 8 + 1 + w)


def read_header(payload: bytes | memoryview, specs: list[TensorSpec]) -> PatchHeader:
    """Parse and bound-check a payload's header against the layout it is meant for."""
    mv = memoryview(payload)
    if len(mv) < _PREFIX.size:
        raise TruncatedError("patch payload shorter than its fixed header")
    magic, fmt, hlen = _PREFIX.unpack_from(mv)
    if magic != PAYLOAD_MAGIC:
        raise FormatError("not a patchswarm patch payload (bad magic)")
    if fmt != PAYLOAD_FORMAT:
        raise UnsupportedFormatError(f"patch payload format {fmt} (this build reads {PAYLOAD_FORMAT})")
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
    return PatchHeader(records, streams)


def iter_updates(
    payload: bytes | memoryview, specs: list[TensorSpec], base: ServedModel | None
) -> Iterator[TensorUpdate]:
    """Decode a payload tensor by tensor.  Reads base values (for ulp and xor) but writes nothing."""
    header = read_header(payload, specs)
    reader = StreamReader(header.streams)
    for i, (spec, (enc, k)) in enumerate(zip(specs, header.records, strict=True)):
        if enc == Encoding.SAME:
            continue
        if base is None and enc != Encoding.FULL:
            raise FormatError(f"{spec.name}: patch needs a base version but none was given")
        device = base.data[i].device if base is not None else torch.device("cpu")
        if enc == Encoding.FULL:
            yield TensorUpdate(i, enc, None, _read_dense(reader, "full", spec, None, device))
        elif enc == Encoding.XOR:
            assert base is not None
            yield TensorUpdate(i, enc, None, _read_dense(reader, "xor", spec, base.data[i], device))
        else:
            assert base is not None
            pos, values = _read_sparse(reader, spec, enc, k, base.data[i])
            yield TensorUpdate(i, enc, pos, values)
    reader.finish()


def _read_dense(
    reader: StreamReader, prefix: str, spec: TensorSpec, bdata: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    out = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    words = word_view(out, spec)
    w = spec.dt.width
    for s in range(0, spec.numel, SLICE):
        n = min(SLICE, spec.numel - s)
        part = torch.from_numpy(reader.read_planes(prefix, n, w).copy()).to(device)
        if bdata is not None:
            part ^= word_view(bdata, spec)[s : s + n]
        words[s : s + n] = part
    return out


def _read_sparse(
    reader: StreamReader, spec: TensorSpec, enc: Encoding, k: int, bdata: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    w = spec.dt.width
    gaps = reader.read_planes("gap", k, 2).view(np.uint16).astype(np.int64)
    big = gaps == GAP_ESCAPE
    nbig = int(big.sum())
    if nbig:
        gx = reader.read_planes("gapx", nbig, 8)
        if (gx < GAP_ESCAPE).any():
            raise FormatError(f"{spec.name}: escaped gap below the escape threshold")
        gaps[big] = gx
    pos_np = np.cumsum(gaps + 1) - 1
    # Strictly ascending, compared (not subtracted): also catches escaped gaps summing past 2**63.
    if k and (pos_np[-1] >= spec.numel or (gaps < 0).any() or (pos_np[1:] <= pos_np[:-1]).any()):
        raise FormatError(f"{spec.name}: change positions fall outside the tensor")
    device = bdata.device
    pos = torch.from_numpy(pos_np).to(device)
    if enc == Encoding.SPARSE_RAW:
        return pos, torch.from_numpy(reader.read_planes("raw", k, w).copy()).to(device)
    codes_np = np.frombuffer(reader.read("ulp", k), dtype=np.uint8)
    escaped_np = codes_np == ordered.ESCAPE
    old = word_view(bdata, spec)[pos]
    codes = torch.from_numpy(codes_np.copy()).to(device)
    new = ordered.apply_ulp_codes(old, codes, w, spec.dt.word_dtype)
    nesc = int(escaped_np.sum())
    if nesc:
        esc = torch.from_numpy(reader.read_planes("ulpx", nesc, w).copy()).to(device)
        new[torch.from_numpy(escaped_np).to(device)] = esc
    return pos, new


def apply_update(model: ServedModel, update: TensorUpdate) -> None:
    """Write one decoded update into ``model`` in place (touches only changed positions when sparse)."""
    spec = model.specs[update.index]
    if update.positions is None:
        model.data[update.index].copy_(update.values)
    else:
        word_view(model.data[update.index], spec)[update.positions] = update.values


def apply_patch(base: ServedModel | None, payload: bytes | memoryview, specs: list[TensorSpec]) -> ServedModel:
    """Apply in place to ``base`` (or build a new model from an anchor) and return it.

    Digests are the caller's business (see :mod:`protocol.patchfile`): check the base digest
    before, the target digest after; a failed check means the model must be discarded.
    """
    if base is not None and base.specs != specs:
        from protocol.errors import LayoutMismatchError

        raise LayoutMismatchError("patch layout differs from the base's layout")
    model = base if base is not None else ServedModel.zeros_like(specs)
    for update in iter_updates(payload, specs, base):
        apply_update(model, update)
    return model

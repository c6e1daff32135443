"""A patch payload's container (docs/format.md): a prefix (magic, format, header length), a
zstd-compressed msgpack header listing one record (encoding, change count) per tensor of the
layout and the stream table, then the compressed streams.  Reading checks every declared size
against the layout before anything is decompressed or allocated.  Also what a record is, encoded
(``TensorStat``) and decoded (``TensorUpdate``)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import msgpack
import torch
import zstandard

from patchswarm.protocol.context_coding import MANTISSA, ctx_bound_bits, exponent_field
from patchswarm.protocol.docfields import read_prefix
from patchswarm.protocol.errors import FormatError, LimitExceededError, TruncatedError
from patchswarm.protocol.payload_formats import PAYLOAD_FORMATS
from patchswarm.protocol.position_coding import rice_bits
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import MAX_EXPANSION, MAX_WINDOW, check_frame

PAYLOAD_MAGIC = b"PSWP"
_PREFIX = struct.Struct("<4sB3xI")  # magic, format, reserved, compressed header length


class Encoding(IntEnum):
    SAME = 0
    SPARSE_ULP = 1
    SPARSE_RAW = 2
    XOR = 3
    FULL = 4
    SPARSE_CTX = 5  # format 2: floats, positions under base-value contexts (protocol/context_coding.py)


# The lowest payload format that can hold each encoding: a payload declares the lowest that holds all of
# its records, so a patch that uses no format-2 encoding stays readable by format-1 readers.
MIN_FORMAT = {Encoding.SPARSE_CTX: 2}


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
    format: int = 1  # the payload format it declares (the lowest that holds its records)


def pack_payload(records: list[list[int]], table: list[tuple[str, int, bytes]], level: int) -> bytes:
    """The payload of the given records and compressed streams (``StreamWriter.finish``'s table)."""
    header = msgpack.packb([records, [[name, raw, len(comp)] for name, raw, comp in table]])
    header_z = zstandard.ZstdCompressor(level=level).compress(header)
    fmt = max([1, *(MIN_FORMAT.get(Encoding(enc), 1) for enc, _ in records)])
    parts = [_PREFIX.pack(PAYLOAD_MAGIC, fmt, len(header_z)), header_z]
    parts.extend(comp for _, _, comp in table)
    return b"".join(parts)


def raw_bound(spec: TensorSpec, enc: Encoding, k: int) -> int:
    """Most stream bytes one tensor record may legitimately consume (decompression bound)."""
    w = spec.dt.width
    if enc == Encoding.SAME:
        return 0
    if enc in (Encoding.XOR, Encoding.FULL):
        return spec.numel * w
    n = spec.numel
    if enc == Encoding.SPARSE_CTX:
        # positions, k sign bits, then what SPARSE_ULP adds: k big bits, k magnitude bytes, k escapes
        bits = ctx_bound_bits(n, k, exponent_field(spec)[1]) + k
        return (bits + 7) // 8 + 1 + (k + 7) // 8 + 1 + k + k * w
    r = rice_bits(n, k) if 0 < k <= n else 0
    # Rice codes: k terminators, quotients summing to at most (n-k) >> r, k*r remainder bits;
    # floats add k sign bits, k big bits and at most k magnitude bytes.  +1: a partial byte
    # carried over from the tensor before.
    bits = k + ((n - k) >> r) + k * r
    if enc == Encoding.SPARSE_ULP:
        return (bits + k + 7) // 8 + 1 + (k + 7) // 8 + 1 + k + k * w
    return (bits + 7) // 8 + 1 + k * w


def declared_format(payload: bytes | memoryview) -> int:
    """The payload format a payload's prefix declares (magic and format checked; nothing else read)."""
    read_prefix(_PREFIX, memoryview(payload), PAYLOAD_MAGIC, PAYLOAD_FORMATS, "patch payload")
    return payload[4]


def read_header(payload: bytes | memoryview, specs: list[TensorSpec]) -> PatchHeader:
    """Parse and bound-check a payload's header against the layout it is meant for."""
    mv = memoryview(payload)
    (hlen,) = read_prefix(_PREFIX, mv, PAYLOAD_MAGIC, PAYLOAD_FORMATS, "patch payload")
    fmt = mv[4]
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
        if MIN_FORMAT.get(enc, 1) > fmt:
            raise FormatError(
                f"{spec.name}: encoding {enc.name} needs payload format {MIN_FORMAT[enc]} (this is {fmt})"
            )
        if not 0 <= k <= spec.numel or ((enc == Encoding.SAME) != (k == 0) and enc != Encoding.FULL):
            raise FormatError(f"{spec.name}: change count {k} impossible for {spec.numel} elements")
        if enc == Encoding.SPARSE_ULP and not spec.dt.is_float:
            raise FormatError(f"{spec.name}: ulp coding used on non-float dtype {spec.dtype}")
        if enc == Encoding.SPARSE_CTX and spec.dtype not in MANTISSA:
            raise FormatError(f"{spec.name}: context coding used on dtype {spec.dtype}")
        records.append((enc, k))
        bound += raw_bound(spec, enc, k)
    if fmt != max([1, *(MIN_FORMAT.get(enc, 1) for enc, _ in records)]):
        # One spelling per payload: the lowest format that holds its records (pack_payload).
        raise FormatError(f"patch payload format {fmt} holds no record that needs it")
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
    return PatchHeader(records, streams, fmt)


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

"""Named, zstd-compressed byte streams shared by every tensor of a patch.

Tensors append their pieces to a few streams (gaps, value codes, byte planes of raw words)
instead of being compressed one by one: small tensors then cost no frame overhead, and
each stream holds statistically alike bytes, which is what zstd's entropy stage wants.
Multi-byte words are split into byte planes (plane p holds byte p of every word, little
endian) because the high bytes of neighbouring weights are far more alike than whole words.

Some streams are bit streams: fields of any bit width, packed least significant bit first
into bytes (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``), continuing across
tensors without padding; only the very end of a bit stream is padded with zero bits to a
whole byte.  Prefix codes written this way (Rice codes, raw sign bits) reach their entropy
exactly, where zstd's Huffman stage cannot go below one bit per byte symbol and its match
finder wastes bits on low-entropy bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from patchswarm.protocol.errors import FormatError, LimitExceededError, TruncatedError

# Decoders refuse frames that ask for a larger window: bounds memory per stream.
MAX_WINDOW = 1 << 23
# The most bytes a zstd frame can decompress to per byte of it: a block decodes to at most 128 KiB
# and takes at least 4 bytes (an RLE block).  A stream (or a payload) declaring more is a lie.
MAX_EXPANSION = 1 << 15
_LE_INT = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}
# Widest fixed-width bit field: a field shifted by up to 7 bits must fit 64 bits.
MAX_FIELD_BITS = 57


def le_words(width: int) -> np.dtype[np.signedinteger]:
    return np.dtype(_LE_INT[width])


_NO_BITS = np.empty(0, dtype=np.uint8)

# ---------------------------------------------------------------- bit fields


@dataclass(frozen=True, slots=True)
class Fields:
    """A piece of a bit stream: the low ``width`` bits of each (non-negative) value."""

    values: np.ndarray
    width: int


Piece = np.ndarray | Fields


def unary_bits(q: np.ndarray) -> np.ndarray:
    """Unary codes of non-negative integers: ``q`` one bits, then a zero bit, for each (0/1 uint8)."""
    if q.size == 0:
        return np.empty(0, dtype=np.uint8)
    ends = np.add(q, 1, dtype=np.int64)  # where each code's zero goes, +1 (summed in place)
    np.cumsum(ends, out=ends)
    bits = np.ones(int(ends[-1]), dtype=np.uint8)
    ends -= 1
    bits[ends] = 0
    return bits


def _window_dtype(width: int) -> type[np.unsignedinteger]:
    return np.uint32 if width + 7 <= 32 else np.uint64


def pack_fields(values: np.ndarray, width: int, lead: int = 0) -> np.ndarray:
    """Bytes holding ``lead`` (< 8) zero bits, then the low ``width`` bits of each value, LSB first.

    The last byte is partial (zero-padded) unless ``lead + count * width`` is a multiple of 8.
    Values are packed in groups of 8, which span exactly ``width`` bytes (plus one shared with the
    next group when ``lead`` is not zero): column operations only, no per-bit arrays.
    """
    count = values.size
    nbytes = (lead + count * width + 7) >> 3
    if count == 0 or width == 0:
        return np.zeros(nbytes, dtype=np.uint8)
    if not 0 < width <= MAX_FIELD_BITS:
        raise ValueError(f"bit field width {width} out of range")
    wd = _window_dtype(width)
    groups = -(-count // 8)
    v = np.zeros(groups * 8, dtype=wd)
    v[:count] = values
    v &= wd((1 << width) - 1)
    v = v.reshape(groups, 8)
    rows = np.zeros((groups, width + 1), dtype=np.uint8)
    for j in range(8):
        o = lead + j * width
        b, sh = o >> 3, o & 7
        x = v[:, j] << wd(sh)
        for t in range((sh + width + 7) >> 3):
            rows[:, b + t] |= (x >> wd(8 * t)).astype(np.uint8)
    out = np.zeros(groups * width + 1, dtype=np.uint8)
    out[: groups * width] = rows[:, :width].reshape(-1)
    out[width::width] |= rows[:, width]
    return out[:nbytes]


def unpack_fields(buf: np.ndarray, start: int, count: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack_fields`: ``count`` fields of ``width`` bits from bit ``start`` of ``buf``."""
    if count == 0 or width == 0:
        return np.zeros(count, dtype=np.int64)
    if not 0 < width <= MAX_FIELD_BITS:
        raise ValueError(f"bit field width {width} out of range")
    wd = _window_dtype(width)
    groups = -(-count // 8)
    first, lead = start >> 3, start & 7
    need = first + groups * width + 1
    if buf.size < need:
        buf = np.concatenate([buf, np.zeros(need - buf.size, dtype=np.uint8)])
    rows = np.lib.stride_tricks.as_strided(
        buf[first:], shape=(groups, width + 1), strides=(width * buf.strides[0], buf.strides[0]), writeable=False
    )
    out = np.empty((groups, 8), dtype=np.int64)
    mask = wd((1 << width) - 1)
    for j in range(8):
        o = lead + j * width
        b, sh = o >> 3, o & 7
        win = rows[:, b].astype(wd)
        for t in range(1, (sh + width + 7) >> 3):
            win |= rows[:, b + t].astype(wd) << wd(8 * t)
        out[:, j] = (win >> wd(sh)) & mask
    return out.reshape(-1)[:count]


class _BitPacker:
    """Turns bits and bit fields into whole bytes, keeping the bits of a last partial byte."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = _NO_BITS  # fewer than 8 bits (uint8 0/1)

    def bits(self, bits: np.ndarray) -> np.ndarray:
        if self.pending.size:
            bits = np.concatenate([self.pending, bits])
        whole = bits.size & ~7
        self.pending = bits[whole:].astype(np.uint8)
        return np.packbits(bits[:whole], bitorder="little")

    def fields(self, values: np.ndarray, width: int) -> np.ndarray:
        if width == 1:
            return self.bits(values.astype(np.uint8, copy=False))
        lead = self.pending.size
        packed = pack_fields(values, width, lead)
        if lead:
            packed[0] |= np.packbits(self.pending, bitorder="little")[0]
        total = lead + values.size * width
        whole, rest = total >> 3, total & 7
        self.pending = np.unpackbits(packed[whole:], bitorder="little")[:rest] if rest else _NO_BITS
        return packed[:whole]

    def flush(self) -> np.ndarray:
        out = np.packbits(self.pending, bitorder="little")
        self.pending = _NO_BITS
        return out


class StreamWriter:
    """Accumulates compressed streams; names appear in the table in first-write order."""

    def __init__(self, level: int = 3) -> None:
        self._level = level
        self._objs: dict[str, zstandard.ZstdCompressionObj] = {}
        self._out: dict[str, list[bytes]] = {}
        self._raw: dict[str, int] = {}
        self._bits: dict[str, _BitPacker] = {}

    def write(self, name: str, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        buf = np.ascontiguousarray(data).data.cast("B") if isinstance(data, np.ndarray) else data
        if len(buf) == 0:
            return
        if name not in self._objs:
            # One compressor per stream: compressobjs of one ZstdCompressor share its context.
            self._objs[name] = zstandard.ZstdCompressor(level=self._level).compressobj()
            self._out[name] = []
            self._raw[name] = 0
        self._out[name].append(self._objs[name].compress(buf))
        self._raw[name] += len(buf)

    def write_planes(self, prefix: str, words: np.ndarray) -> None:
        """Write each byte plane of ``words`` to stream ``{prefix}.{width}.{plane}``."""
        width = words.dtype.itemsize
        u8 = words.astype(le_words(width), copy=False).view(np.uint8).reshape(-1, width)
        for p in range(width):
            self.write(f"{prefix}.{width}.{p}", np.ascontiguousarray(u8[:, p]))

    def _packer(self, name: str) -> _BitPacker:
        packer = self._bits.get(name)
        if packer is None:
            packer = self._bits[name] = _BitPacker()
        return packer

    def write_bits(self, name: str, bits: np.ndarray) -> None:
        """Append bits (a uint8 array of 0 and 1) to bit stream ``name``."""
        self.write(name, self._packer(name).bits(bits))

    def write_fields(self, name: str, values: np.ndarray, width: int) -> None:
        """Append the low ``width`` bits of each non-negative value to bit stream ``name``."""
        self.write(name, self._packer(name).fields(values, width))

    def emit(self, pieces: dict[str, list[Piece]]) -> None:
        """Write pieces: byte arrays to byte streams, :class:`Fields` to bit streams."""
        for name, parts in pieces.items():
            for p in parts:
                if isinstance(p, Fields):
                    self.write_fields(name, p.values, p.width)
                else:
                    self.write(name, p)

    def finish(self) -> tuple[list[tuple[str, int, bytes]], int]:
        """Close every stream: returns ``[(name, raw_len, compressed bytes)]`` and the total raw length."""
        for name, packer in self._bits.items():
            self.write(name, packer.flush())  # zero-pads the end of a bit stream to a whole byte
        self._bits.clear()
        table: list[tuple[str, int, bytes]] = []
        for name, obj in self._objs.items():
            self._out[name].append(obj.flush())
            table.append((name, self._raw[name], b"".join(self._out[name])))
        return table, sum(self._raw.values())


def compressed_size(pieces: dict[str, list[Piece]], level: int = 3) -> int:
    """Size the given stream pieces would take if compressed on their own (to choose an encoding)."""
    cctx = zstandard.ZstdCompressor(level=level)
    total = 0
    for parts in pieces.values():
        packer = _BitPacker()
        chunks = [packer.fields(p.values, p.width) if isinstance(p, Fields) else np.ascontiguousarray(p) for p in parts]
        data = b"".join(c.tobytes() for c in [*chunks, packer.flush()])
        total += len(cctx.compress(data)) if data else 0
    return total


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def check_frame(what: str, comp: memoryview) -> None:
    """``comp`` must be exactly one complete zstd frame, checked from its block headers alone.

    The streaming decoder cannot tell a frame cut at a block boundary (e.g. a dropped empty
    last block) from a finished one, nor does it look past the data it was asked for.
    """
    n = len(comp)
    if bytes(comp[:4]) != _ZSTD_MAGIC:
        raise FormatError(f"{what} is not a zstd frame")
    try:
        pos = zstandard.frame_header_size(comp)
    except zstandard.ZstdError:
        raise TruncatedError(f"{what} ends inside its zstd frame header") from None
    fhd = comp[4]
    if fhd & 0x18:  # unused and reserved bits: never set by an encoder
        raise FormatError(f"{what}: zstd frame header has reserved bits set")
    last = 0
    while not last:
        if pos + 3 > n:
            raise TruncatedError(f"{what} ends inside its zstd frame")
        head = int.from_bytes(comp[pos : pos + 3], "little")
        last = head & 1
        pos += 3 + (1 if (head >> 1) & 3 == 1 else head >> 3)  # RLE blocks store one byte
    pos += 4 if fhd & 0x04 else 0  # content checksum
    if pos > n:
        raise TruncatedError(f"{what} ends inside its zstd frame")
    if pos < n:
        raise FormatError(f"{what}: {n - pos} bytes after its zstd frame")


class _Stream:
    __slots__ = ("buf", "done", "pos", "raw_len", "reader")

    def __init__(self, reader: zstandard.ZstdDecompressionReader, raw_len: int) -> None:
        self.reader = reader
        self.raw_len = raw_len
        self.done = 0
        # Bit streams only: bytes read but not wholly consumed, and the next bit to consume in them.
        self.buf = _NO_BITS
        self.pos = 0


# Bits a run of ones may go past a unary read's bound before it is refused unread: a short stream
# that ends inside the codes is still refused as truncated (the committed vectors), a long one after
# 64 KiB more at most.
_UNARY_SLACK = 1 << 19


class StreamReader:
    """Reads exact byte counts from the streams of a patch, never decompressing past a stream's
    declared raw length (the declared lengths are themselves bounded by the caller)."""

    def __init__(self, table: list[tuple[str, int, memoryview]]) -> None:
        self._streams: dict[str, _Stream] = {}
        for name, raw_len, comp in table:
            if name in self._streams:
                raise FormatError(f"stream {name!r} listed twice")
            check_frame(f"stream {name!r}", comp)
            # One decompressor per stream: readers of one ZstdDecompressor share its context.
            dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
            reader = dctx.stream_reader(comp, read_size=1 << 16, read_across_frames=False)
            self._streams[name] = _Stream(reader, raw_len)

    def _get(self, name: str) -> _Stream:
        s = self._streams.get(name)
        if s is None:
            raise FormatError(f"patch needs stream {name!r}, which it does not contain")
        return s

    def read(self, name: str, n: int) -> bytes:
        if n == 0:
            return b""
        s = self._get(name)
        if s.done + n > s.raw_len:
            raise LimitExceededError(f"stream {name!r}: reading past its declared length {s.raw_len}")
        parts: list[bytes] = []
        want = n
        try:
            while want:
                got = s.reader.read(want)
                if not got:
                    raise TruncatedError(f"stream {name!r} ends after {s.done + n - want} of {s.raw_len} bytes")
                parts.append(got)
                want -= len(got)
        except zstandard.ZstdError as e:
            raise FormatError(f"stream {name!r} is corrupt: {e}") from None
        s.done += n
        return b"".join(parts) if len(parts) > 1 else parts[0]

    def read_words(self, name: str, count: int, width: int) -> np.ndarray:
        return np.frombuffer(self.read(name, count * width), dtype=le_words(width))

    def read_planes(self, prefix: str, count: int, width: int) -> np.ndarray:
        """Inverse of :meth:`StreamWriter.write_planes`: ``count`` words of ``width`` bytes."""
        if width == 1:  # one plane: the stream's bytes are the words (read-only, not copied)
            return np.frombuffer(self.read(f"{prefix}.1.0", count), dtype=le_words(1))
        out = np.empty((count, width), dtype=np.uint8)
        for p in range(width):
            out[:, p] = np.frombuffer(self.read(f"{prefix}.{width}.{p}", count), dtype=np.uint8)
        return out.reshape(-1).view(le_words(width))

    def _fill(self, name: str, s: _Stream, nbits: int) -> None:
        """Make the buffer of bit stream ``s`` hold at least ``nbits`` unconsumed bits."""
        have = s.buf.size * 8 - s.pos
        if have >= nbits:
            return
        new = np.frombuffer(self.read(name, (nbits - have + 7) >> 3), dtype=np.uint8)
        keep = s.buf[s.pos >> 3 :]
        s.buf = np.concatenate([keep, new]) if keep.size else new
        s.pos &= 7

    def read_bits(self, name: str, n: int) -> np.ndarray:
        """The next ``n`` bits of bit stream ``name`` (uint8 0/1 array)."""
        if n == 0:
            return _NO_BITS
        s = self._get(name)
        self._fill(name, s, n)
        first, lead = s.pos >> 3, s.pos & 7
        bits = np.unpackbits(s.buf[first : first + ((lead + n + 7) >> 3)], bitorder="little")[lead : lead + n]
        s.pos += n
        return bits

    def read_fields(self, name: str, count: int, width: int) -> np.ndarray:
        """``count`` fields of ``width`` bits (see :func:`pack_fields`), as int64."""
        if not 0 <= width <= MAX_FIELD_BITS:
            raise FormatError(f"stream {name!r}: bit field width {width} out of range")
        if count == 0 or width == 0:
            return np.zeros(count, dtype=np.int64)
        s = self._get(name)
        self._fill(name, s, count * width)
        out = unpack_fields(s.buf, s.pos, count, width)
        s.pos += count * width
        return out

    def read_unary(self, name: str, count: int, most: int | None = None) -> np.ndarray:
        """``count`` unary codes (inverse of :func:`unary_bits`), as int64.  ``most``: what the codes
        may add up to; a longer run of ones is refused (LimitExceededError) as soon as it is read that
        far, so a corrupt record never makes the reader buffer its whole stream (which only the whole
        payload's size bounds)."""
        if count == 0:
            return np.empty(0, dtype=np.int64)
        s = self._get(name)
        lead = s.pos & 7
        bufs = [s.buf[s.pos >> 3 :]]
        bits = np.unpackbits(bufs[0], bitorder="little")[lead:]
        zeros = [np.flatnonzero(bits == 0)]
        found, nbits = zeros[0].size, bits.size
        while found < count:  # the parts are joined once at the end: no copy per read
            left = s.raw_len - s.done
            if left == 0:  # (first: a stream that ends inside the codes is refused as truncated)
                raise TruncatedError(f"stream {name!r} ends inside a unary code")
            ones = nbits - found  # every one read so far belongs to the codes
            if most is not None and ones > most + _UNARY_SLACK:
                raise LimitExceededError(f"stream {name!r}: unary codes add up to more than their field allows")
            # Rice quotients average 1.5 to 2 bits with their zero: read for 3 bits a code, so one or two
            # reads do; what is read ahead stays for the next read.
            want = max(64, (count - found) * 3 // 8 + 8)
            if most is not None:  # never further than the bound allows
                want = min(want, (count - found + most + _UNARY_SLACK - ones) // 8 + 8)
            new = np.frombuffer(self.read(name, min(left, want)), dtype=np.uint8)
            bufs.append(new)
            z = np.flatnonzero(np.unpackbits(new, bitorder="little") == 0)
            z += nbits
            zeros.append(z)
            found, nbits = found + z.size, nbits + new.size * 8
        ends = (np.concatenate(zeros) if len(zeros) > 1 else zeros[0])[:count]
        if most is not None and int(ends[-1]) + 1 - count > most:
            raise LimitExceededError(f"stream {name!r}: unary codes add up to more than their field allows")
        used = lead + int(ends[-1]) + 1
        buf = np.concatenate(bufs) if len(bufs) > 1 else bufs[0]
        s.buf, s.pos = buf[used >> 3 :], used & 7
        q = np.empty(count, dtype=np.int64)  # ends[i] - ends[i - 1] - 1
        q[0] = ends[0]
        np.subtract(ends[1:], ends[:-1], out=q[1:])
        q[1:] -= 1
        return q

    def finish(self) -> None:
        """Every stream must be consumed exactly: leftover bytes mean a corrupt or forged patch."""
        for name, s in self._streams.items():
            if s.done != s.raw_len:
                raise FormatError(f"stream {name!r}: {s.raw_len - s.done} bytes left unused")
            rest = s.buf[s.pos >> 3 :]
            # Padding is fewer than 8 zero bits: a whole unread byte (read ahead) is not padding.
            if rest.size > 1 or (rest.size and (s.pos & 7 == 0 or int(rest[0]) >> (s.pos & 7))):
                raise FormatError(f"stream {name!r}: unused bits at its end (more than zero padding)")
            try:
                extra = s.reader.read(1)
            except zstandard.ZstdError as e:
                raise FormatError(f"stream {name!r} is corrupt: {e}") from None
            if extra:
                raise FormatError(f"stream {name!r} holds more data than declared")

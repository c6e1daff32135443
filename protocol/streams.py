"""Named, zstd-compressed byte streams shared by every tensor of a patch.

Tensors append their pieces to a few streams (gaps, value codes, byte planes of raw words)
instead of being compressed one by one: small tensors then cost no frame overhead, and
each stream holds statistically alike bytes, which is what zstd's entropy stage wants.
Multi-byte words are split into byte planes (plane p holds byte p of every word, little
endian) because the high bytes of neighbouring weights are far more alike than whole words.
"""

from __future__ import annotations

import numpy as np
import zstandard

from protocol.errors import FormatError, LimitExceededError, TruncatedError

# Decoders refuse frames that ask for a larger window: bounds memory per stream.
MAX_WINDOW = 1 << 23
_LE_INT = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}


def le_words(width: int) -> np.dtype[np.signedinteger]:
    return np.dtype(_LE_INT[width])


class StreamWriter:
    """Accumulates compressed streams; names appear in the table in first-write order."""

    def __init__(self, level: int = 3) -> None:
        self._level = level
        self._objs: dict[str, zstandard.ZstdCompressionObj] = {}
        self._out: dict[str, list[bytes]] = {}
        self._raw: dict[str, int] = {}

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

    def finish(self) -> tuple[list[tuple[str, int, bytes]], int]:
        """Close every stream: returns ``[(name, raw_len, compressed bytes)]`` and the total raw length."""
        table: list[tuple[str, int, bytes]] = []
        for name, obj in self._objs.items():
            self._out[name].append(obj.flush())
            table.append((name, self._raw[name], b"".join(self._out[name])))
        return table, sum(self._raw.values())


def compressed_size(pieces: dict[str, list[np.ndarray]], level: int = 3) -> int:
    """Size the given stream pieces would take if compressed on their own (to choose an encoding)."""
    cctx = zstandard.ZstdCompressor(level=level)
    total = 0
    for parts in pieces.values():
        data = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
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
    __slots__ = ("done", "raw_len", "reader")

    def __init__(self, reader: zstandard.ZstdDecompressionReader, raw_len: int) -> None:
        self.reader = reader
        self.raw_len = raw_len
        self.done = 0


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

    def read(self, name: str, n: int) -> bytes:
        if n == 0:
            return b""
        s = self._streams.get(name)
        if s is None:
            raise FormatError(f"patch needs stream {name!r}, which it does not contain")
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
        out = np.empty((count, width), dtype=np.uint8)
        for p in range(width):
            out[:, p] = np.frombuffer(self.read(f"{prefix}.{width}.{p}", count), dtype=np.uint8)
        return out.reshape(-1).view(le_words(width))

    def finish(self) -> None:
        """Every stream must be consumed exactly: leftover bytes mean a corrupt or forged patch."""
        for name, s in self._streams.items():
            if s.done != s.raw_len:
                raise FormatError(f"stream {name!r}: {s.raw_len - s.done} bytes left unused")
            try:
                extra = s.reader.read(1)
            except zstandard.ZstdError as e:
                raise FormatError(f"stream {name!r} is corrupt: {e}") from None
            if extra:
                raise FormatError(f"stream {name!r} holds more data than declared")

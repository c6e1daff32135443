"""Named compressed streams: exact round trip, and every way a stream can lie about its length."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.errors import FormatError, LimitExceededError, PatchswarmError, TruncatedError
from patchswarm.protocol.streams import (
    MAX_FIELD_BITS,
    MAX_WINDOW,
    StreamReader,
    StreamWriter,
    compressed_size,
    pack_fields,
    unary_bits,
    unpack_fields,
)
from tests.support.strategies import random_words, seeds

Table = list[tuple[str, int, memoryview]]

stream_names = st.sampled_from(["gap.2.0", "gap.2.1", "ulp", "raw.4.3", "x"])
pieces = st.lists(st.tuples(stream_names, st.binary(min_size=0, max_size=300)), max_size=12)


def _table(writer: StreamWriter) -> tuple[Table, int]:
    table, raw = writer.finish()
    return [(n, r, memoryview(c)) for n, r, c in table], raw


def _write(items: list[tuple[str, bytes]]) -> tuple[Table, int, dict[str, bytes]]:
    w = StreamWriter()
    expect: dict[str, bytes] = {}
    for name, data in items:
        w.write(name, data)
        if data:
            expect[name] = expect.get(name, b"") + data
    table, raw = _table(w)
    return table, raw, expect


def _one_stream(data: bytes, name: str = "s", parts: int = 1) -> tuple[str, int, bytes]:
    w = StreamWriter()
    step = -(-len(data) // parts) if data else 1
    for i in range(0, len(data), step):
        w.write(name, data[i : i + step])
    (entry,), _ = w.finish()
    return entry


def _consume(name: str, raw_len: int, comp: bytes) -> None:
    """Open, read fully and finish one stream (errors may come from any of the three steps)."""
    r = StreamReader([(name, raw_len, memoryview(comp))])
    r.read(name, raw_len)
    r.finish()


@given(pieces, seeds)
def test_round_trip_over_random_pieces(items: list[tuple[str, bytes]], seed: int) -> None:
    table, raw, expect = _write(items)
    assert [n for n, _, _ in table] == list(dict.fromkeys(n for n, d in items if d))  # first-write order
    assert raw == sum(len(d) for _, d in items)
    assert {n: r for n, r, _ in table} == {n: len(d) for n, d in expect.items()}
    r = StreamReader(table)
    rng = np.random.default_rng(seed)
    for name, data in expect.items():  # read each stream back in random slices
        got = b""
        while len(got) < len(data):
            got += r.read(name, int(rng.integers(1, len(data) - len(got) + 1)))
        assert got == data
        assert r.read(name, 0) == b""
    r.finish()


@given(pieces)
def test_reads_may_interleave_across_streams(items: list[tuple[str, bytes]]) -> None:
    table, _, _ = _write(items)
    r = StreamReader(table)
    for name, data in items:  # read back in exactly the order written, piece by piece
        assert r.read(name, len(data)) == data
    r.finish()


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_planes_round_trip(width: int) -> None:
    words = random_words(np.random.default_rng(width), width, 1000)
    w = StreamWriter()
    w.write_planes("p", words[:600])
    w.write_planes("p", words[600:])
    table, raw = _table(w)
    assert [n for n, _, _ in table] == [f"p.{width}.{p}" for p in range(width)]
    assert raw == words.nbytes
    r = StreamReader(table)
    assert np.array_equal(r.read_planes("p", 999, width), words[:999])
    assert np.array_equal(r.read_words(f"p.{width}.0", 0, 1), np.empty(0))
    assert np.array_equal(r.read_planes("p", 1, width), words[999:])
    r.finish()
    # Plane p holds byte p (little endian) of every word.
    plane0 = StreamReader(table).read(f"p.{width}.0", 1000)
    assert plane0 == (words.view(np.uint8).reshape(-1, width)[:, 0]).tobytes()


def test_empty_writes_create_no_stream() -> None:
    w = StreamWriter()
    w.write("a", b"")
    w.write("b", np.empty(0, dtype=np.int32))
    assert w.finish() == ([], 0)
    r = StreamReader([])
    assert r.read("anything", 0) == b""
    r.finish()


def test_compressed_size_matches_a_lone_compression() -> None:
    data = np.arange(1000, dtype=np.int16)
    size = compressed_size({"a": [data[:500], data[500:]], "b": []})
    assert size == len(zstandard.ZstdCompressor(level=3).compress(data.tobytes()))


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("content_size", [False, True])
@pytest.mark.parametrize("size", [0, 1, 1000, 300_000])
def test_every_shape_of_valid_frame_is_accepted(checksum: bool, content_size: bool, size: int) -> None:
    # The frame check walks block headers: it must accept what any zstd encoder writes.
    data = np.random.default_rng(size).integers(0, 3, size, dtype=np.uint8).tobytes()
    for level in (1, 19):
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=checksum, write_content_size=content_size)
        frames = [cctx.compress(data)]
        obj = cctx.compressobj()
        frames.append(b"".join([obj.compress(data[: size // 2]), obj.compress(data[size // 2 :]), obj.flush()]))
        for comp in frames:
            r = StreamReader([("s", size, memoryview(comp))])
            assert r.read("s", size) == data
            r.finish()


# ---------------------------------------------------------------- lies about lengths


def test_reading_past_the_declared_length() -> None:
    name, raw, comp = _one_stream(b"abcdef")
    r = StreamReader([(name, raw, memoryview(comp))])
    assert r.read(name, 4) == b"abcd"
    with pytest.raises(LimitExceededError):
        r.read(name, 3)
    # Declared shorter than the data: reading stops at the declared length, finish() objects.
    r = StreamReader([(name, 3, memoryview(comp))])
    assert r.read(name, 3) == b"abc"
    with pytest.raises(LimitExceededError):
        r.read(name, 1)
    with pytest.raises(FormatError, match="more data than declared"):
        r.finish()


def test_declared_longer_than_the_data_is_truncated() -> None:
    name, _, comp = _one_stream(b"abcdef")
    r = StreamReader([(name, 10, memoryview(comp))])
    with pytest.raises(TruncatedError):
        r.read(name, 8)


def test_finish_detects_unused_bytes() -> None:
    table, _, _ = _write([("a", b"12345"), ("b", b"xy")])
    r = StreamReader(table)
    r.read("a", 5)
    r.read("b", 1)
    with pytest.raises(FormatError, match="left unused"):
        r.finish()
    with pytest.raises(FormatError, match="left unused"):
        StreamReader(table).finish()


def test_unknown_and_duplicate_streams() -> None:
    table, _, _ = _write([("a", b"12345")])
    with pytest.raises(FormatError):
        StreamReader(table).read("b", 1)
    with pytest.raises(FormatError, match="twice"):
        StreamReader(table + table)


def _sizes() -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(0)
    out = [(b"x", 1), (bytes(1000), 1), (rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(), 3)]
    # Exactly one or two zstd blocks of data: the frame then ends with an empty last block,
    # which a truncation can drop without losing a byte of data.
    for n in (1 << 17, 1 << 18):
        out.append((rng.integers(0, 256, n, dtype=np.uint8).tobytes(), 2))
        out.append((rng.integers(0, 4, n, dtype=np.uint8).tobytes(), 1))
        out.append((bytes(n), 1))
    return out


@pytest.mark.parametrize("case", range(len(_sizes())))
def test_truncated_compressed_data_is_refused(case: int) -> None:
    data, parts = _sizes()[case]
    name, raw, comp = _one_stream(data, parts=parts)
    lengths = set(range(min(len(comp), 64))) | set(range(max(0, len(comp) - 64), len(comp)))
    for n in sorted(lengths):
        with pytest.raises(FormatError):  # TruncatedError is a FormatError
            _consume(name, raw, comp[:n])


def test_trailing_bytes_after_the_frame_are_refused() -> None:
    name, raw, comp = _one_stream(b"hello world" * 20)
    for extra in (b"\x00", b"xyz", comp, zstandard.compress(b"")):
        with pytest.raises(FormatError):
            _consume(name, raw, comp + extra)


def test_unfinished_frame_is_refused() -> None:
    # Clearing the last-block flag leaves every data byte in place but the frame unfinished.
    name, raw, comp = _one_stream(b"abc")
    assert comp[6:9] == bytes([0x19, 0, 0])  # raw block of 3 bytes, last
    bad = bytearray(comp)
    bad[6] &= ~1
    with pytest.raises(FormatError):
        _consume(name, raw, bytes(bad))


def test_empty_or_skippable_stream_is_refused() -> None:
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    for comp in (b"", skippable, skippable + zstandard.compress(b"")):
        with pytest.raises(FormatError):
            _consume("s", 0, comp)


def _rle_bomb(blocks: int, window_log: int = 17) -> bytes:
    """A zstd frame of ``blocks`` RLE blocks of 128 KiB each: 4 bytes in, 128 KiB out per block."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0x00, (window_log - 10) << 3])
    rle = (((1 << 17) << 3) | (1 << 1)).to_bytes(3, "little") + b"\x07"
    last = (((1 << 17) << 3) | (1 << 1) | 1).to_bytes(3, "little") + b"\x07"
    return header + rle * (blocks - 1) + last


def test_decompression_bomb_stops_at_the_declared_length() -> None:
    bomb = _rle_bomb(1 << 16)  # 8 GiB of output from 256 KiB of input
    r = StreamReader([("s", 1000, memoryview(bomb))])
    assert r.read("s", 1000) == b"\x07" * 1000
    with pytest.raises(FormatError, match="more data than declared"):
        r.finish()
    r = StreamReader([("s", 1 << 40, memoryview(bomb))])  # declared 1 TiB: reads stay bounded
    assert r.read("s", 10) == b"\x07" * 10
    with pytest.raises(FormatError, match="left unused"):
        r.finish()


def test_window_larger_than_allowed_is_refused() -> None:
    big = _rle_bomb(1, window_log=MAX_WINDOW.bit_length())  # twice the allowed window
    with pytest.raises(FormatError):
        _consume("s", 1 << 17, big)
    ok = _rle_bomb(1, window_log=MAX_WINDOW.bit_length() - 1)
    r = StreamReader([("s", 1 << 17, memoryview(ok))])
    assert r.read("s", 1 << 17) == b"\x07" * (1 << 17)
    r.finish()


@given(st.binary(max_size=64), st.integers(0, 100))
def test_random_compressed_bytes_never_crash(comp: bytes, raw_len: int) -> None:
    with contextlib.suppress(PatchswarmError):  # anything else fails the test
        _consume("s", raw_len, comp)


@given(st.binary(min_size=1, max_size=200), st.integers(0, 10_000), st.integers(1, 255))
def test_single_byte_corruption_of_a_frame_never_crashes(data: bytes, pos: int, xor: int) -> None:
    name, raw, comp = _one_stream(data)
    bad = bytearray(comp)
    bad[pos % len(bad)] ^= xor
    with contextlib.suppress(PatchswarmError):
        _consume(name, raw, bytes(bad))


# ---------------------------------------------------------------- bit streams

bit_pieces = st.lists(
    st.tuples(
        st.sampled_from(["bits", "ulp.big"]),
        st.sampled_from(["bits", "fields", "unary"]),
        st.integers(0, 70),  # count
        st.integers(0, 57),  # field width
    ),
    max_size=10,
)


def _bit_values(rng: np.random.Generator, kind: str, count: int, width: int) -> np.ndarray:
    if kind == "bits":
        return rng.integers(0, 2, count, dtype=np.uint8)
    if kind == "unary":
        return rng.choice(np.array([0, 0, 1, 2, 3, 9, 40]), count).astype(np.int64)
    hi = 1 << min(width, MAX_FIELD_BITS)
    v = rng.integers(0, hi, count, dtype=np.int64, endpoint=False) if width else np.zeros(count, np.int64)
    if width and count:
        v[0] = hi - 1  # all ones: the widest value of the field
    return v


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 56, 57])
@pytest.mark.parametrize("lead", [0, 1, 5, 7])
def test_pack_and_unpack_fields(width: int, lead: int) -> None:
    rng = np.random.default_rng(width * 8 + lead)
    for count in (0, 1, 7, 8, 9, 65):
        v = _bit_values(rng, "fields", count, width)
        packed = pack_fields(v, width, lead)
        assert packed.dtype == np.uint8 and packed.size == (lead + count * width + 7) // 8
        bits = np.unpackbits(packed, bitorder="little")
        assert not bits[:lead].any() and not bits[lead + count * width :].any()  # zero lead and padding
        want = ((v[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)  # LSB first
        assert np.array_equal(bits[lead : lead + count * width], want)
        assert np.array_equal(unpack_fields(packed, lead, count, width), v)


def test_unary_bits() -> None:
    assert unary_bits(np.array([0, 3, 1])).tolist() == [0, 1, 1, 1, 0, 1, 0]
    assert unary_bits(np.empty(0, np.int64)).size == 0


@given(bit_pieces, seeds)
def test_bit_streams_round_trip(items: list[tuple[str, str, int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = StreamWriter()
    w.write("bytes", b"abc")  # byte and bit streams side by side
    written = []
    for name, kind, count, width in items:
        v = _bit_values(rng, kind, count, width)
        if kind == "bits":
            w.write_bits(name, v)
        elif kind == "fields":
            w.write_fields(name, v, width)
        else:
            w.write_bits(name, unary_bits(v))
        written.append((name, kind, count, width, v))
    table, _ = _table(w)
    r = StreamReader(table)
    assert r.read("bytes", 3) == b"abc"
    for name, kind, count, width, v in written:
        if kind == "bits":
            got = r.read_bits(name, count)
        elif kind == "fields":
            got = r.read_fields(name, count, width)
        else:
            got = r.read_unary(name, count)
        assert np.array_equal(got, v), (name, kind, count, width)
    r.finish()


def _bit_stream(bits: list[int], extra: bytes = b"") -> StreamReader:
    w = StreamWriter()
    w.write_bits("b", np.array(bits, dtype=np.uint8))
    ((name, _, comp),), _ = w.finish()
    data = zstandard.decompress(comp, max_output_size=1 << 10) + extra
    return StreamReader([(name, len(data), memoryview(zstandard.compress(data)))])


@pytest.mark.parametrize("nbits", [3, 8, 9, 16])
def test_bit_stream_padding_is_zero_and_short(nbits: int) -> None:
    bits = [1, 1, 0] * 6
    r = _bit_stream(bits[:nbits])
    assert r.read_bits("b", nbits).tolist() == bits[:nbits]
    r.finish()
    # Unread bits beyond the padding, or non-zero padding: refused.
    r = _bit_stream(bits[:nbits])
    r.read_bits("b", nbits - 1)
    if bits[nbits - 1]:
        with pytest.raises(FormatError):
            r.finish()
    for extra in (b"\x00", b"\x01", b"\x80\x00"):
        r = _bit_stream(bits[:nbits], extra)
        r.read_bits("b", nbits)
        with pytest.raises(FormatError):
            r.finish()
        # The same after a unary read, which reads ahead: a whole zero byte is not padding.
        r = _bit_stream([0] * nbits, extra)
        assert r.read_unary("b", nbits).tolist() == [0] * nbits
        with pytest.raises(FormatError):
            r.finish()


def test_bit_reads_past_the_end() -> None:
    r = _bit_stream([1] * 16)
    with pytest.raises(FormatError):  # all ones: a unary code that never ends
        r.read_unary("b", 1)
    r = _bit_stream([1] * 16)
    with pytest.raises(LimitExceededError):
        r.read_bits("b", 17)
    r = _bit_stream([1] * 16)
    with pytest.raises(LimitExceededError):
        r.read_fields("b", 3, 6)
    r = _bit_stream([1] * 16)
    with pytest.raises(FormatError):
        r.read_fields("b", 1, MAX_FIELD_BITS + 1)


def _raw_stream(data: bytes) -> StreamReader:
    return StreamReader([("b", len(data), memoryview(zstandard.compress(data)))])


@given(most=st.integers(0, 300), count=st.integers(1, 4))
def test_unary_codes_past_their_bound_are_refused_before_the_stream_is_read(most: int, count: int) -> None:
    """A run of ones longer than the codes may add up to is refused soon after (64 KiB), not after the
    reader buffered a stream that only the whole payload's size bounds (here 1 MiB of ones)."""
    ones = b"\xff" * (1 << 20) + b"\x00"
    r = _raw_stream(ones)
    with pytest.raises(LimitExceededError):
        r.read_unary("b", count, most)
    assert r._get("b").done < 1 << 17  # the bound plus 64 KiB of slack, not the 1 MiB
    # Codes that add up to exactly the bound are read, and one more one is refused.
    bits = [1] * most + [0] * count
    assert _bit_stream(bits).read_unary("b", count, most).sum() == most
    with pytest.raises(LimitExceededError):
        _bit_stream([1] * (most + 1) + [0] * count).read_unary("b", count, most)

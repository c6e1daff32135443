"""The decoder's answer to corrupt, truncated, forged and hostile payloads.

A payload carries no hashes of its own: the manifest's chunk hashes (checked before any byte is
decoded) and the target root (checked after) are what catch a corruption that still decodes to
something.  What the decoder itself must guarantee, and what is checked here, is narrower: it
never fails with anything but a ``PatchswarmError`` (no IndexError, ValueError, ZstdError,
MemoryError...), it never allocates or decompresses beyond what the layout and the records
bound, and it refuses every structural lie it can see (lengths, counts, positions, reserved
bits, framing).

Forged payloads are built from the outer format only (prefix, header frame holding
``[records, stream table]``, stream frames back to back; docs/format.md section 2), by taking
apart payloads the encoder wrote: the tests do not depend on how tensors code their changes.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.errors import (
    FormatError,
    LayoutMismatchError,
    LimitExceededError,
    PatchswarmError,
    UnsupportedFormatError,
)
from patchswarm.protocol.manifest import Kind, Manifest
from patchswarm.protocol.patch_format import PAYLOAD_MAGIC, Encoding, raw_bound, read_header
from patchswarm.protocol.patchfile import sign_version
from patchswarm.protocol.served import ServedModel, TensorSpec, layout_hash, state_root
from patchswarm.protocol.streams import MAX_EXPANSION
from tests.support.strategies import model_from_words, mutate, patch_cases, random_words

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PREFIX = struct.Struct("<4sB3xI")


# ---------------------------------------------------------------- taking payloads apart


@dataclass
class Parts:
    """A payload's outer structure: records, stream table and the stream frames."""

    records: list[list[int]]
    table: list[list[Any]]  # [name, raw_len, comp_len]
    comps: list[bytes]
    extra_header: list[object] = field(default_factory=list)

    @classmethod
    def of(cls, payload: bytes) -> Parts:
        _, _, hlen = PREFIX.unpack_from(payload)
        records, table = msgpack.unpackb(zstandard.decompress(payload[12 : 12 + hlen]))
        comps, off = [], 12 + hlen
        for _, _, comp_len in table:
            comps.append(payload[off : off + comp_len])
            off += comp_len
        assert off == len(payload)
        return cls(records, table, comps)

    def data(self, i: int) -> bytes:
        return zstandard.ZstdDecompressor().decompress(self.comps[i], max_output_size=1 << 24)

    def set_data(self, i: int, data: bytes, *, declare: bool = True) -> None:
        """Replace stream ``i``'s bytes (a fresh frame); ``declare``: its raw_len follows them."""
        self.comps[i] = zstandard.compress(data)
        self.table[i][2] = len(self.comps[i])
        if declare:
            self.table[i][1] = len(data)

    def set_comp(self, i: int, comp: bytes) -> None:
        self.comps[i] = comp
        self.table[i][2] = len(comp)

    def payload(self) -> bytes:
        hz = zstandard.compress(msgpack.packb([self.records, self.table, *self.extra_header]))
        return PREFIX.pack(PAYLOAD_MAGIC, 1, len(hz)) + hz + b"".join(self.comps)


def forge_header(header: object, comps: list[bytes] | None = None) -> bytes:
    hz = zstandard.compress(msgpack.packb(header))
    return PREFIX.pack(PAYLOAD_MAGIC, 1, len(hz)) + hz + b"".join(comps or [])


def _rle_frame(blocks: int, byte: int = 0) -> bytes:
    """One zstd frame of ``blocks`` RLE blocks of 128 KiB: 4 bytes of input per 128 KiB of output."""
    rle = (((1 << 17) << 3) | 2).to_bytes(3, "little") + bytes([byte])
    last = (((1 << 17) << 3) | 3).to_bytes(3, "little") + bytes([byte])
    return ZSTD_MAGIC + bytes([0x00, 7 << 3]) + rle * (blocks - 1) + last


# ---------------------------------------------------------------- a small patch using every encoding


@cache
def _case() -> tuple[ServedModel, ServedModel, bytes, bytes]:
    """(base, target, patch payload, anchor payload) for a layout that exercises every encoding."""
    specs = [
        TensorSpec("a.ulp", "BF16", (64,)),
        TensorSpec("b.raw", "I32", (40,)),
        TensorSpec("c.dense", "F32", (30,)),
        TensorSpec("d.far", "U8", (20_000,)),
        TensorSpec("e.same", "F16", (10,)),
        TensorSpec("f.empty", "F8_E4M3", (0, 3)),
        TensorSpec("g.fp8", "F8_E5M2", (33,)),
    ]
    rng = np.random.default_rng(42)
    old = [random_words(rng, s.dt.width, s.numel) for s in specs]
    old[3][:] = 0
    new = [o.copy() for o in old]
    new[0][[1, 5]] = mutate(rng, "BF16", old[0], "ulp")[[1, 5]]
    new[0][60] ^= 0x4000  # a far jump
    new[0][9] = old[0][9] + 3  # a few steps
    new[1][[0, 39]] += 7
    new[2] = mutate(rng, "F32", old[2], "dense")
    new[3][[3, 19_999]] = 9  # changes far apart
    new[6][[2]] += 1
    base, target = model_from_words(specs, old), model_from_words(specs, new)
    patch = encode_patch(base, target)
    enc = [t.encoding for t in patch.tensors]
    assert enc[:2] == [Encoding.SPARSE_ULP, Encoding.SPARSE_RAW]
    assert enc[2] in (Encoding.XOR, Encoding.FULL)
    assert enc[3:] == [Encoding.SPARSE_RAW, Encoding.SAME, Encoding.SAME, Encoding.SPARSE_ULP]
    anchor = encode_patch(None, target).payload
    return base, target, patch.payload, anchor


def _outcome(payload: bytes, anchor: bool = False) -> str:
    """Apply ``payload`` to the case: 'error' (a PatchswarmError), 'differs' or 'same' (as the target)."""
    base, target, _, _ = _case()
    try:
        out = apply_patch(None if anchor else base.clone(), payload, target.specs)
    except PatchswarmError:
        return "error"
    return "same" if out.bitwise_equal(target) else "differs"


def _frame_starts(payload: bytes) -> list[int]:
    """Offsets of every zstd frame of a valid payload: the header's, then each stream's."""
    (hlen,) = struct.unpack_from("<I", payload, 8)
    starts, off = [12], 12 + hlen
    for _, _, comp_len in Parts.of(payload).table:
        starts.append(off)
        off += comp_len
    return starts


def _harmless(payload: bytes, bad: bytes, pos: int) -> bool:
    """Whether a corruption at ``pos`` that still decodes to the target is known slack.

    Two places in a payload do not affect a single decoded byte, so corrupting them yields the
    very target (harmless; the payload's chunk hash catches it anyway):

    - the window-descriptor byte of a zstd frame without the single-segment flag: it only states
      the decoder's window size, and any size up to the 8 MiB cap decodes the same;
    - ``k`` of a FULL or XOR record: dense records decode all ``numel`` words whatever ``k``
      says (for them it is a statistic, not a length).
    """
    for start in _frame_starts(payload):
        if pos == start + 5 and not payload[start + 4] & 0x20:
            return True
    specs = _case()[1].specs
    good, forged = read_header(payload, specs), read_header(bad, specs)
    same_streams = [(n, r, bytes(c)) for n, r, c in good.streams] == [(n, r, bytes(c)) for n, r, c in forged.streams]
    dense = (Encoding.XOR, Encoding.FULL)
    return same_streams and all(
        a == b or (a[0] == b[0] and a[0] in dense) for a, b in zip(good.records, forged.records, strict=True)
    )


def test_the_case_round_trips_and_parts_repack_exactly() -> None:
    base, target, payload, anchor = _case()
    assert apply_patch(base.clone(), payload, target.specs).bitwise_equal(target)
    assert apply_patch(None, anchor, target.specs).bitwise_equal(target)
    for p in (payload, anchor):
        parts = Parts.of(p)
        assert apply_patch(base.clone(), parts.payload(), target.specs).bitwise_equal(target)


# ---------------------------------------------------------------- corruption and truncation


@pytest.mark.parametrize("anchor", [False, True], ids=["patch", "anchor"])
def test_every_single_byte_corruption_is_refused_or_visible(anchor: bool) -> None:
    payload = _case()[3 if anchor else 2]
    outcomes: Counter[str] = Counter()
    for pos in range(len(payload)):
        for xor in (0x01, 0x10, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[pos] ^= xor
            result = _outcome(bytes(bad), anchor)  # anything but a PatchswarmError fails the test
            outcomes[result] += 1
            if pos < 12:  # magic, format, reserved, header length: no slack at all
                assert result == "error", (pos, xor)
            if result == "same":
                assert _harmless(payload, bytes(bad), pos), (pos, xor)
    # Stream contents (literal bytes of dense planes above all) can only be caught by hashes.
    assert outcomes["error"] > 0 and outcomes["differs"] > 0


@given(pos=st.integers(0, 1 << 20), xor=st.integers(1, 255), anchor=st.booleans())
def test_random_single_byte_corruption(pos: int, xor: int, anchor: bool) -> None:
    payload = _case()[3 if anchor else 2]
    bad = bytearray(payload)
    bad[pos % len(bad)] ^= xor
    if _outcome(bytes(bad), anchor) == "same":
        assert _harmless(payload, bytes(bad), pos % len(bad))


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=2, max_size=6))
def test_random_multi_byte_corruption_never_crashes(edits: list[tuple[int, int]]) -> None:
    payload = bytearray(_case()[2])
    for pos, xor in edits:
        payload[pos % len(payload)] ^= xor
    _outcome(bytes(payload))


@pytest.mark.parametrize("anchor", [False, True], ids=["patch", "anchor"])
def test_every_truncation_is_refused(anchor: bool) -> None:
    payload = _case()[3 if anchor else 2]
    for n in range(len(payload)):
        assert _outcome(payload[:n], anchor) == "error", n
    assert _outcome(payload + b"\x00", anchor) == "error"


@given(st.binary(max_size=300))
def test_random_bytes_are_refused(blob: bytes) -> None:
    assert _outcome(blob) == "error"
    assert _outcome(PAYLOAD_MAGIC + bytes([1, 0, 0, 0]) + blob) == "error"


@given(st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_random_header_frames_are_refused(blob: bytes, hlen: int) -> None:
    body = zstandard.compress(blob)
    assert _outcome(PREFIX.pack(PAYLOAD_MAGIC, 1, len(body)) + body) == "error"
    assert _outcome(PREFIX.pack(PAYLOAD_MAGIC, 1, hlen) + body) == "error"


def test_magic_format_and_reserved_bytes() -> None:
    _, _, payload, _ = _case()
    with pytest.raises(FormatError, match="magic"):
        _apply(b"XSWP" + payload[4:])
    with pytest.raises(UnsupportedFormatError):
        _apply(payload[:4] + b"\x03" + payload[5:])
    with pytest.raises(FormatError, match="format 2 holds no record"):  # one spelling: the lowest format
        _apply(payload[:4] + b"\x02" + payload[5:])
    for i in (5, 6, 7):  # reserved, zero: a payload has one spelling
        bad = bytearray(payload)
        bad[i] = 1
        with pytest.raises(FormatError, match="reserved"):
            _apply(bytes(bad))


def _apply(payload: bytes) -> ServedModel:
    base, target, _, _ = _case()
    return apply_patch(base.clone(), payload, target.specs)


# ---------------------------------------------------------------- bounds and bombs


def test_one_terabyte_stream_is_refused_before_any_work() -> None:
    _, _, payload, _ = _case()
    for raw_len in (1 << 40, (1 << 64) - 1):
        parts = Parts.of(payload)
        parts.table[0][1] = raw_len
        t0 = time.perf_counter()
        with pytest.raises(LimitExceededError):
            _apply(parts.payload())
        assert time.perf_counter() - t0 < 0.5


def _bound(records: list[list[int]], specs: list[TensorSpec]) -> int:
    return sum(raw_bound(s, Encoding(e), k) for s, (e, k) in zip(specs, records, strict=True))


@pytest.mark.parametrize("anchor", [False, True], ids=["patch", "anchor"])
def test_declared_raw_lengths_above_the_records_bound(anchor: bool) -> None:
    _, target, payload, anchor_payload = _case()
    parts = Parts.of(anchor_payload if anchor else payload)
    bound = _bound(parts.records, target.specs)
    total = sum(r for _, r, _ in parts.table)
    assert total <= bound
    parts.table[-1][1] += bound - total + 1  # one byte over
    base = None if anchor else _case()[0].clone()
    with pytest.raises(LimitExceededError):
        apply_patch(base, parts.payload(), target.specs)


def test_frame_decompressing_past_its_declared_length_is_refused() -> None:
    # An anchor of an all-zero model: every stream holds zeros, so a frame of nothing but zero
    # bytes is right for as long as it is read; it holds 4 GiB instead of the bytes declared.
    specs = [TensorSpec("w", "BF16", (1000,)), TensorSpec("x", "U8", (300,))]
    zeros = ServedModel.zeros_like(specs)
    parts = Parts.of(encode_patch(None, zeros).payload)
    for i in range(len(parts.table)):
        forged = Parts.of(parts.payload())
        forged.set_comp(i, _rle_frame(1 << 15))
        t0 = time.perf_counter()
        with pytest.raises(FormatError, match="more data than declared"):
            apply_patch(None, forged.payload(), specs)
        assert time.perf_counter() - t0 < 2.0  # nowhere near decompressing 4 GiB


def test_header_bomb_is_refused() -> None:
    big = ZSTD_MAGIC + bytes([0x00, 7 << 3]) + ((((1 << 17) << 3) | 3).to_bytes(3, "little") + b"\x90")
    payload = PREFIX.pack(PAYLOAD_MAGIC, 1, len(big)) + big
    with pytest.raises(LimitExceededError):
        _apply(payload)


def test_window_larger_than_allowed_is_refused() -> None:
    _, _, _, anchor = _case()
    target = _case()[1]
    for window_log, ok in ((23, True), (24, False)):  # the cap is 8 MiB
        parts = Parts.of(anchor)
        params = zstandard.ZstdCompressionParameters(window_log=window_log)
        obj = zstandard.ZstdCompressor(compression_params=params).compressobj()  # states its window
        parts.set_comp(0, obj.compress(parts.data(0)) + obj.flush())
        assert parts.comps[0][5] == (window_log - 10) << 3
        if ok:
            assert apply_patch(None, parts.payload(), target.specs).bitwise_equal(target)
        else:
            with pytest.raises(FormatError):
                apply_patch(None, parts.payload(), target.specs)


# ---------------------------------------------------------------- layouts and headers


def test_wrong_layout_is_refused() -> None:
    base, target, payload, _ = _case()
    specs = [TensorSpec("w", "BF16", (100,)), TensorSpec("z", "I8", (300,))]
    other = ServedModel.zeros_like(specs)
    with pytest.raises(LayoutMismatchError):
        apply_patch(other, payload, target.specs)
    renamed = [TensorSpec(s.name + "x", s.dtype, s.shape) for s in target.specs]
    with pytest.raises(LayoutMismatchError):
        apply_patch(base.clone(), payload, renamed)
    # Told the layout of the base, a payload made for another layout does not decode.
    with pytest.raises(FormatError):
        apply_patch(other, payload, specs)


@pytest.mark.parametrize("dtype", ["BF16", "I32", "F8_E4M3"])
def test_changes_past_the_end_of_a_shorter_tensor(dtype: str) -> None:
    # A patch made for 1000 elements, presented as one for 500: positions fall outside.
    long = [TensorSpec("w", dtype, (1000,))]
    short = [TensorSpec("w", dtype, (500,))]
    rng = np.random.default_rng(0)
    old = random_words(rng, long[0].dt.width, 1000)
    new = old.copy()
    new[[10, 600, 999]] ^= 1
    payload = encode_patch(model_from_words(long, [old]), model_from_words(long, [new])).payload
    with pytest.raises(FormatError):
        apply_patch(model_from_words(short, [old[:500]]), payload, short)


SPECS = [TensorSpec("w", "BF16", (100,)), TensorSpec("z", "I8", (300,))]


@pytest.mark.parametrize(
    "header",
    [
        None,
        5,
        "ab",
        {"a": 1, "b": 2},
        [[[0, 0]], []],  # one record for two tensors
        [[[0, 0], [0, 0], [0, 0]], []],
        [[[0, 0], [0]], []],
        [[[0, 0], [0, 0, 0]], []],
        [[[0, 0], [True, 0]], []],
        [[[0, 0], [0, 1.0]], []],
        [[[0, 0], [9, 1]], []],  # unknown encoding
        [[[0, 0], [-1, 1]], []],
        [[[0, 0], [1, 1]], []],  # ulp on an integer dtype
        [[[0, 1], [0, 0]], []],  # SAME with changes
        [[[1, 0], [0, 0]], []],  # sparse without changes
        [[[3, 0], [0, 0]], []],
        [[[1, 101], [0, 0]], []],  # more changes than elements
        [[[0, 0], [2, -1]], []],
        [[[0, 0], [0, 0]], 7],
        [[[0, 0], [0, 0]], [["s", 1]]],
        [[[0, 0], [0, 0]], [[1, 1, 1]]],
        [[[0, 0], [0, 0]], [["s", -1, 0]]],
        [[[0, 0], [0, 0]], [["s", 0, -1]]],
        [[[0, 0], [0, 0]], [["s", 0, 5]]],  # runs past the end
        [[[0, 0], [0, 0]], [["s", 0, 2**64 - 1]]],
        [[[0, 0], [0, 0]], [], 3],
    ],
)
def test_malformed_headers(header: object) -> None:
    with pytest.raises(FormatError):
        apply_patch(ServedModel.zeros_like(SPECS), forge_header(header), SPECS)


def test_header_frame_must_be_one_complete_frame() -> None:
    raw = msgpack.packb([[[0, 0], [0, 0]], []])
    good = zstandard.compress(raw)
    for hz in (good + b"\x00", good + zstandard.compress(b""), good[:-1], b"", b"\x00" * 12):
        payload = PREFIX.pack(PAYLOAD_MAGIC, 1, len(hz)) + hz
        with pytest.raises(FormatError):
            apply_patch(ServedModel.zeros_like(SPECS), payload, SPECS)
    ok = PREFIX.pack(PAYLOAD_MAGIC, 1, len(good)) + good
    assert apply_patch(ServedModel.zeros_like(SPECS), ok, SPECS).bitwise_equal(ServedModel.zeros_like(SPECS))


def test_patch_records_need_a_base() -> None:
    _, target, payload, _ = _case()
    with pytest.raises(FormatError, match="base"):
        apply_patch(None, payload, target.specs)


# ---------------------------------------------------------------- stream table lies


def _each_stream_forgery(payload: bytes) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    n = len(Parts.of(payload).table)
    for i in range(n):
        p = Parts.of(payload)
        del p.table[i], p.comps[i]
        out.append((f"drop {i}", p.payload()))
        p = Parts.of(payload)
        p.table.insert(i, list(p.table[i]))
        p.comps.insert(i, p.comps[i])
        out.append((f"twice {i}", p.payload()))
        p = Parts.of(payload)
        data = p.data(i)
        p.set_data(i, data[:-1])
        out.append((f"one byte short {i}", p.payload()))
        p = Parts.of(payload)
        p.set_data(i, data + data[-1:])
        out.append((f"one byte more {i}", p.payload()))
        p = Parts.of(payload)
        p.set_data(i, data + b"\x00")
        out.append((f"one zero byte more {i}", p.payload()))
        p = Parts.of(payload)
        p.set_data(i, data + b"\x00", declare=False)
        out.append((f"more than declared {i}", p.payload()))
        p = Parts.of(payload)
        p.table[i][1] = len(data) + 1
        out.append((f"declared one more {i}", p.payload()))
        p = Parts.of(payload)
        p.table[i][1] = len(data) - 1
        out.append((f"declared one less {i}", p.payload()))
        p = Parts.of(payload)
        p.set_comp(i, b"")
        out.append((f"empty {i}", p.payload()))
        p = Parts.of(payload)
        p.set_comp(i, p.comps[i] + b"\x00")
        out.append((f"trailing byte {i}", p.payload()))
        p = Parts.of(payload)
        p.table[i][0] += "x"
        out.append((f"renamed {i}", p.payload()))
    p = Parts.of(payload)
    p.comps.append(zstandard.compress(b"\x01"))
    p.table.append(["spare", 1, len(p.comps[-1])])
    out.append(("unread stream", p.payload()))
    return out


@pytest.mark.parametrize("anchor", [False, True], ids=["patch", "anchor"])
def test_stream_table_lies_are_refused(anchor: bool) -> None:
    payload = _case()[3 if anchor else 2]
    for what, forged in _each_stream_forgery(payload):
        assert _outcome(forged, anchor) == "error", what


# ---------------------------------------------------------------- structured fuzzing


@st.composite
def mutated_payloads(draw: st.DrawFn) -> tuple[ServedModel, ServedModel, bytes]:
    """A real patch between random versions, bent at the level of its structure: records, the
    stream table, and the decompressed bytes of one stream (then compressed again)."""
    base, target, _ = draw(patch_cases(max_numel=200))
    parts = Parts.of(encode_patch(base, target).payload)
    mutation = draw(st.sampled_from(["record", "raw_len", "flip", "insert", "delete", "swap", "none"]))
    event(mutation)
    if mutation == "record" and parts.records:
        rec = parts.records[draw(st.integers(0, len(parts.records) - 1))]
        j = draw(st.integers(0, 1))
        rec[j] = max(0, rec[j] + draw(st.sampled_from([-2, -1, 1, 2])))
    elif parts.table and mutation != "none":
        i = draw(st.integers(0, len(parts.table) - 1))
        data = bytearray(parts.data(i))
        if mutation == "raw_len":
            parts.table[i][1] = max(0, len(data) + draw(st.sampled_from([-1, 1])))
        elif mutation == "flip":
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
            parts.set_data(i, bytes(data))
        elif mutation == "insert":
            data.insert(draw(st.integers(0, len(data))), draw(st.integers(0, 255)))
            parts.set_data(i, bytes(data), declare=draw(st.booleans()))
        elif mutation == "delete":
            del data[draw(st.integers(0, len(data) - 1))]
            parts.set_data(i, bytes(data), declare=draw(st.booleans()))
        elif mutation == "swap" and len(parts.table) > 1:
            j = draw(st.integers(0, len(parts.table) - 1))
            parts.table[i][0], parts.table[j][0] = parts.table[j][0], parts.table[i][0]
    return base, target, parts.payload()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(mutated_payloads())
def test_structurally_mutated_payloads_never_crash(case: tuple[ServedModel, ServedModel, bytes]) -> None:
    base, target, payload = case
    try:
        out = apply_patch(base.clone(), payload, target.specs)
    except PatchswarmError as e:
        event(f"{type(e).__name__}")
        return
    event("decoded")
    assert out.specs == target.specs


# ---------------------------------------------------------------- sizes declared before anything is verified


def test_the_most_compressible_anchor_is_within_the_expansion_bound() -> None:
    """The bound is sound: an all-zero anchor whose planes are RLE blocks (zstd's best ratio) decodes."""
    specs = [TensorSpec("w", "U8", (16 << 17,))]  # 16 RLE blocks of 128 KiB
    zeros = ServedModel.zeros_like(specs)
    parts = Parts.of(encode_patch(None, zeros).payload)
    parts.set_comp(0, _rle_frame(16))
    payload = parts.payload()
    assert zeros.nbytes > 4000 * len(payload)
    assert apply_patch(None, payload, specs).bitwise_equal(zeros)


def test_a_stream_declaring_more_than_zstd_can_expand_to_is_refused() -> None:
    _, target, _, anchor = _case()
    parts = Parts.of(anchor)
    parts.table[-1][1] = MAX_EXPANSION * len(parts.comps[-1]) + 1
    with pytest.raises(LimitExceededError):
        read_header(parts.payload(), target.specs)


@pytest.mark.parametrize("anchor", [False, True], ids=["patch", "anchor"])
def test_dense_planes_must_declare_exactly_what_their_records_read(anchor: bool) -> None:
    """Refused by the header alone, before a byte of any stream is decoded."""
    _, target, payload, anchor_payload = _case()
    parts = Parts.of(anchor_payload if anchor else payload)
    dense = [i for i, (name, _, _) in enumerate(parts.table) if name.startswith(("full.", "xor."))]
    assert dense
    for i in dense:
        for delta in (-1, 1):
            forged = Parts.of(parts.payload())
            forged.table[i][1] += delta
            with pytest.raises(FormatError, match=r"its records (read exactly|allow at most)"):
                read_header(forged.payload(), target.specs)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1 << 16, 1 << 46), dtype=st.sampled_from(["U8", "BF16", "F32"]), extra=st.booleans())
def test_an_anchor_layout_its_payload_cannot_fill_is_refused_before_allocation(
    numel: int, dtype: str, extra: bool
) -> None:
    """A payload claimed for a far larger layout (an unsigned manifest's lie): refused before the
    model is allocated, so the error is a PatchswarmError, not the allocator's (or the OOM killer)."""
    _, target, _, anchor = _case()
    specs = list(target.specs)
    if extra:
        specs.append(TensorSpec("zz.huge", dtype, (numel,)))
    else:
        specs[0] = TensorSpec(specs[0].name, dtype, (numel,))
    with pytest.raises(PatchswarmError):
        apply_patch(None, anchor, specs)


def test_anchor_records_are_all_full() -> None:
    _, target, _, anchor = _case()
    parts = Parts.of(anchor)
    e_same = [s.name for s in target.specs].index("e.same")
    parts.records[e_same] = [int(Encoding.SAME), 0]
    for i, (name, _, _) in enumerate(parts.table):
        if name.startswith("full.2."):  # e.same's 10 words end the 2-byte planes (a.ulp's come first)
            parts.set_data(i, parts.data(i)[:-10])
    with pytest.raises(FormatError, match="needs a base version"):
        apply_patch(None, parts.payload(), target.specs)


def test_an_anchor_manifest_larger_than_its_payload_can_hold_is_refused() -> None:
    _, target, _, _ = _case()
    v = sign_version(encode_patch(None, target), target.specs, target.digests(), run_id="r", version=1, now_ms=0)
    assert v.manifest.kind == Kind.ANCHOR
    v.manifest.check()
    specs = (TensorSpec("w", "U8", (MAX_EXPANSION * v.manifest.payload_size + 1,)),)
    lie = dataclasses.replace(
        v.manifest,
        specs=specs,
        digests=(bytes(32),),
        layout_hash=layout_hash(list(specs)),
        target_root=state_root(list(specs), [bytes(32)]),
    )
    with pytest.raises(LimitExceededError, match="cannot fit"):
        lie.check()
    with pytest.raises(LimitExceededError, match="cannot fit"):
        Manifest.from_bytes(lie.to_bytes())

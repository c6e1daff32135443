"""Format-2 (SPARSE_CTX) test material: magnitude-skewed steps, which make base contexts pay, and
payloads with bits of their decompressed ``bits`` stream flipped; a position decoder run through either pass."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import torch
import zstandard

from patchswarm.protocol import context_coding, context_pass_torch
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import StreamReader
from tests.support.strategies import random_words


def ctx_case(
    rng: np.random.Generator, spec: TensorSpec, rate: float, groups: int, *, few_exponents: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random base words, changed positions at ``rate`` and thresholds (:func:`case_thresholds`).
    ``few_exponents``: the base repeats a few words (big groups, long runs, empty groups)."""
    base = random_words(rng, spec.dt.width, spec.numel)
    if few_exponents:
        base = base[rng.integers(0, min(spec.numel, 4), spec.numel)]
    return (base, *case_thresholds(rng, spec, base, np.flatnonzero(rng.random(spec.numel) < rate), groups))


def case_thresholds(
    rng: np.random.Generator, spec: TensorSpec, base: np.ndarray, pos: np.ndarray, groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """``pos`` (the last element when empty: a record has a change) and up to ``groups`` distinct
    non-zero exponents of changed elements, ascending, as an encoder may write them."""
    if pos.size == 0:
        pos = np.array([spec.numel - 1])
    m, e = context_coding.exponent_field(spec)
    ex = np.unique((base[pos].astype(np.int64) >> m) & ((1 << e) - 1))
    ex = ex[ex > 0]
    return pos, np.sort(rng.choice(ex, min(ex.size, groups), replace=False)).astype(np.int64) if ex.size else ex


def magnitude_skewed(rng: np.random.Generator, spec: TensorSpec, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """Base words of a normal-ish tensor and a target whose one-step changes favour small magnitudes."""
    base = random_words(rng, spec.dt.width, spec.numel)
    m, e = context_coding.exponent_field(spec)
    # Exponents spread over a narrow band near the middle, like trained weights.
    mid = (1 << (e - 1)) - 1
    expo = np.clip(mid - rng.geometric(0.3, spec.numel), 1, (1 << e) - 2).astype(np.int64)
    sign_mant = base.astype(np.int64) & ((1 << m) - 1 | (-1 << (8 * spec.dt.width - 1)))
    base = (sign_mant | (expo << m)).astype(base.dtype)
    p = rate * np.exp2(mid - 1 - expo).clip(0, 1 / rate) * 0.25
    changed = rng.random(spec.numel) < p
    new = base.copy()
    new[changed] ^= np.array(1, dtype=base.dtype)  # one mantissa step, never crossing the exponent
    return base, new


def _split(payload: bytes) -> tuple[Any, Any, list[bytes]]:
    """A payload's records, its stream table and its compressed streams (docs/format.md section 2)."""
    _, _, hlen = struct.unpack_from("<4sB3xI", payload)
    records, table = msgpack.unpackb(zstandard.decompress(payload[12 : 12 + hlen]))
    comps, off = [], 12 + hlen
    for _, _, comp_len in table:
        comps.append(payload[off : off + comp_len])
        off += comp_len
    return records, table, comps


def _join(payload: bytes, records: Any, table: Any, comps: list[bytes]) -> bytes:
    """The payload rebuilt around new streams (its first 8 bytes kept, the header's size redeclared)."""
    hz = zstandard.compress(msgpack.packb([records, table]))
    return payload[:8] + struct.pack("<I", len(hz)) + hz + b"".join(comps)


def with_bits_flipped(payload: bytes, flips: list[int]) -> bytes:
    """The payload with bits of its decompressed ``bits`` stream flipped (recompressed, sizes redeclared):
    reaches the context decoder's own checks, past zstd and the container's."""
    records, table, comps = _split(payload)
    i = [name for name, _, _ in table].index("bits")
    raw = bytearray(zstandard.ZstdDecompressor().decompress(comps[i], max_output_size=1 << 20))
    for f in {f % (8 * len(raw)) for f in flips}:  # distinct bits: two flips of one bit would cancel
        raw[f >> 3] ^= 1 << (f & 7)
    comps[i] = zstandard.compress(bytes(raw))
    table[i][2] = len(comps[i])
    return _join(payload, records, table, comps)


def with_stream_tail(payload: bytes, name: str, tail: bytes, *, declared: bool = True) -> bytes:
    """The payload with ``tail`` appended to its decompressed stream ``name`` (recompressed; its raw size
    redeclared, or with ``declared`` False kept, the frame without a content size): every record
    decodes as before, and the payload is refused only at its end (the reader's last check, that each
    stream is consumed exactly), after every record was decoded."""
    records, table, comps = _split(payload)
    i = [n for n, _, _ in table].index(name)
    raw = zstandard.ZstdDecompressor().decompress(comps[i], max_output_size=table[i][1]) + tail
    comps[i] = zstandard.ZstdCompressor(write_content_size=declared).compress(raw)
    table[i][1], table[i][2] = len(raw) - (0 if declared else len(tail)), len(comps[i])
    return _join(payload, records, table, comps)


@contextmanager
def ctx_sizes(block: int, batch: int, on_cpu: bool = False) -> Iterator[None]:
    """Small blocks and batches (several of each in a small tensor); ``on_cpu``: CPU bases take the torch pass."""
    saved = context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, context_pass_torch.ON_CPU
    context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, context_pass_torch.ON_CPU = block, batch, on_cpu
    try:
        yield
    finally:
        context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, context_pass_torch.ON_CPU = saved


def decode_positions(raw: bytes, spec: TensorSpec, k: int, base: np.ndarray, device: str | None) -> str | np.ndarray:
    """The positions one pass decodes from the bit stream ``raw`` (numpy's with ``device`` None), or its error."""
    reader = StreamReader([("bits", len(raw), memoryview(zstandard.compress(raw)))])
    try:
        if device is None:
            got = context_coding.read_ctx_positions(reader, spec, k, base)
        else:
            words = torch.from_numpy(base).to(device)
            pos = context_pass_torch.read_ctx_positions_torch(reader, spec, k, words)
            assert pos.device == words.device and pos.dtype == torch.int64
            got = pos.cpu().numpy()
        reader.finish()
    except PatchswarmError as exc:
        return f"{type(exc).__name__}: {exc}"
    return got

"""What a record's new values are (protocol/codec.py, docs/format.md): a float's steps along the
ordered line (SPARSE_ULP: a sign bit, a big bit, a magnitude byte, the escapes' raw words), raw
words (SPARSE_RAW), and the dense byte planes (XOR, FULL), written and read slice by slice; and
applying a record's ULP steps to CPU words in slices that run in parallel."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from patchswarm.protocol import ordered
from patchswarm.protocol.context_coding import MANTISSA, ctx_fields, field_bits, read_ctx_positions
from patchswarm.protocol.context_pass_torch import ctx_fields_torch, read_ctx_positions_torch, use_torch_pass
from patchswarm.protocol.diffscan import Changes
from patchswarm.protocol.patch_format import Encoding, TensorUpdate
from patchswarm.protocol.position_coding import _read_positions, gap_fields
from patchswarm.protocol.served import TensorSpec, word_view
from patchswarm.protocol.streams import Fields, Piece, StreamReader, StreamWriter, compressed_size, le_words

MAG_ESCAPE = 255
# Dense encodings are written in slices of this many elements to bound temporary memory.
SLICE = 1 << 24


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


def _sparse_pieces(
    spec: TensorSpec, ch: Changes, base: torch.Tensor | None = None
) -> tuple[Encoding, dict[str, list[Piece]]]:
    """A sparse record's pieces; with ``base`` (a float tensor's flat bytes, payload format 2), its
    positions are coded under contexts (SPARSE_CTX) where that takes fewer bits than plain gaps."""
    pieces: dict[str, list[Piece]] = {}
    pos = ch.positions.cpu().numpy()
    bits = gap_fields(spec.numel, pos)
    enc = Encoding.SPARSE_ULP
    if base is not None and spec.dtype in MANTISSA:
        if use_torch_pass(base):  # the context pass where the base lives: no host copy of it
            ctx = ctx_fields_torch(spec, word_view(base, spec), pos)
        else:
            ctx = ctx_fields(spec, word_view(base, spec).numpy(), pos)
        if ctx is not None and field_bits(ctx) < field_bits(bits):
            bits, enc = ctx, Encoding.SPARSE_CTX
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
    return enc, pieces


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: the one door of the dense paths' device-to-host copies (none on a CPU)."""
    return t if t.device.type == "cpu" else t.cpu()


def _dense_pieces(prefix: str, spec: TensorSpec, bdata: torch.Tensor, tdata: torch.Tensor) -> dict[str, list[Piece]]:
    pieces: dict[str, list[Piece]] = {}
    a, b = word_view(bdata, spec), word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        _planes(prefix, to_host(a[s : s + SLICE] ^ b[s : s + SLICE]).numpy(), pieces)
    return pieces


def _full_size(spec: TensorSpec, tdata: torch.Tensor, level: int) -> int:
    """Compressed size of the FULL planes of ``tdata`` (host memory: the caller copies it once)."""
    pieces: dict[str, list[Piece]] = {}
    words = word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        _planes("full", words[s : s + SLICE].numpy(), pieces)
    return compressed_size(pieces, level)


def _write_full(writer: StreamWriter, spec: TensorSpec, tdata: torch.Tensor) -> Encoding:
    words = word_view(tdata, spec)
    for s in range(0, spec.numel, SLICE):
        part = words[s : s + SLICE]  # an anchor's device tensor crosses here, a slice at a time
        writer.write_planes("full", (part if part.device.type == "cpu" else to_host(part)).numpy())
    return Encoding.FULL


@dataclass(frozen=True, slots=True)
class _UlpSteps:
    """A decoded SPARSE_ULP record, before the base is read: where, and how many steps."""

    index: int
    positions: np.ndarray | torch.Tensor  # int64, ascending (a tensor on a device base's device, else numpy)
    steps: np.ndarray  # signed steps along the ordered line (int32 for widths <= 2, else int64)
    escaped: np.ndarray  # indices into positions whose new words are stored raw, ascending
    escaped_words: np.ndarray  # those new words


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
        # (read-only planes, a one-byte dtype's, are copied: torch maps no read-only array)
        part = torch.from_numpy(planes if planes.flags.writeable else planes.copy()).to(device)
        if base is not None:
            part ^= base[s : s + n]
        words[s : s + n] = part
    return out


def _read_ulp(
    reader: StreamReader, spec: TensorSpec, index: int, k: int, base: torch.Tensor | None = None
) -> _UlpSteps:
    """A SPARSE_ULP record, or with ``base`` (the verified base tensor) a SPARSE_CTX record."""
    pos: np.ndarray | torch.Tensor
    if base is None:
        pos = _read_positions(reader, spec, k)
    elif use_torch_pass(base):  # the context pass where the base lives: no host copy of it
        pos = read_ctx_positions_torch(reader, spec, k, word_view(base, spec))
        if pos.device.type == "cpu":
            pos = pos.numpy()
    else:
        pos = read_ctx_positions(reader, spec, k, word_view(base, spec).numpy())
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
    pos = (u.positions if isinstance(u.positions, torch.Tensor) else torch.from_numpy(u.positions)).to(device)
    old = word_view(bdata, spec)[pos]
    new = ordered.from_ordered_key(
        ordered.ordered_key(old, w) + torch.from_numpy(u.steps).to(device), w, spec.dt.word_dtype
    )
    if u.escaped.size:
        new[torch.from_numpy(u.escaped).to(device)] = torch.from_numpy(u.escaped_words.copy()).to(device)
    return TensorUpdate(u.index, Encoding.SPARSE_ULP, pos, new)


# Changes applied per step of the CPU path: the cache lines read stay cached until written back.
APPLY_CHUNK = 1 << 15


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

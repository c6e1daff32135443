"""BLAKE3 in torch ops: digests computed where the weights live.

BLAKE3 (the reference spec's constants) in torch ops, so a GPU store's digests are computed on the
GPU: no copy of the model to the host.  32-bit words are held in int64 and masked (well defined
on every device); the four G functions of a round's half run as one op over rows of 4 words, and
many 1 KiB chunks (of every tensor) are compressed side by side.  Equal to ``blake3.blake3``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_M32 = 0xFFFFFFFF
_START, _END, _PARENT, _ROOT = 1, 2, 4, 8
_CHUNK = 1024


def _schedule() -> list[tuple[list[int], list[int], list[int], list[int]]]:
    sigma, out = list(range(16)), []
    for _ in range(7):
        out.append((sigma[0:8:2], sigma[1:8:2], sigma[8:16:2], sigma[9:16:2]))
        sigma = [sigma[p] for p in _PERM]
    return out


_SCHEDULE = _schedule()


def _rotr(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x >> n) | (x << (32 - n))) & _M32


def _g(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, mx: torch.Tensor, my: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = (a + b + mx) & _M32
    d = _rotr(d ^ a, 16)
    c = (c + d) & _M32
    b = _rotr(b ^ c, 12)
    a = (a + b + my) & _M32
    d = _rotr(d ^ a, 8)
    c = (c + d) & _M32
    b = _rotr(b ^ c, 7)
    return a, b, c, d


def _compress(
    h: torch.Tensor, m: torch.Tensor, counter: torch.Tensor, blen: torch.Tensor, flags: torch.Tensor
) -> torch.Tensor:
    """BLAKE3's compression of ``B`` blocks side by side: h [8, B], m [16, B] -> the 8 output words [8, B]."""
    n = h.shape[1]
    a, b = h[0:4], h[4:8]
    c = torch.tensor(_IV[0:4], dtype=torch.int64, device=h.device).unsqueeze(1).expand(4, n)
    d = torch.stack([counter & _M32, counter >> 32, blen.expand(n), flags.expand(n)])
    for mx, my, dx, dy in _SCHEDULE:
        a, b, c, d = _g(a, b, c, d, m[mx], m[my])
        a, b, c, d = _g(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0), m[dx], m[dy])
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return torch.cat([a ^ c, b ^ d])


# Scratch bound on a GPU (docs/weightstore.md): an engine leaves the daemon little GPU memory.
GPU_SCRATCH = 1300 << 20
CHUNK_SCRATCH = 6 << 10  # bytes per 1 KiB chunk compressed side by side, at the peak (measured: 5.4 KiB)
TREE_SCRATCH = 2 << 10  # bytes per parent node of a tree pass, at the peak (measured: 1.8 KiB)
CV_BYTES = 32  # one chaining value (8 words, stored as int32) per 1 KiB chunk, kept for the tree


def default_batch(total_chunks: int, device: torch.device) -> int:
    """Chunks per pass: 2**16 on a CPU; on a GPU the most (a power of two, 2**14 to 2**18) that keeps
    the chaining values plus one pass's scratch within ``GPU_SCRATCH`` where the store allows it."""
    if device.type == "cpu":
        return 1 << 16
    room = max(GPU_SCRATCH - CV_BYTES * total_chunks, 0) // CHUNK_SCRATCH
    return 1 << min(18, max(14, room.bit_length() - 1))


def scratch_bound(total_bytes: int, tensors: int, batch_chunks: int) -> int:
    """Most scratch ``device_digests`` allocates on the tensors' device (bytes): the chaining values
    of every chunk (1/32 of the data) and one pass of ``batch_chunks`` chunks (a tree pass of as
    many parent nodes needs less)."""
    chunks = total_bytes // _CHUNK + tensors
    return CV_BYTES * chunks + CHUNK_SCRATCH * batch_chunks + (64 << 10)


def device_digests(tensors: list[torch.Tensor], batch_chunks: int | None = None) -> list[bytes]:
    """BLAKE3-256 of each flat uint8 tensor, computed on the tensors' device (one device for all).

    ``batch_chunks`` 1 KiB chunks (or parent nodes) are compressed per pass, about 5.4 KiB of scratch
    each at the peak, besides 32 bytes per chunk for the chaining values: ``scratch_bound``.
    """
    if not tensors:
        return []
    dev = tensors[0].device
    lens = [int(t.numel()) for t in tensors]
    counts = [max(1, -(-n // _CHUNK)) for n in lens]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(starts[-1])
    if batch_chunks is None:
        batch_chunks = default_batch(total, dev)
    owner = np.repeat(np.arange(len(tensors)), counts)
    index = np.arange(total, dtype=np.int64) - starts[owner]  # chunk counter within its tensor
    clen = np.minimum(_CHUNK, np.asarray(lens, dtype=np.int64)[owner] - index * _CHUNK)
    nblocks = np.maximum(1, -(-clen // 64))
    single = np.asarray(counts)[owner] == 1
    iv = torch.tensor(_IV, dtype=torch.int64, device=dev).unsqueeze(1)
    # Chaining values of every chunk, as int32 (the words' low 32 bits): compacted in place below.
    cvs = torch.empty((8, total), dtype=torch.int32, device=dev)
    for g0 in range(0, total, batch_chunks):
        g1 = min(total, g0 + batch_chunks)
        buf = torch.zeros((g1 - g0) * _CHUNK, dtype=torch.uint8, device=dev)
        for i in range(int(owner[g0]), int(owner[g1 - 1]) + 1):
            c0, c1 = max(int(starts[i]), g0), min(int(starts[i + 1]), g1)
            lo, hi = (c0 - int(starts[i])) * _CHUNK, min((c1 - int(starts[i])) * _CHUNK, lens[i])
            if hi > lo:
                buf[(c0 - g0) * _CHUNK : (c0 - g0) * _CHUNK + hi - lo].copy_(tensors[i][lo:hi])
        words = (buf.view(torch.int32).to(torch.int64) & _M32).view(g1 - g0, 16, 16)
        del buf
        nb = torch.from_numpy(nblocks[g0:g1]).to(dev)
        last = torch.from_numpy(clen[g0:g1] - 64 * (nblocks[g0:g1] - 1)).to(dev)
        root = torch.from_numpy(single[g0:g1]).to(dev)
        counter = torch.from_numpy(index[g0:g1]).to(dev)
        h = iv.expand(8, g1 - g0)
        for j in range(int(nblocks[g0:g1].max())):
            end = nb == j + 1
            flags = (_START if j == 0 else 0) + _END * end + _ROOT * (end & root)
            m = words[:, j, :].T.contiguous()  # [16, B]: the row gathers below then read contiguous memory
            out = _compress(h, m, counter, torch.where(end, last, 64), flags)
            h = torch.where(nb > j, out, h)
        del words
        cvs[:, g0:g1] = h.to(torch.int32)
    _tree(cvs, counts, batch_chunks, iv)
    final = (cvs[:, : len(tensors)].to(torch.int64) & _M32).cpu().T.tolist()  # one copy back: 32 bytes a tensor
    return [struct.pack("<8I", *words) for words in final]


def _tree(level: torch.Tensor, counts: list[int], batch: int, iv: torch.Tensor) -> None:
    """Parent nodes, level by level, ``batch`` at a time, written over ``level`` in place, until
    column i holds tensor i's root.  Each level pairs adjacent nodes of a tensor, an odd last one
    carried up (the same tree as BLAKE3's left-complete one).  Node e of the next level is built
    from nodes e' >= e of this one, and a pass gathers before it writes: no pass overwrites a node
    a later pass still reads."""
    dev = level.device
    cur = list(counts)
    while any(c > 1 for c in cur):
        offs = np.concatenate([[0], np.cumsum(cur)]).astype(np.int64)
        src, pair, root = [], [], []
        for i, c in enumerate(cur):
            src.append(offs[i] + 2 * np.arange(c // 2))
            pair.append(np.ones(c // 2, dtype=bool))
            root.append(np.full(c // 2, c == 2))
            if c % 2:
                src.append(np.array([offs[i] + c - 1]))
                pair.append(np.zeros(1, dtype=bool))
                root.append(np.zeros(1, dtype=bool))
        s_all, p_all, r_all = np.concatenate(src), np.concatenate(pair), np.concatenate(root)
        width = level.shape[1]
        for b0 in range(0, len(s_all), batch):
            b1 = min(len(s_all), b0 + batch)
            s = torch.from_numpy(s_all[b0:b1]).to(dev)
            left = level[:, s].to(torch.int64) & _M32
            right = level[:, (s + 1).clamp(max=width - 1)].to(torch.int64) & _M32
            flags = torch.from_numpy(np.where(r_all[b0:b1], _PARENT | _ROOT, _PARENT)).to(dev)
            zero = torch.zeros(b1 - b0, dtype=torch.int64, device=dev)
            parents = _compress(
                iv.expand(8, b1 - b0), torch.cat([left, right]), zero, torch.tensor(64, device=dev), flags
            )
            is_pair = torch.from_numpy(p_all[b0:b1]).to(dev)
            level[:, b0:b1] = torch.where(is_pair, parents, left).to(torch.int32)
        cur = [c // 2 + c % 2 for c in cur]

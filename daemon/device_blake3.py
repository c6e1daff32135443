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


def device_digests(tensors: list[torch.Tensor], batch_chunks: int | None = None) -> list[bytes]:
    """BLAKE3-256 of each flat uint8 tensor, computed on the tensors' device (one device for all).

    ``batch_chunks`` 1 KiB chunks are compressed per pass, about 5 KiB of scratch memory each at
    the peak (default 2**18, about 1.3 GiB: an engine leaves the daemon little GPU memory).
    """
    if not tensors:
        return []
    dev = tensors[0].device
    if batch_chunks is None:
        batch_chunks = 1 << 16 if dev.type == "cpu" else 1 << 18
    lens = [int(t.numel()) for t in tensors]
    counts = [max(1, -(-n // _CHUNK)) for n in lens]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(starts[-1])
    owner = np.repeat(np.arange(len(tensors)), counts)
    index = np.arange(total, dtype=np.int64) - starts[owner]  # chunk counter within its tensor
    clen = np.minimum(_CHUNK, np.asarray(lens, dtype=np.int64)[owner] - index * _CHUNK)
    nblocks = np.maximum(1, -(-clen // 64))
    single = np.asarray(counts)[owner] == 1
    iv = torch.tensor(_IV, dtype=torch.int64, device=dev).unsqueeze(1)
    cvs = torch.empty((8, total), dtype=torch.int64, device=dev)
    for g0 in range(0, total, batch_chunks):
        g1 = min(total, g0 + batch_chunks)
        buf = torch.zeros((g1 - g0) * _CHUNK, dtype=torch.uint8, device=dev)
        for i in range(int(owner[g0]), int(owner[g1 - 1]) + 1):
            c0, c1 = max(int(starts[i]), g0), min(int(starts[i + 1]), g1)
            lo, hi = (c0 - int(starts[i])) * _CHUNK, min((c1 - int(starts[i])) * _CHUNK, lens[i])
            if hi > lo:
                buf[(c0 - g0) * _CHUNK : (c0 - g0) * _CHUNK + hi - lo].copy_(tensors[i][lo:hi])
        words = (buf.view(torch.int32).to(torch.int64) & _M32).view(g1 - g0, 16, 16)
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
        cvs[:, g0:g1] = h
    # Parents, level by level: adjacent pairs of each tensor's nodes, an odd last one carried up
    # (the same tree as BLAKE3's left-complete one).
    level, cur = cvs, list(counts)
    while True:
        offs = np.concatenate([[0], np.cumsum(cur)]).astype(np.int64)
        busy = [i for i, c in enumerate(cur) if c > 1]
        if not busy:
            break
        left = np.concatenate([offs[i] + 2 * np.arange(cur[i] // 2) for i in busy])
        roots = np.concatenate([np.full(cur[i] // 2, cur[i] == 2) for i in busy])
        lt = torch.from_numpy(left).to(dev)
        m = torch.cat([level[:, lt], level[:, lt + 1]])
        flags = torch.from_numpy(np.where(roots, _PARENT | _ROOT, _PARENT)).to(dev)
        zero = torch.zeros(len(left), dtype=torch.int64, device=dev)
        parents = _compress(iv.expand(8, len(left)), m, zero, torch.tensor(64, device=dev), flags)
        # Next level: per tensor its parents, then its carried node (indices into [parents | level]).
        idx, nxt, p = [], [], 0
        for i, c in enumerate(cur):
            if c == 1:
                idx.append(np.array([len(left) + offs[i]]))
                nxt.append(1)
                continue
            idx.append(np.arange(p, p + c // 2))
            p += c // 2
            if c % 2:
                idx[-1] = np.append(idx[-1], len(left) + offs[i] + c - 1)
            nxt.append(c // 2 + c % 2)
        level = torch.cat([parents, level], dim=1)[:, torch.from_numpy(np.concatenate(idx)).to(dev)]
        cur = nxt
    final = level.cpu().tolist()
    return [struct.pack("<8I", *(final[k][i] for k in range(8))) for i in range(len(tensors))]

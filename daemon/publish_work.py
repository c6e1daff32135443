"""The per-tensor work of publishing a version, on a small worker pool.

One worker per core takes a tensor and walks it in cache-sized blocks: cast the FP32 master
weights into a recycled served buffer, compare with the previous version, hash with BLAKE3, and
code the changes while the block is still in cache.  The Publisher (single trainer) and
ShardedPublish (one rank's shard) both run their tensors through :func:`prepare`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass

import blake3
import numpy as np
import torch

from patchswarm.daemon.served_format import ServedFormat, check_fp16
from patchswarm.protocol.codec import TensorDelta, diff_tensor
from patchswarm.protocol.diffscan import Changes
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, word_view


def state_dict_of(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(model_or_state, torch.nn.Module):
        return model_or_state.state_dict()
    return model_or_state


# Per-tensor work (cast, scan, hash, sparse coding) runs on this many worker threads, one tensor
# each: the work is CPU-bound (about 8 memcpys' worth per served byte), so it scales with cores
# until memory bandwidth runs out.
# The CPUs this process may run on (taskset, systemd's CPUAffinity), not all the host has.
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
WORKERS = max(1, min(8, _CPUS))
# The fused loop works in blocks of this many bytes of served data: a block's source, served
# bytes and base (2 + 4 + 2 MiB for bf16 from fp32) stay in cache from the cast to the hash.
BLOCK_BYTES = 1 << 21


class BlockScan:
    """Changed elements of one CPU tensor, found block by block while the target block is in cache.

    Each block compares 64-bit words into a mask (scratch of the worker thread, reused) and
    gathers the changed words, old and new, from the cached block; which lanes of those words
    differ is looked at once per tensor, at the end.  Same result as ``diffscan.scan``, with few
    numpy calls per block: called on every block, ``scan`` cost more in calls than in work.
    """

    _local = threading.local()

    def __init__(self, base: torch.Tensor, target: torch.Tensor, spec: TensorSpec) -> None:
        self.el_base = word_view(base, spec).numpy()
        self.el_target = word_view(target, spec).numpy()
        self.lanes = 8 // spec.dt.width
        self.nwords = spec.numel // self.lanes
        self.w_base = base.numpy()[: self.nwords * 8].view(np.int64)
        self.w_target = target.numpy()[: self.nwords * 8].view(np.int64)
        self.words: list[np.ndarray] = []
        self.old: list[np.ndarray] = []
        self.new: list[np.ndarray] = []
        self.tail: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # changes past the last word

    @classmethod
    def _mask(cls, n: int) -> np.ndarray:
        m: np.ndarray | None = getattr(cls._local, "mask", None)
        if m is None or m.size < n:
            m = np.empty(max(n, BLOCK_BYTES // 8), dtype=np.bool_)
            cls._local.mask = m
        return m[:n]

    def block(self, start: int, end: int) -> bool:
        """Scan elements [start, end) (start a multiple of 8); True when something in it changed."""
        lo, hi = start // self.lanes, min(end // self.lanes, self.nwords)
        if hi <= lo:
            return self._tail(start, end)
        x, y = self.w_base[lo:hi], self.w_target[lo:hi]
        words = np.not_equal(x, y, out=self._mask(hi - lo)).nonzero()[0]
        if words.size == 0:
            return self._tail(start, end)
        self.old.append(x.take(words))
        self.new.append(y.take(words))
        words += lo
        self.words.append(words)
        self._tail(start, end)
        return True

    def _tail(self, start: int, end: int) -> bool:
        """Elements past the last whole 64-bit word, if [start, end) reaches them."""
        tail = max(start, self.nwords * self.lanes)
        if end <= tail:
            return False
        a, b = self.el_base[tail:end], self.el_target[tail:end]
        t = (a != b).nonzero()[0]
        if t.size == 0:
            return False
        self.tail = (t + tail, a.take(t), b.take(t))
        return True

    def changes(self) -> Changes:
        el = self.el_base.dtype
        pos = np.empty(0, dtype=np.int64)
        old = new = self.el_target[:0]
        if self.words:
            w = np.concatenate(self.words)
            old = np.concatenate(self.old).view(el)
            new = np.concatenate(self.new).view(el)
            if self.lanes == 1:
                pos = w
            else:
                hit = np.not_equal(old, new).nonzero()[0]
                shift = self.lanes.bit_length() - 1
                pos = w.take(hit >> shift)
                pos <<= shift
                pos |= hit & (self.lanes - 1)
                old, new = old.take(hit), new.take(hit)
        if self.tail is not None:
            pos, old, new = (np.concatenate([p, q]) for p, q in zip((pos, old, new), self.tail, strict=True))
        return Changes(torch.from_numpy(pos), torch.from_numpy(old), torch.from_numpy(new))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def work_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:  # ranks may ask for it at the same time
        if _pool is None:
            _pool = new_work_pool()
        return _pool


def new_work_pool() -> ThreadPoolExecutor:
    """Workers that run torch ops on one thread each (the workers already use every core).

    ``torch.set_num_threads`` sets the calling thread's OpenMP thread count and a process-wide
    default for threads that have not used torch yet; each worker sets 1 for itself, then the
    caller puts the default back, before any work is submitted.
    """
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="publish")
    threads = torch.get_num_threads()
    if threads > 1:
        barrier = threading.Barrier(WORKERS + 1)

        def single() -> None:
            torch.get_num_threads()  # torch's lazy per-thread setup first, or it would undo the next line
            torch.set_num_threads(1)
            barrier.wait()

        started = [pool.submit(single) for _ in range(WORKERS)]  # all block at the barrier: one per thread
        barrier.wait()
        torch.set_num_threads(threads)
        for f in started:
            f.result()
    return pool


class Stages:
    """Accumulates stage seconds; safe to add to from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t)


class Buffers:
    """Served buffers of a version no longer needed, reused by the next cast (no fresh pages)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[str, torch.Tensor] = {}  # name -> flat uint8

    def take(
        self, name: str, dtype: torch.dtype, shape: torch.Size, device: torch.device, pinned: bool = False
    ) -> torch.Tensor:
        """A buffer for ``name``: the one handed back if it fits, else a new one (``pinned``: page-locked
        host memory, which copies from a GPU fill at full PCIe speed)."""
        with self._lock:
            flat = self._free.pop(name, None)
        nbytes = shape.numel() * dtype.itemsize
        if flat is None or flat.numel() != nbytes or flat.device != device or nbytes == 0 or flat.is_pinned() != pinned:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)
        return flat.view(dtype).view(shape)

    def give(self, model: ServedModel) -> None:
        """Hand back every buffer of ``model``, which nothing may use any more."""
        with self._lock:
            self._free = dict(zip((s.name for s in model.specs), model.data, strict=True))


@dataclass(slots=True)
class Served:
    """A served copy: the model (its buffers allocated) and the casts into them not yet done.

    The workers cast each tensor block by block, right before scanning and hashing the block
    (``tensor_work``); background mode casts everything up front, before ``publish`` returns.
    """

    model: ServedModel
    owned: bool  # the buffers are the publisher's own: reusable once this version is replaced
    pending: list[tuple[torch.Tensor, torch.Tensor] | None]  # per tensor: (buffer, source) still to copy

    def fill(self, i: int) -> None:
        p = self.pending[i]
        if p is not None:
            fill_buffer(*p)
            self.pending[i] = None

    def fill_all(self) -> None:
        for i in range(len(self.pending)):
            self.fill(i)


def fill_buffer(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, casting on ``src``'s device first when the copy crosses devices: a GPU's
    FP32 masters then send only their served bytes over PCIe (a bare cross-device ``copy_`` with a
    dtype change took 3.3-3.4 s to publish a 1B model on an H200 host, against 0.30 s: docs/benchmarks.md)."""
    with torch.no_grad():
        if src.device != dst.device and src.dtype != dst.dtype:
            src = src.to(dst.dtype)
        dst.copy_(src)


def cast_served(fmt: ServedFormat, state: Mapping[str, torch.Tensor], buffers: Buffers, on_host: bool = True) -> Served:
    """The served copy of ``state``, its casts left pending (see :class:`Served`).

    bf16, fp16 and as_is cast tensor by tensor into recycled buffers (bitwise what
    ``ServedFormat.convert`` returns: ``Tensor.to`` is ``copy_`` into a fresh tensor); fp8 goes
    through ``convert`` (scales), at once.  The copy is always taken, even when a tensor already
    has the served dtype, so later in-place updates of the weights never reach a published version.

    ``on_host``: the served copy of GPU weights lives in pinned host buffers.  The cast runs on the
    GPU (:func:`fill_buffer`), so only served bytes cross PCIe; the digests need those bytes on the
    host anyway (BLAKE3 on the host's cores), and the host's fused scan compares them with the
    version before while they are in cache.  On an H200 host a 1B model publishes in 0.30 s this
    way, 1.7 s diffing on the GPU (docs/benchmarks.md).
    """
    host = torch.device("cpu")
    if fmt.name not in ("bf16", "fp16", "as_is"):
        with torch.no_grad():
            converted = fmt.convert(state)
        if not on_host or all(t.device.type == "cpu" for t in converted.values()):
            model = ServedModel.from_tensors(converted)
            return Served(model, False, [None] * len(model))
        out = {n: buffers.take(n, t.dtype, t.shape, host, pinned=t.is_cuda) for n, t in converted.items()}
        model = ServedModel.from_tensors(out)
        return Served(model, True, [(out[s.name], converted[s.name]) for s in model.specs])
    fmt.refreshed = []
    served_float = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt.name)
    out = {}
    sources: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach()
        if fmt.name == "fp16" and t.is_floating_point():
            check_fp16(name, t)  # an extra read of the masters, fp16 only: inf is never served silently
        dtype = served_float if served_float is not None and t.is_floating_point() else t.dtype
        where = host if on_host else t.device
        out[name] = buffers.take(name, dtype, t.shape, where, pinned=on_host and t.is_cuda)
        sources[name] = t
    model = ServedModel.from_tensors(out)
    return Served(model, True, [(out[s.name], sources[s.name]) for s in model.specs])


def tensor_work(
    spec: TensorSpec,
    data: torch.Tensor,
    cast: tuple[torch.Tensor, torch.Tensor] | None,
    base: torch.Tensor | None,
    base_digest: bytes | None,
    level: int,
    stages: Stages,
    payload_format: int = DEFAULT_FORMAT,
) -> tuple[TensorDelta | None, bytes]:
    """One tensor's served bytes (``cast``: the copy still to do), delta against ``base`` (coded for
    ``payload_format``: see protocol/codec.py diff_tensor) and digest.

    On the CPU this is one pass over the tensor in blocks: cast a block, scan it against the
    base's block, hash it, while the block is in cache.  Hashing starts at the first changed
    block (the unchanged blocks before it are hashed then); a tensor with no change keeps
    ``base_digest`` without being hashed.  Elsewhere (another device, a strided source) the same
    steps run on the whole tensor.
    """
    clock = time.perf_counter
    cast_s = scan_s = hash_s = 0.0
    if cast is not None and not (cast[1].device.type == cast[0].device.type == "cpu" and cast[1].is_contiguous()):
        t = clock()
        fill_buffer(*cast)
        cast, cast_s = None, clock() - t
    if data.device.type != "cpu":
        t = clock()
        delta = diff_tensor(spec, base, data, level, payload_format=payload_format) if base is not None else None
        t2 = clock()
        unchanged = delta is not None and delta.changed == 0
        # The encoder's host copy of a dense tensor, if it made one, is hashed: no second copy.
        host = delta.host if delta is not None and delta.host is not None else data
        digest = base_digest if unchanged and base_digest is not None else bytes_digest(host)
        stages.add("cast", cast_s)
        stages.add("diff", t2 - t)
        stages.add("digests", clock() - t2)
        return delta, digest
    width = spec.dt.width
    step = max(8, BLOCK_BYTES // width)  # elements; a multiple of 8, so blocks start on 64-bit words
    raw = data.numpy()
    src = cast[1].view(-1) if cast is not None else None
    dst = cast[0].view(-1) if cast is not None else None
    scanner = BlockScan(base, data, spec) if base is not None and spec.numel else None
    hasher = blake3.blake3() if base is None else None
    for s in range(0, spec.numel, step):
        e = min(s + step, spec.numel)
        t0 = clock()
        if src is not None and dst is not None:
            dst[s:e].copy_(src[s:e])
        t1 = clock()
        if scanner is not None and scanner.block(s, e) and hasher is None:
            hasher = blake3.blake3()
            hasher.update(raw[: s * width].data)  # the unchanged blocks so far
        t2 = clock()
        if hasher is not None:
            hasher.update(raw[s * width : e * width].data)
        t3 = clock()
        cast_s, scan_s, hash_s = cast_s + t1 - t0, scan_s + t2 - t1, hash_s + t3 - t2
    delta = None
    t = clock()
    if base is not None:
        changes = scanner.changes() if scanner is not None else None
        delta = diff_tensor(spec, base, data, level, changes=changes, payload_format=payload_format)
    scan_s += clock() - t
    if hasher is None:  # nothing changed
        assert base_digest is not None
        digest = base_digest
    else:
        t = clock()
        digest = hasher.digest()
        hash_s += clock() - t
    stages.add("cast", cast_s)
    stages.add("diff", scan_s)
    stages.add("digests", hash_s)
    return delta, digest


class Prepared:
    """Per-tensor results (delta, digest) in layout order, as the workers finish them.

    The patch is assembled from :meth:`deltas` while later tensors are still being worked on.
    """

    def __init__(
        self, jobs: list[Future[tuple[TensorDelta | None, bytes]]], has_deltas: bool, start: float | None = None
    ) -> None:
        self.jobs = jobs
        self.has_deltas = has_deltas
        self.start = time.perf_counter() if start is None else start
        self.waited = 0.0  # seconds the consumer of deltas() spent waiting for workers
        self._lock = threading.Lock()
        self.finished = self.start
        for job in jobs:
            job.add_done_callback(self._done)

    @classmethod
    def ready(cls, deltas: list[TensorDelta] | None, digests: list[bytes]) -> Prepared:
        jobs: list[Future[tuple[TensorDelta | None, bytes]]] = []
        for i, d in enumerate(digests):
            f: Future[tuple[TensorDelta | None, bytes]] = Future()
            f.set_result((deltas[i] if deltas is not None else None, d))
            jobs.append(f)
        return cls(jobs, deltas is not None)

    def _done(self, _: object) -> None:
        with self._lock:
            self.finished = max(self.finished, time.perf_counter())

    def _result(self, i: int) -> tuple[TensorDelta | None, bytes]:
        t = time.perf_counter()
        r = self.jobs[i].result()
        self.waited += time.perf_counter() - t
        return r

    def deltas(self) -> Iterator[TensorDelta]:
        for i in range(len(self.jobs)):
            d = self._result(i)[0]
            assert d is not None
            yield d

    def digests(self) -> list[bytes]:
        return [self._result(i)[1] for i in range(len(self.jobs))]

    def settle(self) -> None:
        """Wait for every job (after a failure: nothing may still read the caller's tensors)."""
        wait(self.jobs)

    @property
    def seconds(self) -> float:
        """Wall time from the first submission until the last tensor was done (call after digests())."""
        return self.finished - self.start


def prepare(
    base: ServedModel | None,
    base_digests: list[bytes] | None,
    target: Served,
    stages: Stages,
    level: int = 3,
    payload_format: int = DEFAULT_FORMAT,
) -> Prepared:
    """Cast, diff against ``base`` (None: no base, or a different layout) and hash, tensor by tensor,
    on the worker pool, in layout order."""
    start = time.perf_counter()
    model = target.model
    usable = base is not None and base.specs == model.specs and base_digests is not None
    jobs: list[Future[tuple[TensorDelta | None, bytes]]] = []
    for i, (spec, data) in enumerate(model):
        cast, target.pending[i] = target.pending[i], None
        b = base.data[i] if usable and base is not None else None
        bd = base_digests[i] if usable and base_digests is not None else None
        jobs.append(work_pool().submit(tensor_work, spec, data, cast, b, bd, level, stages, payload_format))
    return Prepared(jobs, usable, start)


def prepare_all(
    base: ServedModel | None,
    base_digests: list[bytes] | None,
    target: Served,
    stages: Stages,
    payload_format: int = DEFAULT_FORMAT,
) -> tuple[list[TensorDelta] | None, list[bytes]]:
    """``prepare`` run to the end: every tensor's delta (None without a base to diff against) and
    digest; the worker threads are settled before an error leaves."""
    prepared = prepare(base, base_digests, target, stages, payload_format=payload_format)
    try:
        deltas = list(prepared.deltas()) if prepared.has_deltas else None
        digests = prepared.digests()
    except BaseException:
        prepared.settle()
        raise
    stages.add("prepare", prepared.seconds)
    return deltas, digests

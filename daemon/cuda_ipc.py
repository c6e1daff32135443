"""One CUDA IPC handle per engine buffer: its own allocator segment, no torch IPC reference count.

Imported by engines (through daemon/engine.py) and by the daemon; needs only torch.  Three rules,
each a finding of the CUDA review (docs/weightstore.md, "CUDA buffers"):

- A CUDA IPC handle names a whole ``cudaMalloc`` allocation, not a tensor (torch's Note "CUDA IPC
  and the caching allocator", torch/multiprocessing/reductions.py).  A buffer carved from a cached
  block, or sharing a segment, would expose the engine's other tensors to the daemon.  So the
  engine allocates each store buffer in a private memory pool (``allocate_own_segment``) and
  ``export_handle`` refuses a tensor that is not the one block of its segment
  (``segment_violation``, pure logic over ``torch.cuda.memory_snapshot()``).
- torch counts a producer's shares in a shared-memory file (torch/csrc/CudaIPCTypes.cpp): each
  ``_share_cuda_`` sets a counter to 1, each consumer storage's deleter subtracts 1, and a producer
  frees a shared block only at counter <= 0 (else it parks it in "limbo").  Successive daemons that
  import and release one stored handle drive it below zero, and a killed daemon never releases it
  (the engine's buffer is parked forever).  Here the engine owns its buffer for its lifetime: it
  gives its own count back right after the export, and the daemon imports with a counter name that
  ``shm_open`` always refuses (``NO_REF_COUNTER``: a name with an inner slash), so its release
  touches no producer's counter.  Nothing pins or frees engine memory across processes.
- No IPC event: the engine synchronizes its device before the export (the buffer is fresh), so
  the importer opens no event handle (each open would leak one in the daemon).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests of 10 MiB and more get a
# segment of the request rounded up to 2 MiB; smaller large requests a 20 MiB segment.
ROUND_LARGE = 2 << 20
MIN_OWN_SEGMENT = 20 << 20
# A counter name shm_open refuses (EINVAL: "/" inside the name), so a release is a no-op.
NO_REF_COUNTER = b"/patchswarm/no-ipc-ref-counter"
MAX_HANDLE_BYTES = 1024  # torch's handle string: a type byte + a 64-byte cudaIpcMemHandle_t today


class IpcError(Exception):
    """A CUDA buffer that cannot be exported or imported as one handle; the message is one line."""


def own_segment_bytes(nbytes: int) -> int:
    """Bytes to request so the caching allocator's segment is exactly the request."""
    return max(MIN_OWN_SEGMENT, -(-max(nbytes, 1) // ROUND_LARGE) * ROUND_LARGE)


def segment_violation(ptr: int, nbytes: int, segments: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the ``nbytes`` at ``ptr`` are not the whole of their own allocator segment (None: they are).

    ``segments`` is ``torch.cuda.memory_snapshot()``: a CUDA IPC handle exports the whole segment
    holding ``ptr``, so it must start at ``ptr``, hold exactly one block (this buffer, allocated)
    and nothing past the buffer's block; an expandable segment maps many allocations.
    """
    for seg in segments:
        start, size = int(seg["address"]), int(seg["total_size"])
        if not start <= ptr < start + size:
            continue
        if seg.get("is_expandable"):
            return "it lies in an expandable segment (PYTORCH_CUDA_ALLOC_CONF expandable_segments), shared by others"
        if ptr != start:
            return f"it starts {ptr - start} bytes into an allocator segment of {size} bytes shared with other memory"
        blocks = list(seg.get("blocks", []))
        others = [b for b in blocks if int(b["address"]) != ptr]
        if others:
            live = sum(1 for b in others if b.get("state") != "inactive")
            return f"its segment of {size} bytes holds {len(others)} other block(s) ({live} in use)"
        if nbytes > size:
            return f"it claims {nbytes} bytes but its segment holds {size}"
        return None
    return "it is not memory of torch's CUDA caching allocator"


@dataclass(frozen=True, slots=True)
class OwnBuffer:
    """A flat uint8 CUDA tensor that is the one block of its segment, and the pool that keeps it apart."""

    data: torch.Tensor
    pool: Any  # torch.cuda.MemPool (None where torch has none): keep it alive as long as ``data``


@contextlib.contextmanager
def _private_pool(device: torch.device) -> Iterator[Any]:
    pool_cls = getattr(torch.cuda, "MemPool", None)
    if pool_cls is None:  # older torch: the default pool, checked by export_handle
        yield None
        return
    try:
        pool = pool_cls(no_split=True)
    except TypeError:
        pool = pool_cls()
    with torch.cuda.use_mem_pool(pool, device):
        yield pool


def allocate_own_segment(nbytes: int, device: torch.device) -> OwnBuffer:
    """``nbytes`` (rounded up to a whole segment) of zeroed device memory in a segment of its own."""
    with _private_pool(device) as pool:
        data = torch.zeros(own_segment_bytes(nbytes), dtype=torch.uint8, device=device)
    return OwnBuffer(data, pool)


def export_handle(data: torch.Tensor, counter_out: list[tuple[bytes, int]] | None = None) -> dict[str, Any]:
    """The JSON ``args`` of a CUDA IPC handle of ``data`` (the whole of its own segment), for any process.

    ``counter_out`` (the GPU checks) receives where torch keeps this share's reference count."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or data.storage_offset() != 0:
        raise IpcError("a CUDA store buffer must be a whole flat uint8 tensor (daemon.engine.allocate)")
    storage = data.untyped_storage()
    if storage.nbytes() != data.numel():
        raise IpcError("a CUDA store buffer must cover its whole storage (daemon.engine.allocate)")
    why = segment_violation(data.data_ptr(), data.numel(), torch.cuda.memory_snapshot())  # type: ignore[no-untyped-call]
    if why is not None:
        raise IpcError(f"refusing to export this CUDA buffer: {why} (allocate it with daemon.engine.allocate)")
    torch.cuda.synchronize(data.device)  # no IPC event for the importer to wait on
    _dev, handle, size, offset, ref_handle, ref_offset, _ev, _sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
    give_back_count(ref_handle, ref_offset)
    if counter_out is not None and ref_handle:
        counter_out.append((bytes(ref_handle), int(ref_offset)))
    return {"handle": base64.b64encode(handle).decode(), "size": int(size), "offset": int(offset)}


def give_back_count(ref_handle: bytes | None, ref_offset: int) -> None:
    """The producer returns the count its ``_share_cuda_`` took, so freeing the buffer frees it
    (no limbo): the engine, not a daemon's mapping, decides how long its memory lives."""
    if ref_handle:
        torch.UntypedStorage._release_ipc_counter_cuda(ref_handle, ref_offset)


def import_args(args: Any) -> tuple[bytes, int, int]:
    """(handle, size, offset) from a handle's JSON ``args``; IpcError for anything else (hostile input)."""
    if not isinstance(args, dict) or set(args) != {"handle", "size", "offset"}:
        raise IpcError("cuda_ipc args must be {handle, size, offset} (daemon.engine.export_buffer)")
    text, size, offset = args["handle"], args["size"], args["offset"]
    if not isinstance(text, str) or len(text) > 2 * MAX_HANDLE_BYTES:
        raise IpcError("cuda_ipc args.handle must be base64 text")
    try:
        handle = base64.b64decode(text, validate=True)
    except ValueError:
        raise IpcError("cuda_ipc args.handle is not base64") from None
    if not 0 < len(handle) <= MAX_HANDLE_BYTES:
        raise IpcError("cuda_ipc args.handle has a bad length")
    for field, v in (("size", size), ("offset", offset)):
        if type(v) is not int or not 0 <= v < 1 << 62:
            raise IpcError(f"cuda_ipc args.{field} must be a non-negative integer")
    if offset != 0:
        raise IpcError("cuda_ipc args.offset must be 0: a store buffer is the whole of its segment")
    return handle, size, offset


def import_handle(args: Any, device_index: int) -> torch.Tensor:
    """Map an exported buffer in this process, without touching the producer's reference count.

    The mapping is released (``cudaIpcCloseMemHandle``) when the last tensor over it is dropped."""
    handle, size, offset = import_args(args)
    torch.cuda.init()  # type: ignore[no-untyped-call]
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index, handle, size, offset, NO_REF_COUNTER, 0, bytes(64), False
    )
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device_index))
    return out.set_(storage, 0, (size,), (1,))


def ref_counter_value(ref_handle: bytes, ref_offset: int) -> int:
    """A producer's IPC counter as torch keeps it (/dev/shm/<handle>, int64 slots): for the GPU checks."""
    path = "/dev/shm/" + ref_handle.decode().lstrip("/")
    with open(path, "rb") as fh:
        fh.seek(8 * ref_offset)
        return int.from_bytes(fh.read(8), "little", signed=True)

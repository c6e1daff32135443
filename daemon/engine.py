"""Engine side of the weight store: attach to the served weights and read the version fence.

An engine process imports this module only (no protocol/diffscan machinery): ``attach`` maps a
store from the JSON ``attach_info`` the daemon publishes and returns an ``EngineView`` of
zero-copy typed tensors plus a ``FenceReader``; ``allocate`` is for engine-owned buffers (the
GPU placement: the engine allocates one buffer, the daemon writes into it through one handle).
``daemon.engine_client.DaemonClient`` talks to the daemon's unix socket: ``open_store`` attaches,
or allocates and registers the buffer (POST /v1/store); ``wait_version`` and ``ack`` follow versions.

The store's byte format (layout, control block) is daemon/store_format.py, which both sides
import; the shared-memory segments and buffer handles are here; the writer is daemon/weightstore.py.
docs/weightstore.md describes all of it.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import mmap
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy.typing as npt
import torch

from patchswarm.daemon import cuda_ipc
from patchswarm.daemon.fence_lock import ReadGate, readers_lock_path
from patchswarm.daemon.store_format import (
    OFF_DATA,
    ControlBlock,
    Header,
    StoreError,
    StoreLayout,
    StoreLayoutMismatch,
    StoreMissingError,
    StoreState,
    StoreTooSmallError,
)
from patchswarm.protocol.served import typed_view, word_view

T = TypeVar("T")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


SEGMENT_MODE = 0o660  # owner and group: the daemon and engines in api.group


def _group_id(group: str | int) -> int:
    """A group name or gid as a gid; -1 (keep the creator's group) for ""."""
    if isinstance(group, int):
        return group
    if not group:
        return -1
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StoreError(f"api.group: no such group {group!r}") from None


def store_lock_path(name: str, shm_dir: Path | str = SHM_DIR) -> Path:
    """The file a daemon flocks to own store ``name`` (daemon.instance_lock.StoreLock; engines never
    lock it).  ValueError for a name that is not a shared-memory name."""
    return SharedSegment.path_for(name, shm_dir).with_name(f"{name}.lock")


class SharedSegment:
    """A named POSIX shared-memory segment mapped read-write; it stays until ``unlink``."""

    def __init__(self, name: str, path: Path, mm: mmap.mmap, file_id: tuple[int, int] | None = None) -> None:
        self.name = name
        self.path = path
        self.mm = mm
        # (st_dev, st_ino) of the file mapped: a segment made again under the name is another file
        self.file_id = file_id

    @staticmethod
    def path_for(name: str, shm_dir: Path | str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad shared-memory name {name!r}")
        return Path(shm_dir) / name

    @classmethod
    def create(cls, name: str, size: int, shm_dir: Path | str = SHM_DIR, group: str | int = "") -> SharedSegment:
        """Create and reserve ``size`` bytes up front (so a full /dev/shm fails here, not as SIGBUS later).

        Mode 0660, owned by ``group`` (a name or gid; empty: the creator's group), whatever the umask:
        an engine running as another user of that group attaches to it (``api.group``).
        """
        path = cls.path_for(name, shm_dir)
        gid = _group_id(group)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, SEGMENT_MODE)
        except OSError as e:
            raise StoreError(f"cannot create shared memory {path}: {e}") from e
        try:
            os.fchmod(fd, SEGMENT_MODE)
            if gid != -1:
                try:
                    os.fchown(fd, -1, gid)
                except PermissionError:
                    raise StoreError(f"api.group: cannot give {path} to group {group!r} (not a member)") from None
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.EOPNOTSUPP:  # fallocate unsupported: pages are reserved lazily
                    raise
            mm = mmap.mmap(fd, size)
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StoreError(f"cannot create shared memory {path} of {size} bytes: {e}") from e
        except StoreError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(name, path, mm, (st.st_dev, st.st_ino))

    @classmethod
    def open(cls, name: str, shm_dir: Path | str = SHM_DIR) -> SharedSegment:
        path = cls.path_for(name, shm_dir)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreMissingError(f"no shared memory named {path}") from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise StoreMissingError(f"shared memory {path} is empty (its creation never finished)")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, path, mm, (st.st_dev, st.st_ino))

    @property
    def size(self) -> int:
        return len(self.mm)

    def tensor(self, offset: int, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=count, offset=offset)

    def close(self) -> None:
        """Unmap if no view is left (views keep the mapping alive otherwise)."""
        with contextlib.suppress(BufferError):
            self.mm.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------- engine buffers (CUDA IPC, or the CPU twin)


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_buffer(data: torch.Tensor, buffer_id: int, shm_name: str | None = None) -> dict[str, Any]:
    """The JSON handle of an engine-owned flat uint8 buffer: one CUDA IPC handle, or a shm name (CPU twin).

    A CUDA buffer must be the whole of its own allocator segment (``allocate`` makes it so): the
    handle exposes the whole segment, and no other engine tensor may be in it (daemon/cuda_ipc.py)."""
    if data.device.type == "cuda":
        try:
            args = cuda_ipc.export_handle(data)
        except cuda_ipc.IpcError as e:
            raise StoreError(str(e)) from None
        return {"kind": "cuda_ipc", "args": args, "device_uuid": _uuid(data.device),
                "nbytes": data.numel(), "buffer_id": buffer_id}  # fmt: skip
    if shm_name is None:
        raise StoreError("a CPU engine buffer must live in a named shared-memory segment")
    return {"kind": "shm_buffer", "name": shm_name, "nbytes": data.numel(), "buffer_id": buffer_id}


def import_buffer(handle: dict[str, Any], shm_dir: Path | str = SHM_DIR) -> tuple[torch.Tensor, SharedSegment | None]:
    """Map an engine buffer from its handle in this process (the CUDA variant needs CUDA).

    A CUDA import leaves torch's IPC reference count alone (daemon/cuda_ipc.py): dropping every
    tensor over it closes the mapping, and nothing the engine frees waits on this process."""
    kind = handle.get("kind")
    if kind == "shm_buffer":
        seg = SharedSegment.open(str(handle["name"]), shm_dir)
        return seg.tensor(0, min(int(handle["nbytes"]), seg.size)), seg
    if kind != "cuda_ipc":
        raise StoreError(f"unknown engine buffer kind {kind!r}")
    if not torch.cuda.is_available():
        raise StoreError("a CUDA IPC buffer needs CUDA in this process")
    try:
        cuda_ipc.import_args(handle.get("args"))
    except cuda_ipc.IpcError as e:
        raise StoreError(str(e)) from None
    # Device indices depend on CUDA_VISIBLE_DEVICES: find the exporter's device by UUID.
    local = [i for i in range(torch.cuda.device_count()) if _uuid(torch.device("cuda", i)) == handle["device_uuid"]]
    if not local:
        raise StoreError(f"GPU {handle['device_uuid']} is not visible to this process")
    try:
        return cuda_ipc.import_handle(handle["args"], local[0]), None
    except RuntimeError as e:  # the exporting engine is gone, or the handle is stale
        raise StoreError(f"cannot open the engine's CUDA IPC handle: {e}") from e


# ---------------------------------------------------------------- engine API


@dataclass(frozen=True, slots=True)
class Observed(Generic[T]):
    """What ``consistent`` ran and saw: the value, the version at the start, and whether it changed since."""

    value: T
    version: int | None  # None: the store held no version the engine may report
    root: bytes | None
    changed: bool  # the daemon wrote (or began writing) while fn ran: do not attribute value to version


class Synchronizes(Protocol):
    """A handle on asynchronous work: torch.cuda.Event or Stream, daemon.cpu_stream.CpuEvent or CpuStream."""

    def synchronize(self) -> Any: ...


class FenceReader:
    """Reads the control block's seqlock: versions only from a stable (even) sequence number.

    ``lock``: the store's readers' lock (daemon/fence_lock.py), held by ``consistent`` so that no
    write begins while the reader's work may still read; None: the seqlock alone.  ``device``:
    where the data lives; a CUDA device makes ``consistent`` synchronize that device's current
    stream before it re-reads the sequence number (``EngineView`` sets it).
    """

    def __init__(
        self,
        control: ControlBlock,
        buffer_id: int = 0,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        lock: ReadGate | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.control = control
        self.buffer_id = buffer_id
        self.lock = lock
        self.device = device
        self._sleep = sleep
        self._clock = clock

    def seq(self) -> int:
        return self.control.seq()

    def header(self) -> Header | None:
        """A consistent header, or None while the daemon writes."""
        return self.control.snapshot()

    def _version_of(self, h: Header) -> tuple[int, bytes] | None:
        if h.state != StoreState.READY or h.buffer_id != self.buffer_id:
            return None  # no version, or one that lives in another engine buffer
        return h.version, h.root

    def read_version(self) -> tuple[int, bytes] | None:
        """(version, state root) the weights hold now; None while writing or when there is none."""
        h = self.control.snapshot()
        return None if h is None else self._version_of(h)

    def wait_stable(self, timeout: float | None = None, poll_s: float = 1e-4) -> Header:
        """Spin (sleeping ``poll_s``) until no write is in progress; TimeoutError after ``timeout``."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            h = self.control.snapshot()
            if h is not None:
                return h
            if deadline is not None and self._clock() >= deadline:
                raise TimeoutError("the weight store stayed mid-write (is the daemon recovering?)")
            self._sleep(poll_s)

    def _enter(self, timeout: float | None, poll_s: float = 1e-4) -> Header:
        """A stable header, with the read lock held (when there is one): no write begins until it goes."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            if self.lock is None or self.lock.try_enter(self.control):
                h = self.control.snapshot()
                if h is not None:
                    return h
                if self.lock is not None:
                    self.lock.exit()  # (a fence left odd: never hold the lock the recovery needs)
            if deadline is not None and self._clock() >= deadline:
                raise TimeoutError("the weight store stayed mid-write or locked by its writer (daemon recovering?)")
            self._sleep(poll_s)

    def synchronize(self, sync: Callable[[], Any] | Synchronizes | None = None) -> None:
        """Wait for the reader's asynchronous work: ``sync``, or by default the current stream of
        the data's CUDA device (an event recorded on it, then waited for); nothing for host data."""
        if sync is None:
            if self.device is not None and self.device.type == "cuda":
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(self.device))
                event.synchronize()
        elif hasattr(sync, "synchronize"):
            sync.synchronize()
        elif callable(sync):
            sync()
        else:
            raise TypeError("sync must be a callable or have .synchronize() (a CUDA event or stream)")

    def consistent(
        self,
        fn: Callable[[], T],
        *,
        timeout: float | None = None,
        sync: Callable[[], Any] | Synchronizes | None = None,
    ) -> Observed[T]:
        """Run ``fn`` (e.g. one forward pass) and tell which version it ran on, if it was one.

        ``fn`` may only launch its reads (CUDA kernels, or work on a ``daemon.cpu_stream`` stream):
        ``sync`` waits for them (``synchronize``) before the sequence number is read again, and
        the read lock, taken before the stable sequence number was read, is held until then, so
        the daemon begins no write while they may read.  ``changed`` is True when the sequence
        number moved all the same (a daemon without the handshake, a recovery): the result
        mixes versions (or saw a write) and must not be reported as ``version``.  ``timeout``
        bounds the wait for a stable fence (TimeoutError).
        """
        start = self._enter(timeout)
        try:
            try:
                value = fn()
            finally:
                self.synchronize(sync)  # (also when fn raised: its launched work may still read)
            changed = self.control.seq() != start.seq
        finally:
            if self.lock is not None:
                self.lock.exit()
        got = self._version_of(start)
        return Observed(value, None if got is None else got[0], None if got is None else got[1], changed)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()


class EngineView:
    """Zero-copy typed tensors over the store's data, by name, and the fence to read versions with."""

    def __init__(
        self,
        layout: StoreLayout,
        data: torch.Tensor,
        fence: FenceReader,
        segments: list[SharedSegment],
        handle: dict[str, Any] | None = None,
        owned: SharedSegment | None = None,
        pool: Any = None,
    ) -> None:
        self.layout = layout
        self.data = data
        self.fence = fence
        self.handle = handle  # engine-owned buffers: what to give the daemon (its API's register call)
        self._segments = segments
        self._owned = owned
        self._pool = pool  # a CUDA buffer's private memory pool: it lives as long as the buffer
        self._index = {s.name: i for i, s in enumerate(layout.slots)}
        if fence.device is None:
            fence.device = data.device  # (consistent's default sync: this device's current stream)

    @property
    def control_segment(self) -> SharedSegment:
        """The store's segment (control block and layout) this view mapped."""
        return self._segments[0]

    def tensor(self, name: str) -> torch.Tensor:
        s = self.layout.slots[self._index[name]]
        return typed_view(self.data[s.offset : s.offset + s.nbytes], s.spec)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {s.name: self.tensor(s.name) for s in self.layout.slots}

    def array(self, name: str) -> npt.NDArray[Any]:
        """A numpy view (CPU stores); dtypes numpy lacks (bf16, fp8) come as their integer words."""
        if self.data.device.type != "cpu":
            raise StoreError("numpy views exist only for stores in host memory")
        t = self.tensor(name)
        try:
            return t.numpy()
        except TypeError:
            s = self.layout.slots[self._index[name]]
            return word_view(self.data[s.offset : s.offset + s.nbytes], s.spec).numpy().reshape(s.shape)

    def read_version(self) -> tuple[int, bytes] | None:
        return self.fence.read_version()

    def close(self) -> None:
        """Drop the mappings; an engine-owned CPU buffer is removed (CUDA memory is freed with the tensor)."""
        self.data = torch.empty(0, dtype=torch.uint8)
        self._pool = None
        self.fence.close()
        if self._owned is not None:
            self._owned.unlink()
        for seg in [*self._segments, *([self._owned] if self._owned else [])]:
            seg.close()


def _layout_of(info: dict[str, Any], ctl: ControlBlock) -> StoreLayout:
    layout = StoreLayout.from_json(info["layout"])
    if ctl.check() != layout.layout_hash:
        raise StoreLayoutMismatch("the store's layout hash is not the one the attach info describes")
    return layout


def _read_gate(seg: SharedSegment) -> ReadGate | None:
    return ReadGate.open(readers_lock_path(seg.path))


def attach(info: dict[str, Any]) -> EngineView:
    """Map the store described by the daemon's ``attach_info`` (works in any process)."""
    shm_dir = info.get("shm_dir", str(SHM_DIR))
    seg = SharedSegment.open(str(info["control"]["name"]), shm_dir)
    ctl = ControlBlock(seg.mm)
    layout = _layout_of(info, ctl)
    if info["kind"] == "shm":
        off, cap = ctl.get(OFF_DATA), ctl.get(OFF_DATA + 8)
        if cap < layout.nbytes or off + layout.nbytes > seg.size:
            raise StoreTooSmallError(layout.nbytes, cap)
        return EngineView(layout, seg.tensor(off, layout.nbytes), FenceReader(ctl, lock=_read_gate(seg)), [seg])
    if info["kind"] != "engine_buffer" or not info.get("buffer"):
        raise StoreError(f"cannot attach a store of kind {info['kind']!r} without a buffer (use allocate)")
    data, bseg = import_buffer(info["buffer"], shm_dir)
    if data.numel() < layout.nbytes:
        raise StoreTooSmallError(layout.nbytes, data.numel())
    fence = FenceReader(ctl, int(info["buffer"]["buffer_id"]), lock=_read_gate(seg))
    return EngineView(layout, data, fence, [seg, *([bseg] if bseg else [])])


def allocate(info: dict[str, Any], device: torch.device | str) -> EngineView:
    """Allocate the store's data as an engine-owned buffer on ``device`` and map its control block.

    Give ``view.handle`` to the daemon (WeightStore.attach_buffer); the weights are valid once
    the fence reports a version.  On "cpu" the buffer is a named shm segment (the CUDA twin).
    """
    if info["kind"] != "engine_buffer":
        raise StoreError("this store keeps its data in host shared memory: attach to it instead")
    shm_dir = info.get("shm_dir", str(SHM_DIR))
    seg = SharedSegment.open(str(info["control"]["name"]), shm_dir)
    ctl = ControlBlock(seg.mm)
    layout = _layout_of(info, ctl)
    dev = torch.device(device)
    buffer_id = secrets.randbits(63) | 1
    owned, pool = None, None
    if dev.type == "cpu":
        # The daemon (another user, same group as the store) opens this buffer: give it the store's group.
        gid = os.stat(seg.path).st_gid
        gid = gid if os.geteuid() == 0 or gid in (os.getegid(), *os.getgroups()) else -1
        owned = SharedSegment.create(f"{seg.name}.buf.{buffer_id:016x}", max(layout.nbytes, 1), shm_dir, gid)
        data = owned.tensor(0, layout.nbytes)
        handle = export_buffer(data, buffer_id, owned.name)
    else:
        # Its own allocator segment (rounded up to whole segment bytes): the handle exposes only it.
        own = cuda_ipc.allocate_own_segment(layout.nbytes, dev)
        data, pool = own.data, own.pool
        handle = export_buffer(data, buffer_id)
    return EngineView(layout, data, FenceReader(ctl, buffer_id, lock=_read_gate(seg)), [seg], handle, owned, pool)

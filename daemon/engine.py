"""Engine side of the weight store: attach to the served weights and read the version fence.

An engine process imports this module only (no protocol/diffscan machinery): ``attach`` maps a
store from the JSON ``attach_info`` the daemon publishes and returns an ``EngineView`` of
zero-copy typed tensors plus a ``FenceReader``; ``allocate`` is for engine-owned buffers (the
GPU placement: the engine allocates one buffer, the daemon writes into it through one handle).
``daemon.engine_client.DaemonClient`` talks to the daemon's unix socket: ``open_store`` attaches,
or allocates and registers the buffer (POST /v1/store); ``wait_version`` and ``ack`` follow versions.

The store's byte format (layout, control block, shared-memory segments, buffer handles) lives
here too, because both sides must read it the same way; the writer is daemon/weightstore.py.
docs/weightstore.md describes all of it.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import grp
import math
import mmap
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from patchswarm.protocol.dtypes import dtype as dtype_of
from patchswarm.protocol.errors import LayoutMismatchError, PatchswarmError, UnsupportedDtypeError
from patchswarm.protocol.served import TensorSpec, layout_hash, typed_view, word_view

T = TypeVar("T")

SHM_DIR = Path("/dev/shm")
ALIGN = 256
PAGE = 4096
CONTROL_SIZE = PAGE
MAGIC = b"PSWSTORE"
FORMAT = 1
_HANDLE_CAP = 64 * 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
ZERO_ROOT = bytes(32)


# ---------------------------------------------------------------- errors


class StoreError(PatchswarmError):
    """The weight store cannot do what was asked; the message says why."""


class StoreMissingError(StoreError):
    """No store of that name, or one whose creation never finished (no magic)."""


class StoreTooSmallError(StoreError):
    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(f"the store holds {capacity} bytes of data, the model needs {needed}")
        self.needed = needed
        self.capacity = capacity


class StoreLayoutMismatch(StoreError, LayoutMismatchError):
    """The store was laid out for other tensor names, dtypes or shapes."""


# ---------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """Where each tensor lives in the data buffer: ordered slots, offsets aligned to ``ALIGN``."""

    slots: tuple[Slot, ...]

    @classmethod
    def from_specs(cls, specs: list[TensorSpec]) -> StoreLayout:
        names = [s.name for s in specs]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError("tensors must be unique and sorted by name")
        slots: list[Slot] = []
        off = 0
        for s in specs:
            slots.append(Slot(s.name, s.dtype, tuple(s.shape), off, s.nbytes))
            off += -(-s.nbytes // ALIGN) * ALIGN
        return cls(tuple(slots))

    @property
    def specs(self) -> list[TensorSpec]:
        return [s.spec for s in self.slots]

    @property
    def nbytes(self) -> int:
        """Bytes of data buffer the layout needs."""
        return max((s.offset + -(-s.nbytes // ALIGN) * ALIGN for s in self.slots), default=0)

    @property
    def layout_hash(self) -> bytes:
        return layout_hash(self.specs)

    def index(self, name: str) -> int:
        for i, s in enumerate(self.slots):
            if s.name == name:
                return i
        raise KeyError(name)

    def to_json(self) -> list[list[Any]]:
        return [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]

    @classmethod
    def from_json(cls, obj: Any) -> StoreLayout:
        try:
            slots = tuple(Slot(str(n), str(d), tuple(int(x) for x in sh), int(o), int(b)) for n, d, sh, o, b in obj)
            widths = [dtype_of(s.dtype).width for s in slots]
        except (TypeError, ValueError, UnsupportedDtypeError) as e:
            raise StoreError(f"malformed store layout: {e}") from None
        end = 0
        for s, width in zip(slots, widths, strict=True):
            if (
                s.offset % ALIGN
                or s.offset < end
                or s.nbytes != math.prod(s.shape) * width
                or min(s.shape, default=0) < 0
            ):
                raise StoreError(f"store layout slot {s.name!r} is misplaced or missized")
            end = s.offset + s.nbytes
        names = [s.name for s in slots]
        if names != sorted(names) or len(set(names)) != len(names):
            raise StoreError("store layout names must be unique and sorted")
        return cls(slots)


# ---------------------------------------------------------------- control block

# Byte layout of the control page (little-endian); docs/weightstore.md mirrors this table.
_OFF_MAGIC = 0  # 8 bytes
_OFF_FORMAT = 8  # u32
_OFF_STATE = 12  # u32 (inside the fence)
_OFF_SEQ = 16  # u64 seqlock: odd while the daemon writes
_OFF_VERSION = 24  # u64 (inside the fence)
_OFF_ROOT = 32  # 32 bytes (inside the fence)
_OFF_LAYOUT_HASH = 64  # 32 bytes
_OFF_LAYOUT = 96  # u64 offset, u64 length of the layout JSON in the segment
_OFF_DATA = 112  # u64 offset of the data region in the segment (0: engine buffer), u64 capacity
_OFF_HANDLE = 128  # u64 offset, u64 capacity, u64 length of the engine buffer's handle JSON
_OFF_KIND = 152  # u64: 1 host store, 2 engine buffer
_OFF_BUFFER_ID = 160  # u64 (inside the fence): id of the engine buffer the version is in (0 for host stores)
KIND_HOST = 1
KIND_ENGINE_BUFFER = 2


class StoreState(IntEnum):
    EMPTY = 0  # no version: nothing loaded yet, or the engine buffer is new
    LOADING = 1  # a full load is being written
    READY = 2  # the version/root words describe the contents
    WRITING = 3  # an activation is being written (journal on disk)
    RECOVERING = 4  # a restarted daemon is finishing or rolling back an activation
    FAILED = 5  # contents unknown or unverifiable: needs a full load


@dataclass(frozen=True, slots=True)
class Header:
    seq: int
    version: int
    root: bytes
    state: StoreState
    buffer_id: int = 0

    @property
    def stable(self) -> bool:
        return self.seq % 2 == 0


class ControlBlock:
    """Typed access to the control page.  Readers use ``snapshot`` (seqlock); the daemon writes.

    Each field is one aligned load or store (atomic on x86-64 and arm64); x86 keeps stores
    in program order, which the fence relies on (see docs/weightstore.md for other CPUs).
    """

    def __init__(self, buf: Any) -> None:
        self._u8: npt.NDArray[np.uint8] = np.frombuffer(buf, dtype=np.uint8, count=CONTROL_SIZE)
        self._u32: npt.NDArray[np.uint32] = self._u8.view("<u4")
        self._u64: npt.NDArray[np.uint64] = self._u8.view("<u8")

    def get(self, off: int) -> int:
        return int(self._u64[off // 8])

    def set(self, off: int, value: int) -> None:
        self._u64[off // 8] = value

    def seq(self) -> int:
        return int(self._u64[_OFF_SEQ // 8])

    def _fields(self, seq: int) -> Header:
        try:
            state = StoreState(int(self._u32[_OFF_STATE // 4]))
        except ValueError:
            state = StoreState.FAILED
        return Header(
            seq,
            int(self._u64[_OFF_VERSION // 8]),
            self._u8[_OFF_ROOT : _OFF_ROOT + 32].tobytes(),
            state,
            int(self._u64[_OFF_BUFFER_ID // 8]),
        )

    def raw(self) -> Header:
        """The fields as they are now, fence or not (for the single writer and for recovery)."""
        return self._fields(self.seq())

    def snapshot(self) -> Header | None:
        """A consistent header, or None while a write is in progress or the read raced one."""
        s1 = self.seq()
        if s1 & 1:
            return None
        h = self._fields(s1)
        return h if self.seq() == s1 else None

    def init(self, fields: dict[int, int], layout_hash: bytes) -> None:
        """Write the static fields; the magic goes last, so a half-made segment is recognisable."""
        for off, value in fields.items():
            self.set(off, value)
        self._u8[_OFF_LAYOUT_HASH : _OFF_LAYOUT_HASH + 32] = np.frombuffer(layout_hash, dtype=np.uint8)
        self._u32[_OFF_FORMAT // 4] = FORMAT
        self._u8[_OFF_MAGIC : _OFF_MAGIC + 8] = np.frombuffer(MAGIC, dtype=np.uint8)

    def check(self) -> bytes:
        if self._u8[:8].tobytes() != MAGIC:
            raise StoreMissingError("not a weight store (bad magic), or one whose creation did not finish")
        if int(self._u32[_OFF_FORMAT // 4]) != FORMAT:
            raise StoreError(f"weight store format {int(self._u32[_OFF_FORMAT // 4])} (this build handles {FORMAT})")
        return self._u8[_OFF_LAYOUT_HASH : _OFF_LAYOUT_HASH + 32].tobytes()

    def begin(self, state: StoreState) -> None:
        """Enter the write side of the fence (seq odd); a fence left odd by a crash stays odd."""
        s = self.seq()
        self._u32[_OFF_STATE // 4] = int(state)
        if s % 2 == 0:
            self._u64[_OFF_SEQ // 8] = s + 1

    def publish(self, version: int, root: bytes, state: StoreState, buffer_id: int | None = None) -> None:
        """Set the fenced fields and leave the fence (seq even); must be inside ``begin``."""
        s = self.seq()
        if s % 2 == 0:
            raise RuntimeError("publish outside a write fence")
        self._u64[_OFF_VERSION // 8] = version
        self._u8[_OFF_ROOT : _OFF_ROOT + 32] = np.frombuffer(root, dtype=np.uint8)
        if buffer_id is not None:
            self._u64[_OFF_BUFFER_ID // 8] = buffer_id
        self._u32[_OFF_STATE // 4] = int(state)
        self._u64[_OFF_SEQ // 8] = s + 1

    def blob(self, buf: Any, off_field: int, len_field: int) -> bytes:
        off, n = self.get(off_field), self.get(len_field)
        return bytes(memoryview(buf)[off : off + n])


# ---------------------------------------------------------------- shared-memory segments


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
    return SharedSegment._path(name, shm_dir).with_name(f"{name}.lock")


class SharedSegment:
    """A named POSIX shared-memory segment mapped read-write; it stays until ``unlink``."""

    def __init__(self, name: str, path: Path, mm: mmap.mmap) -> None:
        self.name = name
        self.path = path
        self.mm = mm

    @staticmethod
    def _path(name: str, shm_dir: Path | str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad shared-memory name {name!r}")
        return Path(shm_dir) / name

    @classmethod
    def create(cls, name: str, size: int, shm_dir: Path | str = SHM_DIR, group: str | int = "") -> SharedSegment:
        """Create and reserve ``size`` bytes up front (so a full /dev/shm fails here, not as SIGBUS later).

        Mode 0660, owned by ``group`` (a name or gid; empty: the creator's group), whatever the umask:
        an engine running as another user of that group attaches to it (``api.group``).
        """
        path = cls._path(name, shm_dir)
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
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StoreError(f"cannot create shared memory {path} of {size} bytes: {e}") from e
        except StoreError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(name, path, mm)

    @classmethod
    def open(cls, name: str, shm_dir: Path | str = SHM_DIR) -> SharedSegment:
        path = cls._path(name, shm_dir)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreMissingError(f"no shared memory named {path}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise StoreMissingError(f"shared memory {path} is empty (its creation never finished)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, path, mm)

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


def _enc(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"b64": base64.b64encode(v).decode()}
    if isinstance(v, (tuple, list, torch.Size)):
        return {"list": [_enc(x) for x in v]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, type):
        return {"type": f"{v.__module__}.{v.__qualname__}"}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    raise StoreError(f"cannot encode a CUDA IPC argument of type {type(v).__name__}")


_TYPES: dict[str, type] = {
    "torch.Tensor": torch.Tensor,
    "torch.storage.UntypedStorage": torch.UntypedStorage,
    "torch.storage.TypedStorage": torch.TypedStorage,
}


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if "b64" in v:
            return base64.b64decode(v["b64"])
        if "list" in v:
            return tuple(_dec(x) for x in v["list"])
        if "dtype" in v:
            return getattr(torch, str(v["dtype"]))
        if "type" in v and v["type"] in _TYPES:
            return _TYPES[v["type"]]
        raise StoreError(f"unexpected CUDA IPC argument {v!r}")
    return v


def export_buffer(data: torch.Tensor, buffer_id: int, shm_name: str | None = None) -> dict[str, Any]:
    """The JSON handle of an engine-owned flat uint8 buffer: one CUDA IPC handle, or a shm name (CPU twin)."""
    if data.device.type == "cuda":
        import inspect

        from torch.multiprocessing.reductions import reduce_tensor

        fn, args = reduce_tensor(data)  # type: ignore[no-untyped-call]
        names = list(inspect.signature(fn).parameters)
        fields = {k: _enc(a) for k, a in zip(names, args, strict=True)}
        return {"kind": "cuda_ipc", "args": fields, "device_uuid": _uuid(data.device),
                "nbytes": data.numel(), "buffer_id": buffer_id}  # fmt: skip
    if shm_name is None:
        raise StoreError("a CPU engine buffer must live in a named shared-memory segment")
    return {"kind": "shm_buffer", "name": shm_name, "nbytes": data.numel(), "buffer_id": buffer_id}


def import_buffer(handle: dict[str, Any], shm_dir: Path | str = SHM_DIR) -> tuple[torch.Tensor, SharedSegment | None]:
    """Map an engine buffer from its handle in this process (the CUDA variant needs CUDA)."""
    kind = handle.get("kind")
    if kind == "shm_buffer":
        seg = SharedSegment.open(str(handle["name"]), shm_dir)
        return seg.tensor(0, min(int(handle["nbytes"]), seg.size)), seg
    if kind != "cuda_ipc":
        raise StoreError(f"unknown engine buffer kind {kind!r}")
    if not torch.cuda.is_available():
        raise StoreError("a CUDA IPC buffer needs CUDA in this process")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = {k: _dec(v) for k, v in handle["args"].items()}
    # Device indices depend on CUDA_VISIBLE_DEVICES: find the exporter's device by UUID.
    local = [i for i in range(torch.cuda.device_count()) if _uuid(torch.device("cuda", i)) == handle["device_uuid"]]
    if not local:
        raise StoreError(f"GPU {handle['device_uuid']} is not visible to this process")
    args["storage_device"] = local[0]
    try:
        return rebuild_cuda_tensor(**args), None  # type: ignore[no-untyped-call]
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


class FenceReader:
    """Reads the control block's seqlock: versions only from a stable (even) sequence number."""

    def __init__(
        self,
        control: ControlBlock,
        buffer_id: int = 0,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.control = control
        self.buffer_id = buffer_id
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

    def consistent(self, fn: Callable[[], T], *, timeout: float | None = None) -> Observed[T]:
        """Run ``fn`` (e.g. one generation step) and tell which version it ran on, if it was one.

        ``changed`` is True when the sequence number moved while ``fn`` ran: its result mixes
        versions (or saw a write) and must not be reported as ``version``.
        """
        start = self.wait_stable(timeout)
        value = fn()
        changed = self.control.seq() != start.seq
        got = self._version_of(start)
        return Observed(value, None if got is None else got[0], None if got is None else got[1], changed)


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
    ) -> None:
        self.layout = layout
        self.data = data
        self.fence = fence
        self.handle = handle  # engine-owned buffers: what to give the daemon (its API's register call)
        self._segments = segments
        self._owned = owned
        self._index = {s.name: i for i, s in enumerate(layout.slots)}

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
        if self._owned is not None:
            self._owned.unlink()
        for seg in [*self._segments, *([self._owned] if self._owned else [])]:
            seg.close()


def _layout_of(info: dict[str, Any], ctl: ControlBlock) -> StoreLayout:
    layout = StoreLayout.from_json(info["layout"])
    if ctl.check() != layout.layout_hash:
        raise StoreLayoutMismatch("the store's layout hash is not the one the attach info describes")
    return layout


def attach(info: dict[str, Any]) -> EngineView:
    """Map the store described by the daemon's ``attach_info`` (works in any process)."""
    shm_dir = info.get("shm_dir", str(SHM_DIR))
    seg = SharedSegment.open(str(info["control"]["name"]), shm_dir)
    ctl = ControlBlock(seg.mm)
    layout = _layout_of(info, ctl)
    if info["kind"] == "shm":
        off, cap = ctl.get(_OFF_DATA), ctl.get(_OFF_DATA + 8)
        if cap < layout.nbytes or off + layout.nbytes > seg.size:
            raise StoreTooSmallError(layout.nbytes, cap)
        return EngineView(layout, seg.tensor(off, layout.nbytes), FenceReader(ctl), [seg])
    if info["kind"] != "engine_buffer" or not info.get("buffer"):
        raise StoreError(f"cannot attach a store of kind {info['kind']!r} without a buffer (use allocate)")
    data, bseg = import_buffer(info["buffer"], shm_dir)
    if data.numel() < layout.nbytes:
        raise StoreTooSmallError(layout.nbytes, data.numel())
    fence = FenceReader(ctl, int(info["buffer"]["buffer_id"]))
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
    owned = None
    if dev.type == "cpu":
        # The daemon (another user, same group as the store) opens this buffer: give it the store's group.
        gid = os.stat(seg.path).st_gid
        gid = gid if os.geteuid() == 0 or gid in (os.getegid(), *os.getgroups()) else -1
        owned = SharedSegment.create(f"{seg.name}.buf.{buffer_id:016x}", max(layout.nbytes, 1), shm_dir, gid)
        data = owned.tensor(0, layout.nbytes)
        handle = export_buffer(data, buffer_id, owned.name)
    else:
        data = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
        handle = export_buffer(data, buffer_id)
    return EngineView(layout, data, FenceReader(ctl, buffer_id), [seg], handle, owned)

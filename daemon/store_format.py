"""The weight store's format: what the daemon (daemon/weightstore.py) writes and every engine
(daemon/engine.py) reads the same way, so it is defined once, here.

The data buffer's layout (``StoreLayout``: one aligned slot per tensor), the control page (its byte
offsets, ``MAGIC``, ``FORMAT``, the store kinds, ``StoreState``, the seqlocked ``Header`` and
``ControlBlock``), the unit of change both the store and its activation journal (daemon/journal.py)
hold (``TensorUpdate``) and the store's errors.  docs/weightstore.md describes all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from patchswarm.protocol.dtypes import dtype as dtype_of
from patchswarm.protocol.errors import DigestMismatchError, LayoutMismatchError, PatchswarmError, UnsupportedDtypeError
from patchswarm.protocol.served import TensorSpec, layout_hash

ALIGN = 256
PAGE = 4096
CONTROL_SIZE = PAGE
MAGIC = b"PSWSTORE"
FORMAT = 1
HANDLE_CAP = 64 * 1024
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


class StoreVerifyError(StoreError, DigestMismatchError):
    """What the store holds is not what it should hold (written values or the state root)."""


class StoreStateError(StoreError):
    """The store is not in a state that allows the operation (e.g. activate before the first load)."""


class JournalError(StoreError):
    """The activation journal could not be written or read; memory was not touched if raised by activate."""


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

    def word_bases(self) -> list[int] | None:
        """Each slot's first word when every slot has one word width and starts aligned to it (the
        store's data then reads as one array of words), else None."""
        widths = {s.spec.dt.width for s in self.slots}
        if len(widths) != 1:
            return None
        w = widths.pop()
        if any(s.offset % w for s in self.slots):
            return None
        return [s.offset // w for s in self.slots]

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


# ---------------------------------------------------------------- updates


@dataclass(frozen=True, slots=True)
class TensorUpdate:
    """New values for one slot: at ``positions`` (int64), or the whole tensor when positions is None.

    ``new`` and ``old`` are words (protocol.served.word_view dtype), absolute values, so that
    writing either is idempotent.  They must not be mutated until ``activate`` returns.
    """

    slot: int
    positions: torch.Tensor | None
    new: torch.Tensor
    old: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.new.numel())


# ---------------------------------------------------------------- control block

# Byte layout of the control page (little-endian); docs/weightstore.md mirrors this table.
OFF_MAGIC = 0  # 8 bytes
OFF_FORMAT = 8  # u32
OFF_STATE = 12  # u32 (inside the fence)
OFF_SEQ = 16  # u64 seqlock: odd while the daemon writes
OFF_VERSION = 24  # u64 (inside the fence)
OFF_ROOT = 32  # 32 bytes (inside the fence)
OFF_LAYOUT_HASH = 64  # 32 bytes
OFF_LAYOUT = 96  # u64 offset, u64 length of the layout JSON in the segment
OFF_DATA = 112  # u64 offset of the data region in the segment (0: engine buffer), u64 capacity
OFF_HANDLE = 128  # u64 offset, u64 capacity, u64 length of the engine buffer's handle JSON
OFF_KIND = 152  # u64: 1 host store, 2 engine buffer
OFF_BUFFER_ID = 160  # u64 (inside the fence): id of the engine buffer the version is in (0 for host stores)
# u64 (not fenced): CLOCK_MONOTONIC deadline (ns) of a writer waiting for the readers in flight, 0 when
# none; readers that see it wait instead of starting a read (daemon/fence_lock.py), so that a stream
# of readers cannot starve the writer.  Older readers ignore it (the format stays 1).
OFF_WRITE_PENDING = 168
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


class WriterGate(Protocol):
    """What the writer takes before a write begins: the readers' handshake (daemon/fence_lock.py)."""

    def acquire(self, control: ControlBlock) -> None:
        """Wait (bounded) until no reader's work may still read the data; StoreError past the bound."""
        ...

    def release(self, control: ControlBlock) -> None: ...


class ControlBlock:
    """Typed access to the control page.  Readers use ``snapshot`` (seqlock); the daemon writes.

    Each field is one aligned load or store (atomic on x86-64 and arm64); x86 keeps stores
    in program order, which the fence relies on (see docs/weightstore.md for other CPUs).
    ``gate`` (the daemon's side only): taken by ``begin`` before anything is written, let go by
    ``publish`` once the fence is even again.
    """

    def __init__(self, buf: Any) -> None:
        self._u8: npt.NDArray[np.uint8] = np.frombuffer(buf, dtype=np.uint8, count=CONTROL_SIZE)
        self._u32: npt.NDArray[np.uint32] = self._u8.view("<u4")
        self._u64: npt.NDArray[np.uint64] = self._u8.view("<u8")
        self.gate: WriterGate | None = None

    def get(self, off: int) -> int:
        return int(self._u64[off // 8])

    def set(self, off: int, value: int) -> None:
        self._u64[off // 8] = value

    def seq(self) -> int:
        return int(self._u64[OFF_SEQ // 8])

    def _fields(self, seq: int) -> Header:
        try:
            state = StoreState(int(self._u32[OFF_STATE // 4]))
        except ValueError:
            state = StoreState.FAILED
        return Header(
            seq,
            int(self._u64[OFF_VERSION // 8]),
            self._u8[OFF_ROOT : OFF_ROOT + 32].tobytes(),
            state,
            int(self._u64[OFF_BUFFER_ID // 8]),
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
        self._u8[OFF_LAYOUT_HASH : OFF_LAYOUT_HASH + 32] = np.frombuffer(layout_hash, dtype=np.uint8)
        self._u32[OFF_FORMAT // 4] = FORMAT
        self._u8[OFF_MAGIC : OFF_MAGIC + 8] = np.frombuffer(MAGIC, dtype=np.uint8)

    def check(self) -> bytes:
        if self._u8[:8].tobytes() != MAGIC:
            raise StoreMissingError("not a weight store (bad magic), or one whose creation did not finish")
        if int(self._u32[OFF_FORMAT // 4]) != FORMAT:
            raise StoreError(f"weight store format {int(self._u32[OFF_FORMAT // 4])} (this build handles {FORMAT})")
        return self._u8[OFF_LAYOUT_HASH : OFF_LAYOUT_HASH + 32].tobytes()

    def begin(self, state: StoreState, *, gated: bool = True) -> None:
        """Enter the write side of the fence (seq odd); a fence left odd by a crash stays odd.

        ``gated``: first wait for the readers in flight (``gate``; its StoreError leaves the block
        untouched).  Transitions that write no data (a new buffer, FAILED) pass False: the seqlock
        alone tells readers their version went away."""
        if gated and self.gate is not None:
            self.gate.acquire(self)
        s = self.seq()
        self._u32[OFF_STATE // 4] = int(state)
        if s % 2 == 0:
            self._u64[OFF_SEQ // 8] = s + 1

    def publish(self, version: int, root: bytes, state: StoreState, buffer_id: int | None = None) -> None:
        """Set the fenced fields and leave the fence (seq even); must be inside ``begin``."""
        s = self.seq()
        if s % 2 == 0:
            raise RuntimeError("publish outside a write fence")
        self._u64[OFF_VERSION // 8] = version
        self._u8[OFF_ROOT : OFF_ROOT + 32] = np.frombuffer(root, dtype=np.uint8)
        if buffer_id is not None:
            self._u64[OFF_BUFFER_ID // 8] = buffer_id
        self._u32[OFF_STATE // 4] = int(state)
        self._u64[OFF_SEQ // 8] = s + 1
        if self.gate is not None:
            self.gate.release(self)

    def blob(self, buf: Any, off_field: int, len_field: int) -> bytes:
        off, n = self.get(off_field), self.get(len_field)
        return bytes(memoryview(buf)[off : off + n])


# ---------------------------------------------------------------- shared-memory segments

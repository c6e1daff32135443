"""The weight store: the served weights an inference engine reads, updated in place under a version fence.

One flat byte buffer holds every tensor at a fixed, 256-byte aligned offset (``StoreLayout``);
a control block (``ControlBlock``, one 4 KiB page of host shared memory) holds the fence: a
64-bit sequence counter that is odd while the daemon writes, and the active version and state
root.  Two placements of the buffer (docs/weightstore.md):

- host store: one named POSIX shared-memory segment ``[control page | layout | data]`` that the
  daemon creates and that outlives it (unlinked only by ``destroy()``);
- engine buffer: the engine allocates the data (CUDA memory dies with its allocator) and hands
  the daemon one handle (a CUDA IPC handle, or on CPU its twin, a named shm segment); the
  control block and layout live in a small daemon-created segment.

An activation journals absolute old and new values (daemon/journal.py) before memory is
touched, then writes, verifies the written positions and flips the version inside the fence.
The byte format both sides share (layout, control block) is in daemon/store_format.py; the
segments and buffer handles in daemon/engine.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon import journal
from patchswarm.daemon.device_blake3 import device_digests
from patchswarm.daemon.engine import SHM_DIR, SharedSegment, import_buffer
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.fence_lock import ReadersStalled, WriteGate, readers_lock_path
from patchswarm.daemon.prepared import Prepared
from patchswarm.daemon.store_format import (
    CONTROL_SIZE,
    HANDLE_CAP,
    KIND_ENGINE_BUFFER,
    KIND_HOST,
    OFF_DATA,
    OFF_HANDLE,
    OFF_KIND,
    OFF_LAYOUT,
    OFF_WRITE_PENDING,
    PAGE,
    ZERO_ROOT,
    ControlBlock,
    Header,
    JournalError,
    StoreError,
    StoreLayout,
    StoreLayoutMismatch,
    StoreMissingError,
    StoreState,
    StoreTooSmallError,
    StoreVerifyError,
    TensorUpdate,
)
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.layout_flat import RankChanges
from patchswarm.protocol.served import ServedModel, bytes_digest, state_root, word_view
from patchswarm.protocol.sparse_apply import DENSE_FRACTION  # (a tensor changed more than this is written whole)

__all__ = [
    "ActivationStats",
    "RegistrationError",
    "StoreStateError",
    "WeightStore",
    "check_registration",
    "diff_updates",
]

log = logging.getLogger("patchswarm.store")


class StoreStateError(StoreError):
    """The store is not in a state that allows the operation (e.g. activate before the first load)."""


class RegistrationError(StoreError):
    """An engine's buffer registration (POST /v1/store) that does not fit the store; ``code`` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# store.kind of an engine-allocated store -> the kind of buffer handle its engine registers
ENGINE_BUFFER_KINDS = {"cuda": "cuda_ipc", "engine-shm": "shm_buffer"}


def _gpu_id(uuid: str) -> str:
    """nvidia-smi writes GPU-<uuid>, torch the bare uuid."""
    return uuid.lower().removeprefix("gpu-")


def check_registration(
    store_name: str, layout: StoreLayout, body: Any, *, kind: str, device_uuid: str | None
) -> tuple[str, dict[str, Any]]:
    """(engine name, buffer handle) from a registration body, checked against the store and its config.

    ``kind`` is store.kind; ``device_uuid`` the GPU a CUDA buffer must be on (None: any).  Only the
    claims are checked here; mapping the buffer (``attach_buffer``) checks what is really there.
    """
    if not isinstance(body, dict):
        raise RegistrationError("BadRequest", "body must be a JSON object")
    engine, lay_hash, handle = body.get("engine"), body.get("layout_hash"), body.get("buffer")
    if not isinstance(engine, str) or not 1 <= len(engine) <= 128:
        raise RegistrationError("BadRequest", "engine must be a name of 1 to 128 characters")
    if not isinstance(lay_hash, str) or not isinstance(handle, dict):
        raise RegistrationError("BadRequest", "body needs layout_hash (hex) and buffer (engine.allocate's handle)")
    got, want = handle.get("kind"), ENGINE_BUFFER_KINDS[kind]
    if got not in ENGINE_BUFFER_KINDS.values():
        raise RegistrationError("BadRequest", f"buffer.kind must be cuda_ipc or shm_buffer, got {got!r}")
    if got != want:
        raise RegistrationError("KindMismatch", f"store.kind is {kind!r}: register a {want} buffer, not {got}")
    nbytes, buffer_id = handle.get("nbytes"), handle.get("buffer_id")
    for field, v in (("nbytes", nbytes), ("buffer_id", buffer_id)):
        if type(v) is not int or not 0 <= v < 1 << 63:
            raise RegistrationError("BadRequest", f"buffer.{field} must be a non-negative 63-bit integer")
    if lay_hash != layout.layout_hash.hex():
        raise RegistrationError(
            "LayoutMismatch",
            f"the buffer was laid out for layout {lay_hash[:16]}..., the store serves "
            f"{layout.layout_hash.hex()[:16]}...: allocate from the current GET /v1/layout",
        )
    assert isinstance(nbytes, int)
    if nbytes < layout.nbytes:
        raise RegistrationError("BufferTooSmall", f"the buffer holds {nbytes} bytes, the layout needs {layout.nbytes}")
    if got == "shm_buffer":
        name = handle.get("name")
        if not isinstance(name, str) or not name.startswith(f"{store_name}.buf."):
            raise RegistrationError("BadHandle", f"a CPU engine buffer must be named {store_name}.buf.<id> (allocate)")
    else:
        uuid = handle.get("device_uuid")
        if not isinstance(uuid, str) or not isinstance(handle.get("args"), dict):
            raise RegistrationError("BadRequest", "a cuda_ipc buffer needs args and device_uuid (export_buffer)")
        if device_uuid is not None and _gpu_id(uuid) != _gpu_id(device_uuid):
            raise RegistrationError("DeviceMismatch", f"store.device is GPU {device_uuid}; the buffer is on {uuid}")
    return engine, handle


# ---------------------------------------------------------------- updates


@dataclass(frozen=True, slots=True)
class ActivationStats:
    pause_s: float  # fence odd -> even: the time the engine may observe a write in progress
    journal_s: float  # journal written and fsynced (before the pause; serving continues)
    changed: int  # elements written
    bytes_written: int
    journal_bytes: int


class PreparedWrite(Prepared):
    """One store's prepared activation (``WeightStore.prepare``): what ``finish`` writes."""

    base: Header
    version: int
    root: bytes
    staged: list[TensorUpdate]
    data_ptr: int


def diff_updates(old: ServedModel, new: ServedModel, dense_fraction: float = DENSE_FRACTION) -> list[TensorUpdate]:
    """The in-place writes that turn ``old`` into ``new`` (protocol.diffscan per tensor)."""
    if old.specs != new.specs:
        raise StoreLayoutMismatch("the two versions do not have the same tensor names, dtypes and shapes")
    out: list[TensorUpdate] = []
    for i, spec in enumerate(old.specs):
        a, b = word_view(old.data[i], spec), word_view(new.data[i], spec)
        ch = scan(a, b)
        if len(ch) == 0:
            continue
        if len(ch) > dense_fraction * spec.numel:
            out.append(TensorUpdate(i, None, b, a))
        else:
            out.append(TensorUpdate(i, ch.positions, ch.new, ch.old))
    return out


FLAT_SLOT = -1  # a staged update of the whole store's words (WeightStore._flatten)


def _no_fault(point: str) -> None:
    pass


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _halves(pos: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> list[TensorUpdate]:
    """Sparse updates of the whole store's words (``FLAT_SLOT``) as two, so that the "mid_write"
    crash point falls between them."""
    half = pos.numel() // 2
    return [
        TensorUpdate(FLAT_SLOT, p, n, o)
        for p, n, o in ((pos[:half], new[:half], old[:half]), (pos[half:], new[half:], old[half:]))
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the store


class WeightStore:
    """The daemon's handle on the served weights (host shm, or an engine's buffer on any torch device)."""

    def __init__(self, seg: SharedSegment, layout: StoreLayout, shm_dir: Path | str) -> None:
        self.segment = seg
        self.layout = layout
        self.shm_dir = Path(shm_dir)
        self.control = ControlBlock(seg.mm)
        # The readers' handshake (daemon/fence_lock.py): every write that changes data waits for the
        # readers in flight; a pending word left by a daemon that died is forgotten (this one owns
        # the store: daemon.instance_lock).
        self.gate = WriteGate(readers_lock_path(seg.path), gid=os.stat(seg.path).st_gid)
        self.control.gate = self.gate
        self.control.set(OFF_WRITE_PENDING, 0)
        self.kind = self.control.get(OFF_KIND)
        self.data: torch.Tensor | None = None
        self.buffer: dict[str, Any] | None = None
        self._buffer_seg: SharedSegment | None = None
        self.exporter: Exporter | None = None  # the engine process that registered the buffer
        self.released_because: str | None = None  # why the last engine buffer was let go (its engine died)
        # Test hook: called with a crash point name ("journal_tmp", "journaled", "odd", "mid_write",
        # "written", "flipped", "loading"); crash tests kill the process there.
        self.fault: Callable[[str], None] = _no_fault
        # CPU threads for the fenced scatter and check (None: torch's setting).  One thread gives
        # the steadiest pause on a busy host; docs/weightstore.md has figures for both.
        self.write_threads: int | None = None
        if self.kind == KIND_HOST:
            off, cap = self.control.get(OFF_DATA), self.control.get(OFF_DATA + 8)
            if cap < layout.nbytes or off + cap > seg.size:
                raise StoreTooSmallError(layout.nbytes, min(cap, max(seg.size - off, 0)))
            self.data = seg.tensor(off, cap)

    # -- creation and re-attachment

    @classmethod
    def create(
        cls, name: str, layout: StoreLayout, *, capacity: int | None = None, engine_buffer: bool = False,
        shm_dir: Path | str = SHM_DIR, group: str = "",
    ) -> WeightStore:  # fmt: skip
        """A new store named ``name``: host data (default) or, with ``engine_buffer``, control only.

        The segment is mode 0660, of ``group`` when given (``api.group``), so engines of that group attach."""
        cap = layout.nbytes if capacity is None else capacity
        if cap < layout.nbytes:
            raise StoreTooSmallError(layout.nbytes, cap)
        text = json.dumps(layout.to_json(), separators=(",", ":")).encode()
        lay_cap = -(-(len(text) + 1) // PAGE) * PAGE
        tail = HANDLE_CAP if engine_buffer else -(-cap // PAGE) * PAGE
        seg = SharedSegment.create(name, CONTROL_SIZE + lay_cap + tail, shm_dir, group)
        seg.mm[CONTROL_SIZE : CONTROL_SIZE + len(text)] = text
        ctl = ControlBlock(seg.mm)
        tail_off = CONTROL_SIZE + lay_cap
        fields = {OFF_LAYOUT: CONTROL_SIZE, OFF_LAYOUT + 8: len(text)}
        if engine_buffer:
            fields |= {OFF_KIND: KIND_ENGINE_BUFFER, OFF_HANDLE: tail_off, OFF_HANDLE + 8: HANDLE_CAP}
        else:
            fields |= {OFF_KIND: KIND_HOST, OFF_DATA: tail_off, OFF_DATA + 8: cap}
        ctl.init(fields, layout.layout_hash)
        return cls(seg, layout, shm_dir)

    @classmethod
    def open(cls, name: str, *, layout: StoreLayout | None = None, shm_dir: Path | str = SHM_DIR) -> WeightStore:
        """Re-attach to an existing store (after a daemon restart); an engine buffer is re-imported if alive."""
        seg = SharedSegment.open(name, shm_dir)
        if seg.size < CONTROL_SIZE:
            raise StoreMissingError(f"shared memory {name!r} is too small to be a weight store")
        ctl = ControlBlock(seg.mm)
        lay_hash = ctl.check()
        found = StoreLayout.from_json(json.loads(ctl.blob(seg.mm, OFF_LAYOUT, OFF_LAYOUT + 8)))
        if found.layout_hash != lay_hash:
            raise StoreError(f"weight store {name!r}: its layout does not match its layout hash")
        if layout is not None and layout.specs != found.specs:
            raise StoreLayoutMismatch(f"weight store {name!r} is laid out for other tensors")
        store = cls(seg, found, shm_dir)
        if store.kind == KIND_ENGINE_BUFFER and ctl.get(OFF_HANDLE + 16):
            store._reimport(json.loads(ctl.blob(seg.mm, OFF_HANDLE, OFF_HANDLE + 16)))
        return store

    def _reimport(self, stored: dict[str, Any]) -> None:
        """A restarted daemon maps the buffer its predecessor wrote into, if its engine still lives."""
        recorded = Exporter.from_json(stored.pop("exporter", None))
        exporter = None
        if recorded is not None:
            exporter = Exporter.of_pid(recorded.pid)
            if exporter is None or exporter.start != recorded.start:
                if exporter is not None:
                    exporter.close()
                self._let_go(stored, f"the engine (pid {recorded.pid}) that registered the buffer died")
                return
        try:
            self.attach_buffer(stored, keep_contents=True, exporter=exporter)
        except StoreError:  # the engine is gone: wait for it to register a new buffer
            if exporter is not None:
                exporter.close()

    @classmethod
    def open_or_create(
        cls, name: str, layout: StoreLayout, *, engine_buffer: bool = False, shm_dir: Path | str = SHM_DIR
    ) -> WeightStore:
        """Re-attach if the store exists; replace a segment whose creation never finished."""
        try:
            return cls.open(name, layout=layout, shm_dir=shm_dir)
        except StoreMissingError:
            SharedSegment.path_for(name, shm_dir).unlink(missing_ok=True)
        return cls.create(name, layout, engine_buffer=engine_buffer, shm_dir=shm_dir)

    def attach_buffer(
        self, handle: dict[str, Any], *, keep_contents: bool = False, exporter: Exporter | None = None
    ) -> None:
        """Use the engine's buffer (its handle from engine.allocate); a new buffer makes the store EMPTY.

        The handle is kept in the control segment, so a restarted daemon re-imports it (``open``).
        ``exporter``: the engine process that registered it (the API's peer); the store lets the
        buffer go, unwritten, once that process is gone (``check_exporter``).
        """
        if self.kind != KIND_ENGINE_BUFFER:
            raise StoreStateError("a host store has its own data region")
        stored = handle if exporter is None else {**handle, "exporter": exporter.to_json()}
        text = json.dumps(stored, separators=(",", ":")).encode()
        if len(text) > self.control.get(OFF_HANDLE + 8):
            raise StoreError("engine buffer handle too large")
        data, seg = import_buffer(handle, self.shm_dir)
        try:
            self.bind_buffer(data, int(handle["buffer_id"]), keep_contents=keep_contents)
        except StoreError:
            if seg is not None:
                del data
                seg.close()
            raise
        if self._buffer_seg is not None and self._buffer_seg is not seg:
            self._buffer_seg.close()  # the previous engine's buffer
        if self.exporter is not None and self.exporter is not exporter:
            self.exporter.close()
        self._buffer_seg, self.buffer, self.exporter, self.released_because = seg, handle, exporter, None
        off = self.control.get(OFF_HANDLE)
        self.segment.mm[off : off + len(text)] = text
        self.control.set(OFF_HANDLE + 16, len(text))

    def bind_buffer(self, data: torch.Tensor, buffer_id: int, *, keep_contents: bool = False) -> None:
        """Use a flat uint8 buffer of this process (engine and daemon in one process; benchmarks)."""
        if self.kind != KIND_ENGINE_BUFFER:
            raise StoreStateError("a host store has its own data region")
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < self.layout.nbytes:
            raise StoreTooSmallError(self.layout.nbytes, data.numel() if data.dtype == torch.uint8 else 0)
        self.data, self.buffer = data, None
        self.control.set(OFF_HANDLE + 16, 0)
        if not (keep_contents and self.control.raw().buffer_id == buffer_id):
            self.control.begin(StoreState.EMPTY, gated=False)  # (nothing written: no reader to wait for)
            self.control.publish(0, ZERO_ROOT, StoreState.EMPTY, buffer_id=buffer_id)

    def check_exporter(self) -> str | None:
        """Let the buffer go if the engine that registered it died; why, or None while it lives.

        Nothing is written into the buffer (its memory may be freed or reused): the mapping is
        dropped, the stored handle forgotten, the store EMPTY until an engine registers again."""
        if self.exporter is None or self.exporter.alive():
            return self.released_because
        why = f"the engine (pid {self.exporter.pid}) that registered buffer {self.buffer_id or 0:x} died"
        self._let_go(self.buffer, why)
        return why

    def _let_go(self, handle: dict[str, Any] | None, why: str) -> None:
        log.warning("%s: its buffer is released, nothing more is written into it", why)
        self.data, self.buffer = None, None
        if self._buffer_seg is not None:
            self._buffer_seg.close()
            self._buffer_seg = None
        if handle is not None and handle.get("kind") == "shm_buffer":
            # The CPU twin's segment outlives a killed engine: the daemon removes the orphan
            # (its name was checked to be <store>.buf.<id> at registration).
            with contextlib.suppress(ValueError, OSError):
                SharedSegment.path_for(str(handle.get("name")), self.shm_dir).unlink(missing_ok=True)
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.control.set(OFF_HANDLE + 16, 0)
        self.control.begin(StoreState.EMPTY, gated=False)
        self.control.publish(0, ZERO_ROOT, StoreState.EMPTY, buffer_id=0)
        self.released_because = why

    def _require_live_buffer(self) -> torch.Tensor:
        why = self.check_exporter()
        if self.data is None and why is not None:
            raise StoreStateError(f"{why}: waiting for an engine to register a buffer")
        return self._require_data()

    @property
    def buffer_id(self) -> int | None:
        """Id of the engine buffer the store writes into (None: host store, or none attached)."""
        return None if self.buffer is None else int(self.buffer["buffer_id"])

    def attach_info(self) -> dict[str, Any]:
        """What an engine needs to attach (JSON-able; published on the daemon's API)."""
        info: dict[str, Any] = {
            "kind": "shm" if self.kind == KIND_HOST else "engine_buffer",
            "state": self.header().state.name.lower(),
            "name": self.segment.name,
            "shm_dir": str(self.shm_dir),
            "layout": self.layout.to_json(),
            "layout_hash": self.layout.layout_hash.hex(),
            "nbytes": self.layout.nbytes,
            "control": {"name": self.segment.name, "offset": 0, "size": CONTROL_SIZE},
        }
        if self.kind == KIND_HOST:
            info["data_offset"] = self.control.get(OFF_DATA)
        else:
            info["buffer"] = self.buffer
        return info

    def close(self) -> None:
        self.data = None
        self.gate.close()
        if self.exporter is not None:
            self.exporter.close()
        for seg in (self._buffer_seg, self.segment):
            if seg is not None:
                seg.close()

    def destroy(self) -> None:
        """Remove the store's segment and its readers' lock (engines that still map them keep them:
        a store made again under the name is another segment, which they do not read)."""
        self.segment.unlink()
        self.gate.path.unlink(missing_ok=True)
        self.close()

    # -- reading

    def header(self) -> Header:
        return self.control.raw()

    def _require_data(self) -> torch.Tensor:
        if self.data is None:
            raise StoreStateError("no engine buffer is attached to the store")
        return self.data

    def slot_bytes(self, i: int) -> torch.Tensor:
        s = self.layout.slots[i]
        return self._require_data()[s.offset : s.offset + s.nbytes]

    def slot_words(self, i: int) -> torch.Tensor:
        return word_view(self.slot_bytes(i), self.layout.slots[i].spec)

    def digests(self, on_device: bool | None = None) -> list[bytes]:
        """Per-tensor BLAKE3 of the store's bytes where they live: zero-copy on the host, and on the
        GPU for a GPU store (``device_digests``; only 32 bytes per tensor come back).  ``on_device``
        forces the torch path (True) or the host library (False; copies a GPU store to the host)."""
        slots = [self.slot_bytes(i) for i in range(len(self.layout.slots))]
        if on_device is None:
            on_device = self._require_data().device.type != "cpu"
        if on_device:
            try:
                return device_digests(slots)
            except torch.OutOfMemoryError:
                log.warning("no GPU memory for the device digest: hashing a host copy, tensor by tensor")
        return [bytes_digest(t) for t in slots]

    def root(self) -> bytes:
        return state_root(self.layout.specs, self.digests())

    def verify(self, root: bytes, what: str = "weight store") -> None:
        actual = self.root()
        if actual != root:
            raise StoreVerifyError(what, root, actual)

    def read_model(self, device: torch.device | str = "cpu") -> ServedModel:
        """A copy of the contents (to rebuild the daemon's shadow after a restart)."""
        return ServedModel(self.layout.specs, [self.slot_bytes(i).to(device, copy=True) for i in range(len(self))])

    def __len__(self) -> int:
        return len(self.layout.slots)

    # -- writing

    def mark_failed(self) -> None:
        self.control.begin(StoreState.FAILED, gated=False)  # (nothing written)
        self.control.publish(0, ZERO_ROOT, StoreState.FAILED)

    def load(self, model: ServedModel, version: int, root: bytes, *, verify: bool = True) -> None:
        """Write a whole version (first load, or after FAILED) with the fence odd; verify its root."""
        if model.specs != self.layout.specs:
            raise StoreLayoutMismatch("the model does not have the store's tensor names, dtypes and shapes")
        data = self._require_live_buffer()
        self.control.begin(StoreState.LOADING)
        for i, src in enumerate(model.data):
            dst = self.slot_bytes(i)
            if src.data_ptr() != dst.data_ptr() or src.device != dst.device:  # (an anchor decoded in place)
                dst.copy_(src)
            if i == len(model.data) // 2:
                self.fault("loading")
        _sync(data.device)
        if verify:
            actual = self.root()
            if actual != root:
                self.control.publish(0, ZERO_ROOT, StoreState.FAILED)
                raise StoreVerifyError(f"loaded version {version}", root, actual)
        self.control.publish(version, root, StoreState.READY)

    def stage(self, updates: list[TensorUpdate]) -> list[TensorUpdate]:
        """Check updates against the layout and move them to the store's device (before the pause)."""
        device = self._require_data().device
        out: list[TensorUpdate] = []
        seen: set[int] = set()
        for u in updates:
            if not 0 <= u.slot < len(self) or u.slot in seen:
                raise ValueError(f"update for slot {u.slot}: no such slot, or given twice")
            seen.add(u.slot)
            spec = self.layout.slots[u.slot].spec
            wd = spec.dt.word_dtype
            if u.new.dtype != wd or u.old.dtype != wd or u.new.shape != u.old.shape or u.new.dim() != 1:
                raise ValueError(f"update for {spec.name}: new/old must be flat {wd} tensors of equal length")
            if u.positions is None:
                if u.new.numel() != spec.numel:
                    raise ValueError(f"dense update for {spec.name} has {u.new.numel()} of {spec.numel} elements")
                pos = None
            else:
                p = u.positions
                if p.dtype != torch.int64 or p.shape != u.new.shape:
                    raise ValueError(f"update for {spec.name}: positions must be int64, one per value")
                if p.numel():
                    lo, hi = torch.aminmax(p)
                    if int(lo) < 0 or int(hi) >= spec.numel:
                        raise ValueError(f"update for {spec.name}: position out of range")
                pos = p.to(device, non_blocking=True)
            out.append(TensorUpdate(u.slot, pos, u.new.to(device, non_blocking=True), u.old.to(device)))
        out = self._flatten(out)
        _sync(device)
        return out

    def stage_flat(self, run: RankChanges) -> list[TensorUpdate] | None:
        """``stage`` for updates given as one run over the store's words (positions: word indices,
        ``StoreLayout.word_bases``; protocol/layout_flat.py routes them so): checked against the
        parameter each is given for (not only the store's words: a position past its parameter
        would land in the next one) and moved to its device as two updates of the whole store's
        words (``FLAT_SLOT``), so that the "mid_write" crash point falls between them.  None: the
        store's words are not one width or its buffer is not aligned to it (stage them per slot)."""
        data = self._require_data()
        bases = self.layout.word_bases()
        if bases is None or data.data_ptr() % self.layout.slots[0].spec.dt.width:
            return None
        positions, new, old = run.positions, run.new, run.old
        if not run.slots and positions.numel() == new.numel() == old.numel() == 0:
            return []  # (no change: its empty words' dtype says nothing of this store's)
        wd = self.layout.slots[0].spec.dt.word_dtype
        if new.dtype != wd or old.dtype != wd or new.shape != old.shape or new.dim() != 1:
            raise ValueError(f"store updates: new/old must be flat {wd} tensors of equal length")
        if positions.dtype != torch.int64 or positions.shape != new.shape:
            raise ValueError("store updates: positions must be int64, one per value")
        n = positions.numel()
        if len(run.slots) != len(run.counts) or sum(run.counts) != n or any(c <= 0 for c in run.counts):
            raise ValueError("store updates: the run's slots and counts do not cover its positions")
        if any(not 0 <= s < len(self) for s in run.slots) or any(a >= b for a, b in itertools.pairwise(run.slots)):
            raise ValueError("store updates: the run's slots are out of range or not ascending")
        if n:
            sizes = torch.tensor([self.layout.slots[s].spec.numel for s in run.slots], dtype=torch.int64)
            ends = torch.repeat_interleave(sizes.to(positions.device), torch.tensor(run.counts).to(positions.device))
            rel = run.within(bases)
            if not bool(((rel >= 0) & (rel < ends)).all()):
                raise ValueError("store updates: a position outside its parameter")
        device = data.device
        pos = positions.to(device, non_blocking=True)
        out = _halves(pos, new.to(device, non_blocking=True), old.to(device))
        _sync(device)
        return out

    def _flatten(self, staged: list[TensorUpdate]) -> list[TensorUpdate]:
        """The sparse updates as two updates of the whole store's words (``FLAT_SLOT``; positions
        offset by each slot's start) when every slot has one word width: a rank store has hundreds
        of parameters, and a scatter, gather and compare per parameter cost more than the values.
        Two, so that the "mid_write" crash point falls between them."""
        sparse = [u for u in staged if u.positions is not None]
        data = self._require_data()
        widths = {sl.spec.dt.width for sl in self.layout.slots}
        if len(sparse) < 3 or len(widths) != 1 or data.data_ptr() % (w := widths.pop()):
            return staged
        if any(sl.offset % w for sl in self.layout.slots):
            return staged
        pos = torch.cat(
            [u.positions + self.layout.slots[u.slot].offset // w for u in sparse if u.positions is not None]
        )
        new = torch.cat([u.new for u in sparse])
        old = torch.cat([u.old for u in sparse])
        return [u for u in staged if u.positions is None] + _halves(pos, new, old)

    def _words(self, slot: int) -> torch.Tensor:
        """A slot's words, or (``FLAT_SLOT``) all of the store's words (one width: ``_flatten``)."""
        if slot != FLAT_SLOT:
            return self.slot_words(slot)
        end = max(sl.offset + sl.nbytes for sl in self.layout.slots)
        return self._require_data()[:end].view(self.layout.slots[0].spec.dt.word_dtype)

    def write_values(self, staged: list[TensorUpdate], *, new: bool = True) -> bool:
        """Scatter new (or old) values, then gather and compare them; True if all read back equal.

        Must run inside the fence.  On a GPU this is one sync at the end (the comparison).
        """
        data = self._require_data()
        bad = torch.zeros((), dtype=torch.int64, device=data.device)
        for k, u in enumerate(staged):
            w = self._words(u.slot)
            vals = u.new if new else u.old
            if u.positions is None:
                w.copy_(vals)
            else:
                w.index_copy_(0, u.positions, vals)
            if k == (len(staged) - 1) // 2:
                self.fault("mid_write")
        for u in staged:
            w = self._words(u.slot)
            vals = u.new if new else u.old
            got = w if u.positions is None else torch.index_select(w, 0, u.positions)
            bad += torch.count_nonzero(got != vals)
        return int(bad) == 0

    def write_fenced(self, base: Header, version: int, root: bytes, staged: list[TensorUpdate]) -> None:
        """Inside the fence: scatter ``staged`` (journaled already), check it, publish ``version``.

        When the values do not read back, the old ones are written back and ``base`` re-published
        (or the store goes FAILED) and StoreVerifyError is raised.
        """
        self.control.begin(StoreState.WRITING)
        self.fault("odd")
        with torch_threads(self.write_threads):
            ok = self.write_values(staged)
        self.fault("written")
        if not ok:
            back = self.write_values(staged, new=False)
            if back:
                self.control.publish(base.version, base.root, StoreState.READY)
            else:
                self.control.publish(0, ZERO_ROOT, StoreState.FAILED)
            kept = f"version {base.version} restored" if back else "store FAILED"
            raise StoreVerifyError(f"values written for version {version} did not read back ({kept})", root, ZERO_ROOT)
        self.control.publish(version, root, StoreState.READY)
        self.fault("flipped")

    def activate(
        self, version: int, root: bytes, updates: list[TensorUpdate], journal_dir: Path | str
    ) -> ActivationStats:
        """Make ``version`` (state root ``root``) the served one by writing ``updates`` in place:
        ``finish(prepare(...))``.

        Order: stage and check -> journal (absolute old and new values, fsynced; JournalError here
        leaves memory untouched) -> wait for the readers in flight (``ReadersStalled`` past
        ``gate.wait_s``: memory untouched, journal removed) -> seq odd -> scatter -> gather and
        compare -> version/root -> seq even -> journal removed.  The caller has verified ``root``
        on its shadow copy.  After any other error, call ``daemon.journal.recover``.
        """
        return self.finish(self.prepare(version, root, updates, journal_dir))

    def prepare(self, version: int, root: bytes, updates: list[TensorUpdate], journal_dir: Path | str) -> PreparedWrite:
        """Everything of ``activate`` before the first byte the engine reads changes: stage and check,
        write and fsync the journal.  Serving goes on; the daemon prepares before it drains the
        sidecar or pauses the engine (daemon/prepared.py), then calls ``finish`` or ``abandon``."""
        self._require_live_buffer()
        hdr = self.control.raw()
        if hdr.state != StoreState.READY or not hdr.stable:
            raise StoreStateError(f"activate needs a READY store (it is {hdr.state.name}); load or recover first")
        staged = self.stage(updates)
        t0 = time.perf_counter()
        jbytes = journal.write_journal(
            Path(journal_dir), self.layout.layout_hash, (hdr.version, hdr.root), (version, root), updates,
            fault=self.fault,
        )  # fmt: skip
        prepared = PreparedWrite(Path(journal_dir), time.perf_counter() - t0, jbytes)
        prepared.base, prepared.version, prepared.root, prepared.staged = hdr, version, root, staged
        prepared.data_ptr = self._require_data().data_ptr()
        self.fault("journaled")
        return prepared

    def finish(self, prepared: PreparedWrite) -> ActivationStats:
        """The fenced write of a prepared activation: wait for the readers, scatter, check, publish,
        remove the journal.  A store that moved since ``prepare`` (another write, a buffer let go or
        replaced) is not written: the journal is removed and StoreStateError raised."""
        hdr = self.control.raw()
        moved = self.data is None or self.data.data_ptr() != prepared.data_ptr or hdr != prepared.base
        if moved:
            prepared.abandon()
            raise StoreStateError("the store changed between preparing the activation and writing it; not written")
        prepared.claim()
        t1 = time.perf_counter()
        try:
            self.write_fenced(hdr, prepared.version, prepared.root, prepared.staged)
        except (StoreVerifyError, ReadersStalled):  # (stalled: nothing was written)
            journal.remove_journal(prepared.journal_dir)
            raise
        t2 = time.perf_counter()
        # Best effort: a journal left behind only re-applies the values the store now holds.
        with contextlib.suppress(JournalError):
            journal.remove_journal(prepared.journal_dir)
        staged = prepared.staged
        changed = sum(u.count for u in staged)
        written = sum(u.count * u.new.element_size() for u in staged)
        return ActivationStats(t2 - t1, prepared.journal_s, changed, written, prepared.journal_bytes)

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
segments and buffer handles in daemon/engine.py; an engine's buffer registered, re-imported and let
go in daemon/store_buffer.py; the updates staged and scattered in daemon/store_updates.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon import journal
from patchswarm.daemon.device_blake3 import device_digests
from patchswarm.daemon.engine import SHM_DIR, SharedSegment
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.fence_lock import ReadersStalled, WriteGate, readers_lock_path
from patchswarm.daemon.prepared import Prepared
from patchswarm.daemon.store_buffer import StoreBuffer
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
    StoreStateError,
    StoreTooSmallError,
    StoreVerifyError,
    TensorUpdate,
)
from patchswarm.daemon.store_updates import device_sync, scatter_checked, stage_run, stage_updates, torch_threads
from patchswarm.protocol.layout_flat import RankChanges
from patchswarm.protocol.served import ServedModel, bytes_digest, state_root, word_view
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

__all__ = ["ActivationStats", "WeightStore"]

log = logging.getLogger("patchswarm.store")


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


def _no_fault(point: str) -> None:
    pass


# ---------------------------------------------------------------- the store


def _control_json(name: str, what: str, data: bytes) -> Any:
    """A JSON blob of a store's control segment, parsed strictly: the segment is writable by every
    process of api.group, and a garbled blob (deep nesting raised RecursionError) is a StoreError."""
    try:
        return load_json(data, max_bytes=len(data))  # (bounded by the segment it was read from)
    except UntrustedJSONError as e:
        raise StoreError(f"weight store {name!r}: its {what} is not strict JSON: {e}") from None


class WeightStore(StoreBuffer):
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
        found = StoreLayout.from_json(_control_json(name, "layout", ctl.blob(seg.mm, OFF_LAYOUT, OFF_LAYOUT + 8)))
        if found.layout_hash != lay_hash:
            raise StoreError(f"weight store {name!r}: its layout does not match its layout hash")
        if layout is not None and layout.specs != found.specs:
            raise StoreLayoutMismatch(f"weight store {name!r} is laid out for other tensors")
        store = cls(seg, found, shm_dir)
        if store.kind == KIND_ENGINE_BUFFER and ctl.get(OFF_HANDLE + 16):
            handle = _control_json(name, "engine buffer handle", ctl.blob(seg.mm, OFF_HANDLE, OFF_HANDLE + 16))
            if not isinstance(handle, dict):
                raise StoreError(f"weight store {name!r}: its engine buffer handle is not a JSON object")
            store._reimport(handle)
        return store

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
        device_sync(data.device)
        if verify:
            actual = self.root()
            if actual != root:
                self.control.publish(0, ZERO_ROOT, StoreState.FAILED)
                raise StoreVerifyError(f"loaded version {version}", root, actual)
        self.control.publish(version, root, StoreState.READY)

    def stage(self, updates: list[TensorUpdate]) -> list[TensorUpdate]:
        """Check updates against the layout and move them to the store's device (before the pause;
        daemon/store_updates.py ``stage_updates``)."""
        return stage_updates(self.layout, self._require_data(), updates)

    def stage_flat(self, run: RankChanges) -> list[TensorUpdate] | None:
        """``stage`` for updates given as one run over the store's words (daemon/store_updates.py
        ``stage_run``); None: stage them per slot."""
        return stage_run(self.layout, self._require_data(), run)

    def write_values(self, staged: list[TensorUpdate], *, new: bool = True) -> bool:
        """Scatter new (or old) values, then gather and compare them; True if all read back equal.
        Must run inside the fence (daemon/store_updates.py ``scatter_checked``)."""
        return scatter_checked(self.layout, self._require_data(), staged, new=new, fault=self.fault)

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

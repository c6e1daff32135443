"""The activation journal: what an activation will write, durable before memory is touched.

One file, ``<journal dir>/activation.journal``, exists exactly while an activation may have
left the store between two versions.  It holds absolute values (positions, old words, new
words per tensor), so re-applying either side is idempotent.  Bytes:

    magic "PSWJRNL1" | u32 format | u32 H | H bytes msgpack header | body | BLAKE3-256 of all before

format 1 (one store):
header = {"layout_hash", "base": [version, root], "target": [version, root],
          "tensors": [[slot, count, pos_width (0: dense, 4 or 8), word_width], ...]}
body   = per tensor: count positions (u32/i64 LE), count old words, count new words.

format 2 (rank stores, daemon/rank_stores.py): one activation of N stores, all in one file, so
recovery sees every rank's writes or none of them:
header = {"ranks": [<a format-1 header>, ...]} (rank order); body = rank 0's tensors, rank 1's, ...
A new format number rather than a format-1 header with a list: a reader of format 1 must not take
a journal covering several stores for one store's.

It is written with protocol/files.py's ``write_atomic`` (a temporary file, fsynced, renamed) and
the directory fsynced; removed (and the directory fsynced) after the version flip.  ``recover``
runs when the daemon starts, on any store with the ``JournaledStore`` interface
(daemon/weightstore.py's ``WeightStore``).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

import blake3
import msgpack
import numpy as np
import torch

from patchswarm.daemon.store_format import (
    ControlBlock,
    Header,
    JournalError,
    StoreError,
    StoreLayout,
    StoreLayoutMismatch,
    StoreState,
    StoreVerifyError,
    TensorUpdate,
)
from patchswarm.protocol.files import FileTooLargeError, InputFileError, read_file, write_atomic
from patchswarm.protocol.files import fsync_dir as _fsync_dir  # (a name the fault tests patch)

JOURNAL_NAME = "activation.journal"
MAGIC = b"PSWJRNL1"
FORMAT = 1
FORMAT_RANKS = 2
_PREFIX = struct.Struct("<8sII")
_WRITE_CHUNK = 64 << 20
_MAX_HEADER = 64 << 20


class TornJournalError(JournalError):
    """A journal file that is truncated or fails its checksum."""


@dataclass(frozen=True, slots=True)
class RunUpdates:
    """One store's sparse updates given as one run (rank stores, protocol/layout_flat.py): ``counts[i]``
    changes of slot ``slots[i]`` (ascending) one after another; ``positions`` within each slot's
    tensor.  Written exactly as the per-slot ``TensorUpdate`` list they stand for (the same bytes),
    without a conversion and a system-call-sized part per slot."""

    slots: list[int]
    counts: list[int]
    positions: torch.Tensor  # int64
    new: torch.Tensor
    old: torch.Tensor

    def updates(self) -> list[TensorUpdate]:
        return [
            TensorUpdate(s, p, n, o)
            for s, p, n, o in zip(
                self.slots,
                torch.split(self.positions, self.counts),
                torch.split(self.new, self.counts),
                torch.split(self.old, self.counts),
                strict=True,
            )
        ]


@dataclass(frozen=True, slots=True)
class Journal:
    layout_hash: bytes
    base: tuple[int, bytes]  # (version, root) the store held
    target: tuple[int, bytes]  # (version, root) being activated
    updates: list[TensorUpdate]  # CPU tensors viewing the file's bytes
    run: RunUpdates | None = None  # (writing only) the updates as one run, instead of ``updates``


def journal_path(journal_dir: Path) -> Path:
    return journal_dir / JOURNAL_NAME


def _write_all(fd: int, data: memoryview, h: blake3.blake3) -> None:
    h.update(data)
    for start in range(0, len(data), _WRITE_CHUNK):
        part = data[start : start + _WRITE_CHUNK]
        while len(part):
            part = part[os.write(fd, part) :]


def _host_bytes(t: torch.Tensor) -> memoryview:
    return t.detach().cpu().contiguous().numpy().data.cast("B")


def write_journal(
    journal_dir: Path,
    layout_hash: bytes,
    base: tuple[int, bytes],
    target: tuple[int, bytes],
    updates: list[TensorUpdate],
    *,
    fault: Callable[[str], None] | None = None,
) -> int:
    """Write and fsync one store's journal; returns its size.  Any OSError (ENOSPC...) becomes JournalError."""
    return _write(journal_dir, [Journal(layout_hash, base, target, updates)], FORMAT, fault)


def write_rank_journal(journal_dir: Path, ranks: list[Journal], *, fault: Callable[[str], None] | None = None) -> int:
    """Write and fsync one journal covering the activation of every rank store (format 2)."""
    return _write(journal_dir, ranks, FORMAT_RANKS, fault)


def _rank_header(j: Journal) -> tuple[dict[str, object], list[list[int]]]:
    tensors = []
    if j.run is not None:  # (_as_updates: every position below 2**32)
        ww = j.run.new.element_size()
        tensors = [[s, n, 4, ww] for s, n in zip(j.run.slots, j.run.counts, strict=True)]
    for u in j.updates:
        n = u.count
        pw = 0 if u.positions is None else 4 if n == 0 or int(u.positions.max()) < (1 << 32) else 8
        tensors.append([u.slot, n, pw, u.new.element_size()])
    return {"layout_hash": j.layout_hash, "base": list(j.base), "target": list(j.target), "tensors": tensors}, tensors


def _run_parts(run: RunUpdates) -> list[memoryview]:
    """A run's body: per slot its positions (u32), old words, new words, as slices of three arrays."""
    pos = run.positions.detach().cpu().numpy().astype("<u4").data
    old, new = (t.detach().cpu().contiguous().numpy().data for t in (run.old, run.new))
    parts: list[memoryview] = []
    at = 0
    for n in run.counts:
        parts += [pos[at : at + n].cast("B"), old[at : at + n].cast("B"), new[at : at + n].cast("B")]
        at += n
    return parts


def _as_updates(j: Journal) -> Journal:
    """A run with a position of 2**32 or more: its per-slot updates (8-byte positions where needed)."""
    if j.run is None:
        return j
    pos = j.run.positions
    if pos.numel() == 0 or int(pos.max()) < (1 << 32):
        return j
    return Journal(j.layout_hash, j.base, j.target, j.updates + j.run.updates())


def _write(journal_dir: Path, entries: list[Journal], fmt: int, fault: Callable[[str], None] | None) -> int:
    entries = [_as_updates(j) for j in entries]
    heads = [_rank_header(j) for j in entries]
    header = msgpack.packb(heads[0][0] if fmt == FORMAT else {"ranks": [h for h, _ in heads]})
    path = journal_path(journal_dir)
    size = 0

    def fill(tmp: str) -> None:
        nonlocal size
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            parts = [memoryview(_PREFIX.pack(MAGIC, fmt, len(header))), memoryview(header)]
            for j, (_, tensors) in zip(entries, heads, strict=True):
                if j.run is not None:
                    parts += _run_parts(j.run)
                    tensors = tensors[len(j.run.slots) :]
                for u, (_, _, pw, _) in zip(j.updates, tensors, strict=True):
                    if u.positions is not None:
                        pos = u.positions.detach().cpu().numpy().astype("<u4" if pw == 4 else "<i8", copy=False)
                        parts.append(np.ascontiguousarray(pos).data.cast("B"))
                    parts += [_host_bytes(u.old), _host_bytes(u.new)]
            # One buffer, hashed and written in two halves (the crash tests kill between them): rank
            # stores make thousands of small parts, each a system call and a hash update otherwise.
            data = memoryview(b"".join(parts))
            half = len(data) // 2
            _write_all(fd, data[:half], h)
            if fault is not None:
                fault("journal_tmp")
            _write_all(fd, data[half:], h)
            size += len(data)
            digest = h.digest()
            _write_all(fd, memoryview(digest), blake3.blake3())
            size += len(digest)
        finally:
            os.close(fd)

    try:
        # The directory must exist (a missing one is the operator's to fix); it is fsynced here, by the
        # name the fault tests patch.
        write_atomic(path, fill=fill, mode=0o600, sync_dir=False, create_dir=False)
        _fsync_dir(journal_dir)
    except OSError as e:
        with contextlib.suppress(OSError):  # renamed but not durable is not a journal to act on
            path.unlink(missing_ok=True)
        raise JournalError(f"cannot write the activation journal in {journal_dir}: {e}") from e
    return size


def journal_limit(nbytes: int) -> int:
    """The largest journal a store of ``nbytes`` can have: per element at most an 8-byte position
    and its old and new words (so 10 bytes per data byte), plus the header and framing."""
    return 10 * nbytes + _PREFIX.size + _MAX_HEADER + 32


def read_journal(journal_dir: Path, limit: int = 1 << 62) -> Journal | None:
    """The journal of one store, if one exists; TornJournalError if it is truncated, corrupt, larger than
    ``limit`` or not a regular file (read through protocol.files: bounded, no FIFO or device);
    StoreLayoutMismatch if it covers several rank stores (format 2)."""
    js = read_journals(journal_dir, limit)
    if js is None:
        return None
    if len(js) != 1:
        raise StoreLayoutMismatch(f"the journal in {journal_dir} covers {len(js)} rank stores, not one store")
    return js[0]


def read_journals(journal_dir: Path, limit: int = 1 << 62) -> list[Journal] | None:
    """Every store's part of the journal (format 1: one; format 2: one per rank), or None if there is none."""
    path = journal_path(journal_dir)
    try:
        data = read_file(path, limit)
    except FileTooLargeError:
        raise TornJournalError(f"{path}: larger than any journal of this store") from None
    except InputFileError as e:
        if e.reason == "no such file":
            return None
        if e.reason.startswith("not a regular file"):
            raise TornJournalError(f"{path}: {e.reason}") from None
        raise JournalError(f"cannot read {path}: {e.reason}") from None
    if len(data) < _PREFIX.size + 32:
        raise TornJournalError(f"{path}: truncated")
    body_end = len(data) - 32
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(memoryview(data)[:body_end])
    if h.digest() != data[body_end:]:
        raise TornJournalError(f"{path}: checksum mismatch")
    magic, fmt, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC or fmt not in (FORMAT, FORMAT_RANKS) or hlen > _MAX_HEADER:
        raise TornJournalError(f"{path}: not a journal of format {FORMAT} or {FORMAT_RANKS}")
    out: list[Journal] = []
    try:
        hd = msgpack.unpackb(data[_PREFIX.size : _PREFIX.size + hlen])
        heads = [hd] if fmt == FORMAT else hd["ranks"]
        if not isinstance(heads, list) or not heads:
            raise ValueError("no ranks")
        body = _Body(data, _PREFIX.size + hlen, body_end)
        for rh in heads:
            base = (int(rh["base"][0]), bytes(rh["base"][1]))
            target = (int(rh["target"][0]), bytes(rh["target"][1]))
            updates: list[TensorUpdate] = []
            for slot, n, pw, ww in rh["tensors"]:
                pos = None if pw == 0 else body.take(n, "<u4" if pw == 4 else "<i8").to(torch.int64)
                old = body.take(n, f"<i{ww}")
                updates.append(TensorUpdate(int(slot), pos, body.take(n, f"<i{ww}"), old))
            out.append(Journal(bytes(rh["layout_hash"]), base, target, updates))
    except (KeyError, TypeError, ValueError, IndexError, msgpack.UnpackException) as e:
        raise TornJournalError(f"{path}: malformed: {e}") from None
    if body.off != body_end:
        raise TornJournalError(f"{path}: body longer than its header says")
    return out


class _Body:
    def __init__(self, data: bytes, off: int, end: int) -> None:
        self.buf = np.frombuffer(data, dtype=np.uint8, count=end)
        self.off = off

    def take(self, count: int, dt: str) -> torch.Tensor:
        width = np.dtype(dt).itemsize
        arr = self.buf[self.off : self.off + count * width]
        if arr.size != count * width:
            raise ValueError("body shorter than its header says")
        self.off += arr.size
        return torch.from_numpy(arr.view(dt).copy())  # copy: aligned and writable


def remove_journal(journal_dir: Path) -> None:
    """Delete the journal (the activation is complete or undone) and make that durable."""
    try:
        journal_path(journal_dir).unlink(missing_ok=True)
        _fsync_dir(journal_dir)
    except OSError as e:
        raise JournalError(f"cannot remove the activation journal in {journal_dir}: {e}") from e


def _remove_temporaries(journal_dir: Path) -> None:
    for p in journal_dir.glob(f".{JOURNAL_NAME}.*.tmp"):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- recovery


class Action(Enum):
    CLEAN = "clean"  # no journal: the store holds the version its header names
    DISCARDED = "discarded"  # a torn journal, memory untouched: dropped
    ROLLED_FORWARD = "rolled_forward"  # the journaled activation was finished
    ROLLED_BACK = "rolled_back"  # the new values did not verify: the base version was restored
    NEEDS_LOAD = "needs_load"  # no version in the store (empty, load interrupted, failed): load one


@dataclass(frozen=True, slots=True)
class Recovery:
    action: Action
    version: int | None
    root: bytes | None


class JournaledStore(Protocol):
    """What recovery needs of a weight store (daemon/weightstore.py ``WeightStore``)."""

    @property
    def layout(self) -> StoreLayout: ...

    @property
    def control(self) -> ControlBlock: ...

    @property
    def data(self) -> torch.Tensor | None: ...

    def header(self) -> Header: ...

    def mark_failed(self) -> None: ...

    def stage(self, updates: list[TensorUpdate]) -> list[TensorUpdate]: ...

    def write_values(self, staged: list[TensorUpdate], *, new: bool = True) -> bool: ...

    def root(self) -> bytes: ...

    def verify(self, root: bytes, what: str = ...) -> None: ...


def recover(store: JournaledStore, journal_dir: Path | str, *, verify: bool = True) -> Recovery:
    """Bring the store to a version after a daemon restart; run before the daemon reports READY.

    With ``verify`` the state root of the store's contents is computed and must be the root the
    header (or journal) names; a mismatch leaves the store FAILED and raises StoreVerifyError.
    """
    journal_dir = Path(journal_dir)
    journal_dir.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(journal_dir)
    hdr = store.header()
    if hdr.state in (StoreState.EMPTY, StoreState.LOADING, StoreState.FAILED):
        remove_journal(journal_dir)  # no version to finish or restore (e.g. a new engine buffer): load one
        return Recovery(Action.NEEDS_LOAD, None, None)
    try:
        j = read_journal(journal_dir, journal_limit(store.layout.nbytes))
    except TornJournalError:
        remove_journal(journal_dir)
        return _without_journal(store, verify, Action.DISCARDED)
    if j is None:
        return _without_journal(store, verify, Action.CLEAN)
    _check_journal(store, j, journal_dir)
    staged = store.stage(j.updates)
    if _side(store, staged, j.target, verify, new=True):
        remove_journal(journal_dir)
        return Recovery(Action.ROLLED_FORWARD, *j.target)
    if _side(store, staged, j.base, verify, new=False):
        remove_journal(journal_dir)
        return Recovery(Action.ROLLED_BACK, *j.base)
    store.control.publish(0, bytes(32), StoreState.FAILED)
    remove_journal(journal_dir)
    raise StoreVerifyError(f"store after recovering version {j.target[0]}", j.target[1], store.root())


def recover_ranks(stores: Sequence[JournaledStore], journal_dir: Path | str, *, verify: bool = True) -> list[Recovery]:
    """``recover`` for the N rank stores of one daemon, whose activations share one journal (format 2).

    A complete journal is rolled forward on every rank that holds a version (READY at the base or
    the target, or mid-write); if any rank's new values do not verify, every rank is rolled back to
    the base, so all ranks end at one version.  A rank with no version (a new engine buffer, an
    interrupted load) needs a load whatever the journal says.  Without a journal each rank is
    checked on its own (``recover``'s table).
    """
    journal_dir = Path(journal_dir)
    journal_dir.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(journal_dir)
    empty = [s.header().state in (StoreState.EMPTY, StoreState.LOADING, StoreState.FAILED) for s in stores]
    try:
        js = read_journals(journal_dir, sum(journal_limit(s.layout.nbytes) for s in stores))
    except TornJournalError:
        remove_journal(journal_dir)
        js, torn = None, True
    else:
        torn = False
    if js is None:
        return [
            Recovery(Action.NEEDS_LOAD, None, None)
            if e
            else _without_journal(s, verify, Action.DISCARDED if torn else Action.CLEAN)
            for s, e in zip(stores, empty, strict=True)
        ]
    if len(js) != len(stores):
        raise StoreLayoutMismatch(f"the journal in {journal_dir} covers {len(js)} stores; the daemon has {len(stores)}")
    live = [(s, j) for s, j, e in zip(stores, js, empty, strict=True) if not e]
    for s, j in live:
        _check_journal(s, j, journal_dir)
    staged = [s.stage(j.updates) for s, j in live]
    if all(_side(s, st, j.target, verify, new=True) for (s, j), st in zip(live, staged, strict=True)):
        action = Action.ROLLED_FORWARD
    elif all([_side(s, st, j.base, verify, new=False) for (s, j), st in zip(live, staged, strict=True)]):
        action = Action.ROLLED_BACK  # (a list: every rank is rolled back, even after one fails)
    else:
        for s, _ in live:
            if s.header().state != StoreState.READY:
                s.mark_failed()
        remove_journal(journal_dir)
        raise StoreVerifyError(f"rank stores after recovering version {js[0].target[0]}", js[0].target[1], bytes(32))
    remove_journal(journal_dir)
    out = []
    for j, e in zip(js, empty, strict=True):
        side = j.target if action == Action.ROLLED_FORWARD else j.base
        out.append(Recovery(Action.NEEDS_LOAD, None, None) if e else Recovery(action, *side))
    return out


def _without_journal(store: JournaledStore, verify: bool, action: Action) -> Recovery:
    """No (usable) journal: a closed fence names the version held; an open one means unknown contents.

    A torn journal was renamed only once complete and fsynced, so it means the disk lost it: memory
    was not touched if the fence is closed.  A write in progress with no journal: the journal
    directory was lost."""
    hdr = store.header()
    if hdr.state in (StoreState.EMPTY, StoreState.LOADING, StoreState.FAILED):
        return Recovery(Action.NEEDS_LOAD, None, None)
    if not (hdr.state == StoreState.READY and hdr.stable):
        store.mark_failed()
        return Recovery(Action.NEEDS_LOAD, None, None)
    _check(store, hdr.root, hdr.version, verify)
    return Recovery(action, hdr.version, hdr.root)


def _check_journal(store: JournaledStore, j: Journal, journal_dir: Path) -> None:
    hdr = store.header()
    if j.layout_hash != store.layout.layout_hash:
        raise StoreLayoutMismatch(f"the journal in {journal_dir} was written for another store layout")
    if hdr.state == StoreState.READY and hdr.stable and hdr.version not in (j.base[0], j.target[0]):
        raise StoreError(f"the journal moves {j.base[0]} -> {j.target[0]} but the store holds {hdr.version}")
    if store.data is None:
        raise StoreError("the store has no engine buffer attached; recover after the engine registers one")


def _side(
    store: JournaledStore, staged: list[TensorUpdate], side: tuple[int, bytes], verify: bool, *, new: bool
) -> bool:
    """Write one side (new or old values) of a journaled activation inside the fence; publish it if it verifies."""
    store.control.begin(StoreState.RECOVERING)
    if store.write_values(staged, new=new) and (not verify or store.root() == side[1]):
        store.control.publish(*side, StoreState.READY)
        return True
    return False


def _check(store: JournaledStore, root: bytes, version: int, verify: bool) -> None:
    if not verify:
        return
    try:
        store.verify(root, f"weight store holding version {version}")
    except StoreVerifyError:
        store.mark_failed()
        raise

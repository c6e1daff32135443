"""Weight store: layout, creation and re-attachment, loads, activations, errors (in one process).

Crash recovery is in test_journal.py; other processes (engines, readers) in test_engine_attach.py.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.daemon import weightstore
from patchswarm.daemon.device_blake3 import device_digests
from patchswarm.daemon.engine import FenceReader, SharedSegment, allocate, attach
from patchswarm.daemon.fence_lock import ReadersStalled
from patchswarm.daemon.journal import journal_path
from patchswarm.daemon.store_buffer import RegistrationError, check_registration
from patchswarm.daemon.store_format import (
    ALIGN,
    CONTROL_SIZE,
    OFF_HANDLE,
    ControlBlock,
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
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel, TensorSpec, layout_hash
from tests.support.store_worker import SPECS, model, remove_segments, unique_name
from tests.support.strategies import layouts, patch_cases


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("ws")
    yield n
    remove_segments(n)


@pytest.fixture
def loaded(name: str) -> Iterator[WeightStore]:
    """A host store holding version 1 of the test model."""
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    m = model(7, 1)
    store.load(m, 1, m.root())
    yield store
    store.close()


# ---------------------------------------------------------------- layout


@given(layouts())
def test_layout_round_trip_and_alignment(specs: list[TensorSpec]) -> None:
    lay = StoreLayout.from_specs(specs)
    assert lay.specs == specs
    assert lay.layout_hash == layout_hash(specs)
    again = StoreLayout.from_json(json.loads(json.dumps(lay.to_json())))
    assert again == lay
    end = 0
    for s in lay.slots:
        assert s.offset % ALIGN == 0 and s.offset >= end
        end = s.offset + s.nbytes
    assert lay.nbytes >= end and lay.nbytes % ALIGN == 0


def test_layout_from_json_rejects_bad_slots() -> None:
    good = StoreLayout.from_specs(SPECS).to_json()
    misaligned = [list(s) for s in good]
    misaligned[1][3] += 2
    overlapping = [list(s) for s in good]
    overlapping[1][3] = 0
    missized = [list(s) for s in good]
    missized[0][4] += 1
    for bad in (misaligned, overlapping, missized, [good[1], good[0]], [[1, 2]]):
        with pytest.raises(StoreError):
            StoreLayout.from_json(bad)


# ---------------------------------------------------------------- creation and re-attachment


def test_create_open_and_layout_mismatch(name: str) -> None:
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay)
    assert store.header().state == StoreState.EMPTY
    assert (Path("/dev/shm") / name).exists()
    with pytest.raises(StoreError):
        WeightStore.create(name, lay)  # exists already
    again = WeightStore.open(name, layout=lay)
    assert again.layout == lay
    other = StoreLayout.from_specs([TensorSpec("x", "BF16", (4,))])
    with pytest.raises(StoreLayoutMismatch):
        WeightStore.open(name, layout=other)
    with pytest.raises(StoreLayoutMismatch):
        WeightStore.open_or_create(name, other)
    store.destroy()
    assert not (Path("/dev/shm") / name).exists()
    with pytest.raises(StoreMissingError):
        WeightStore.open(name)


def test_open_or_create_replaces_unfinished_segment(name: str) -> None:
    SharedSegment.create(name, CONTROL_SIZE).close()  # created, never initialized (no magic)
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.open_or_create(name, lay)
    assert store.header().state == StoreState.EMPTY and store.layout == lay
    assert WeightStore.open_or_create(name, lay).layout == lay  # and re-attaches the second time


def test_store_smaller_than_model(name: str) -> None:
    lay = StoreLayout.from_specs(SPECS)
    with pytest.raises(StoreTooSmallError) as e:
        WeightStore.create(name, lay, capacity=lay.nbytes - 1)
    assert e.value.needed == lay.nbytes
    # An engine buffer smaller than the layout is refused too.
    store = WeightStore.create(name, lay, engine_buffer=True)
    small = SharedSegment.create(f"{name}.small", 4096)
    with pytest.raises(StoreTooSmallError):
        store.attach_buffer({"kind": "shm_buffer", "name": small.name, "nbytes": 4096, "buffer_id": 5})
    assert store.data is None


# ---------------------------------------------------------------- load, activate, read back


def test_load_activate_read_model(loaded: WeightStore, tmp_path: Path) -> None:
    assert loaded.header().version == 1 and loaded.header().state == StoreState.READY
    assert loaded.read_model().bitwise_equal(model(7, 1))
    for k in (2, 3, 4):
        old, new = model(7, k - 1), model(7, k)
        ups = diff_updates(old, new)
        stats = loaded.activate(k, new.root(), ups, tmp_path)
        assert stats.changed == sum(u.count for u in ups) > 0
        assert loaded.read_model().bitwise_equal(new)
        assert loaded.root() == new.root()
        h = loaded.header()
        assert (h.version, h.root, h.stable, h.state) == (k, new.root(), True, StoreState.READY)
        assert not journal_path(tmp_path).exists()
    loaded.verify(model(7, 4).root())
    with pytest.raises(StoreVerifyError):
        loaded.verify(model(7, 3).root())


@given(patch_cases())
def test_diff_updates_reproduce_target(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base, target, _ = case
    work = base.clone()
    for u in diff_updates(base, target):
        w = work.data[u.slot].view(u.new.dtype) if work.specs[u.slot].numel else None
        assert w is not None
        if u.positions is None:
            w.copy_(u.new)
        else:
            w[u.positions] = u.new
    assert work.bitwise_equal(target)


def test_diff_updates_dense_and_sparse() -> None:
    a, b = model(3, 1), model(3, 2)
    ups = {a.specs[u.slot].name: u for u in diff_updates(a, b)}
    assert ups["c.bias"].positions is None  # rewritten whole
    assert ups["a.weight"].positions is not None and ups["a.weight"].positions.dtype == torch.int64
    assert "f.empty" not in ups


def test_load_refuses_wrong_layout_and_wrong_root(name: str) -> None:
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS))
    other = ServedModel.from_tensors({"x": torch.zeros(4)})
    with pytest.raises(StoreLayoutMismatch):
        store.load(other, 1, other.root())
    m = model(1, 1)
    with pytest.raises(StoreVerifyError):
        store.load(m, 1, model(1, 2).root())
    h = store.header()
    assert h.state == StoreState.FAILED and h.stable
    with pytest.raises(StoreStateError):
        store.activate(2, m.root(), [], Path("."))


def test_activate_rejects_bad_updates_before_touching_anything(loaded: WeightStore, tmp_path: Path) -> None:
    before = loaded.header()
    w = torch.zeros(3, dtype=torch.int16)
    bad = [
        TensorUpdate(99, None, w, w),  # no such slot
        TensorUpdate(0, torch.tensor([0, 1, 2]), w.int(), w.int()),  # wrong word dtype
        TensorUpdate(0, torch.tensor([0, 1, 10**9]), w, w),  # position out of range
        TensorUpdate(0, None, w, w),  # dense but not the whole tensor
    ]
    for u in bad:
        with pytest.raises(ValueError):
            loaded.activate(2, bytes(32), [u], tmp_path)
    assert loaded.header() == before
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("failing", ["os.write", "os.fsync", "dir fsync"])
def test_disk_full_aborts_before_touching_memory(loaded: WeightStore, tmp_path: Path, failing: str) -> None:
    """ENOSPC/EIO while journaling (write, file fsync, or directory fsync after the rename) touches nothing."""
    from patchswarm.daemon import journal

    before, contents = loaded.header(), loaded.read_model()
    new = model(7, 2)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    target: tuple[object, str] = {"os.write": (os, "write"), "os.fsync": (os, "fsync"),
                                  "dir fsync": (journal, "_fsync_dir")}[failing]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(*target, full)
        with pytest.raises(JournalError, match="No space left"):
            loaded.activate(2, new.root(), diff_updates(contents, new), tmp_path)
    assert loaded.header() == before  # the fence never moved
    assert loaded.read_model().bitwise_equal(contents)
    assert list(tmp_path.iterdir()) == []  # no journal, temporary or final, is left to act on
    assert loaded.activate(2, new.root(), diff_updates(contents, new), tmp_path).changed > 0


def test_journal_dir_missing_is_a_journal_error(loaded: WeightStore, tmp_path: Path) -> None:
    new = model(7, 2)
    with pytest.raises(JournalError):
        loaded.activate(2, new.root(), diff_updates(model(7, 1), new), tmp_path / "nope")
    assert loaded.header().version == 1


def test_written_values_that_do_not_read_back_are_rolled_back(loaded: WeightStore, tmp_path: Path) -> None:
    """A write that does not read back (simulated by corrupting memory mid-write) restores the base."""
    old, new = model(7, 1), model(7, 2)
    ups = diff_updates(old, new)
    first = ups[0]
    assert first.positions is None or len(first.positions) > 0

    hits: list[str] = []

    def corrupt(point: str) -> None:
        if point == "mid_write" and not hits:  # once: the roll-back write goes through
            hits.append(point)
            w = loaded.slot_words(first.slot)
            i = 0 if first.positions is None else int(first.positions[0])
            w[i] = ~w[i]

    loaded.fault = corrupt
    with pytest.raises(StoreVerifyError):
        loaded.activate(2, new.root(), ups, tmp_path)
    h = loaded.header()
    assert (h.version, h.state, h.stable) == (1, StoreState.READY, True)
    assert loaded.read_model().bitwise_equal(old)
    assert not journal_path(tmp_path).exists()


def test_fence_moves_once_per_activation_and_consistent_detects_it(loaded: WeightStore, tmp_path: Path) -> None:
    view = attach(loaded.attach_info())
    seq = view.fence.seq()
    quiet = view.fence.consistent(lambda: view.tensor("a.weight").float().sum().item())
    assert (quiet.version, quiet.root, quiet.changed) == (1, model(7, 1).root(), False)
    new = model(7, 2)
    # A write begun while a reader holds the fence waits for it: from inside the read it never
    # begins (the bound says why, nothing is written) ...
    loaded.gate.wait_s = 0.05
    with pytest.raises(ReadersStalled, match="nothing was written"):
        view.fence.consistent(lambda: loaded.activate(2, new.root(), diff_updates(model(7, 1), new), tmp_path))
    assert view.fence.seq() == seq and not journal_path(tmp_path).exists()
    # ... and the seqlock alone (a reader without the handshake) still sees a write that overlaps it.
    unlocked = FenceReader(view.fence.control)
    noisy = unlocked.consistent(lambda: loaded.activate(2, new.root(), diff_updates(model(7, 1), new), tmp_path))
    assert noisy.changed and noisy.version == 1
    assert view.fence.seq() == seq + 2
    assert view.read_version() == (2, new.root())
    view.close()


def test_fence_reader_waits_then_times_out() -> None:
    buf = bytearray(CONTROL_SIZE)
    from patchswarm.daemon.store_format import ControlBlock

    ctl = ControlBlock(buf)
    ctl.begin(StoreState.WRITING)
    now = [0.0]
    fence = FenceReader(ctl, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert fence.header() is None and fence.read_version() is None
    with pytest.raises(TimeoutError):
        fence.wait_stable(timeout=0.01)
    ctl.publish(9, b"r" * 32, StoreState.READY)
    assert fence.read_version() == (9, b"r" * 32)
    assert fence.consistent(lambda: 5).value == 5


# ---------------------------------------------------------------- engine buffer (GPU variant), on "cpu"


def test_engine_buffer_store_on_cpu(name: str, tmp_path: Path) -> None:
    """The GPU placement's logic with device "cpu": engine allocates, daemon writes through the handle."""
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    info = store.attach_info()
    assert info["kind"] == "engine_buffer" and info["buffer"] is None
    with pytest.raises(StoreStateError):
        store.load(model(2, 1), 1, model(2, 1).root())
    engine = allocate(info, "cpu")
    assert engine.handle is not None and engine.handle["kind"] == "shm_buffer"
    store.attach_buffer(engine.handle)
    assert store.attach_info()["buffer"] == engine.handle
    assert engine.read_version() is None  # nothing loaded into the new buffer yet
    m1, m2 = model(2, 1), model(2, 2)
    store.load(m1, 1, m1.root())
    assert engine.read_version() == (1, m1.root())
    store.activate(2, m2.root(), diff_updates(m1, m2), tmp_path)
    assert engine.read_version() == (2, m2.root())
    got = ServedModel(lay.specs, [engine.data[s.offset : s.offset + s.nbytes].clone() for s in lay.slots])
    assert got.bitwise_equal(m2)
    # A restarted daemon re-attaches by name and re-imports the engine's buffer from the control segment.
    store.close()
    again = WeightStore.open(name, layout=lay)
    assert again.data is not None and again.header().version == 2
    again.verify(m2.root())
    # A new engine buffer (engine restarted) makes the store EMPTY; the old engine's fence sees no version.
    engine2 = allocate(info, "cpu")
    assert engine2.handle is not None
    again.attach_buffer(engine2.handle)
    assert again.header().state == StoreState.EMPTY
    assert engine.read_version() is None and engine2.read_version() is None
    again.load(m2, 2, m2.root())
    assert engine2.read_version() == (2, m2.root()) and engine.read_version() is None
    engine.close()
    engine2.close()
    assert not list(Path("/dev/shm").glob(f"{name}.buf.*"))


def test_engine_buffer_device_store_reopened_without_engine(name: str) -> None:
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    engine = allocate(store.attach_info(), "cpu")
    assert engine.handle is not None
    store.attach_buffer(engine.handle)
    m = model(4, 1)
    store.load(m, 1, m.root())
    engine.close()  # the engine exits: its buffer is gone
    store.close()
    again = WeightStore.open(name)
    assert again.data is None  # waits for the engine to register a new buffer
    with pytest.raises(StoreStateError):
        again.root()


def test_attach_info_is_json_and_numpy_views(loaded: WeightStore) -> None:
    info = json.loads(json.dumps(loaded.attach_info()))
    assert info["kind"] == "shm" and info["layout_hash"] == loaded.layout.layout_hash.hex()
    view = attach(info)
    m = model(7, 1)
    b = view.array("b.weight")
    assert b.dtype == np.float32 and b.shape == (200, 100)
    assert np.array_equal(b.view(np.uint8).reshape(-1), m.data[1].numpy())
    assert view.array("a.weight").dtype == np.int16  # bf16 has no numpy dtype: its words
    assert view.tensor("a.weight").dtype == torch.bfloat16
    assert set(view.tensors()) == {s.name for s in SPECS}
    view.close()


# ---------------------------------------------------------------- digests where the weights live


EDGE_LENGTHS = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3072, 3073, 5 * 1024 + 7, 8 * 1024, 9 * 1024 + 1]


@pytest.mark.parametrize("batch_chunks", [1 << 18, 3, 1])
def test_device_digests_equal_blake3(batch_chunks: int) -> None:
    """The torch BLAKE3 (what a GPU store hashes with) against the blake3 library, on the CPU:
    chunk and block edges, single-chunk roots, odd tree levels, tensors split across passes."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in EDGE_LENGTHS]
    assert device_digests(ts, batch_chunks=batch_chunks) == [blake3.blake3(t.numpy().data).digest() for t in ts]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 20 * 1024), min_size=1, max_size=4), st.integers(8, 64))
def test_device_digests_any_lengths(lengths: list[int], batch_chunks: int) -> None:
    ts = [torch.arange(n, dtype=torch.int64).mul_(2654435761).remainder_(251).to(torch.uint8) for n in lengths]
    assert device_digests(ts, batch_chunks=batch_chunks) == [blake3.blake3(t.numpy().data).digest() for t in ts]


def test_store_digests_on_device_path_match_host(loaded: WeightStore) -> None:
    assert loaded.digests(on_device=True) == loaded.digests(on_device=False) == model(7, 1).digests()


def test_device_digest_out_of_memory_falls_back_to_host_copies(
    loaded: WeightStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine may leave the daemon no GPU memory for the digest's scratch: the store hashes host copies."""

    def out_of_memory(tensors: list[torch.Tensor], batch_chunks: int | None = None) -> list[bytes]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(weightstore, "device_digests", out_of_memory)
    assert loaded.digests(on_device=True) == model(7, 1).digests()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_store_root_is_computed_on_the_gpu(name: str) -> None:
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    store.bind_buffer(torch.zeros(lay.nbytes, dtype=torch.uint8, device="cuda"), buffer_id=9)
    m = model(5, 1)
    store.load(m, 1, m.root())  # verified with the device digest
    assert store.digests() == store.digests(on_device=False) == m.digests()
    store.close()


# ---------------------------------------------------------------- engine registrations (POST /v1/store)


def test_registration_checks_name_each_mismatch() -> None:
    lay = StoreLayout.from_specs(SPECS)
    h = lay.layout_hash.hex()
    shm = {"kind": "shm_buffer", "name": "st.buf.01", "nbytes": lay.nbytes, "buffer_id": 1}
    gpu = {"kind": "cuda_ipc", "args": {}, "device_uuid": "ab-cd", "nbytes": lay.nbytes, "buffer_id": 2}

    def code(body: object, kind: str = "engine-shm", device: str | None = None) -> str:
        try:
            check_registration("st", lay, body, kind=kind, device_uuid=device)
        except RegistrationError as e:
            return e.code
        return "ok"

    assert code({"engine": "e", "layout_hash": h, "buffer": shm}) == "ok"
    assert code({"engine": "e", "layout_hash": h, "buffer": gpu}, "cuda") == "ok"
    assert code({"engine": "e", "layout_hash": h, "buffer": gpu}, "cuda", "GPU-AB-CD") == "ok"  # nvidia-smi spelling
    assert code({"engine": "e", "layout_hash": h, "buffer": gpu}, "cuda", "ef-01") == "DeviceMismatch"
    assert code({"engine": "e", "layout_hash": h, "buffer": gpu}) == "KindMismatch"
    assert code({"engine": "e", "layout_hash": h, "buffer": shm}, "cuda") == "KindMismatch"
    assert code({"engine": "e", "layout_hash": "00" * 32, "buffer": shm}) == "LayoutMismatch"
    assert code({"engine": "e", "layout_hash": h, "buffer": shm | {"nbytes": lay.nbytes - 1}}) == "BufferTooSmall"
    assert code({"engine": "e", "layout_hash": h, "buffer": shm | {"name": "other.buf.1"}}) == "BadHandle"
    malformed = [
        ([], "engine-shm"),
        ({"engine": ""}, "engine-shm"),
        ({"engine": "e", "layout_hash": h}, "engine-shm"),
        ({"engine": "e", "layout_hash": h, "buffer": shm | {"buffer_id": -1}}, "engine-shm"),
        ({"engine": "e", "layout_hash": h, "buffer": {"kind": "x"}}, "engine-shm"),
        ({"engine": "e", "layout_hash": h, "buffer": gpu | {"device_uuid": 3}}, "cuda"),
    ]
    for body, kind in malformed:
        assert code(body, kind) == "BadRequest", body


def test_attach_buffer_refuses_a_buffer_smaller_than_claimed(name: str) -> None:
    lay = StoreLayout.from_specs(SPECS)
    store = WeightStore.create(name, lay, engine_buffer=True)
    small = SharedSegment.create(f"{name}.buf.small", 4096)
    with pytest.raises(StoreTooSmallError):
        store.attach_buffer({"kind": "shm_buffer", "name": small.name, "nbytes": lay.nbytes, "buffer_id": 3})
    assert store.data is None and store.attach_info()["buffer"] is None  # nothing changed
    small.unlink()
    small.close()
    store.close()


@pytest.mark.parametrize(
    "blob",
    [
        b"[" * 5000 + b"]" * 5000,  # raised RecursionError out of open(): a traceback, not a StoreError
        b'{"buffer_id": 1, "buffer_id": 2}',  # which buffer was meant?
        b'{"buffer_id": NaN}',
        b"[1, 2]",  # (not an object: AttributeError in the re-import)
    ],
)
def test_a_garbled_engine_handle_in_the_control_segment_is_a_store_error(name: str, blob: bytes) -> None:
    """The control segment is writable by every process of api.group: its JSON is read strictly."""
    store = WeightStore.create(name, StoreLayout.from_specs(SPECS), engine_buffer=True)
    ctl = ControlBlock(store.segment.mm)
    off = ctl.get(OFF_HANDLE)
    store.segment.mm[off : off + len(blob)] = blob
    ctl.set(OFF_HANDLE + 16, len(blob))
    store.close()
    with pytest.raises(StoreError, match="engine buffer handle"):
        WeightStore.open(name)

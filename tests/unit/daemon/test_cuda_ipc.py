"""The CUDA IPC rules on the CPU (daemon/cuda_ipc.py): the own-segment check over allocator snapshots,
the handle's validation, and why the daemon's release of an import never touches a counter.
The real export/import runs in tests/system/test_engine_attach.py and benchmarks/gpu_check.sh."""

from __future__ import annotations

import base64
import errno
import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.daemon import cuda_ipc
from patchswarm.daemon.cuda_ipc import (
    MIN_OWN_SEGMENT,
    NO_REF_COUNTER,
    ROUND_LARGE,
    IpcError,
    import_args,
    own_segment_bytes,
    segment_violation,
)

MiB = 1 << 20
BASE = 0x7F3A_4000_0000  # segment addresses as torch.cuda.memory_snapshot() reports them


def segment(address: int, total: int, blocks: list[tuple[int, int, str]], **extra: Any) -> dict[str, Any]:
    """One entry of torch.cuda.memory_snapshot() (the fields the check reads, as torch names them)."""
    return {
        "device": 0, "address": address, "total_size": total, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 1), "allocated_size": sum(b[1] for b in blocks if b[2] != "inactive"),
        "active_size": 0, "requested_size": 0, "is_expandable": False,
        "blocks": [{"address": a, "size": n, "requested_size": n, "state": s, "frames": []} for a, n, s in blocks],
    } | extra  # fmt: skip


def test_own_segment_passes() -> None:
    n = 64 * MiB
    snap = [segment(BASE, n, [(BASE, n, "active_allocated")]), segment(BASE + n, 20 * MiB, [])]
    assert segment_violation(BASE, n, snap) is None
    assert segment_violation(BASE, n - 100, snap) is None  # the engine's rounding is its own block


@pytest.mark.parametrize(
    ("snap", "ptr", "match"),
    [
        # carved from a cached block: the handle would export the segment from its start
        ([segment(BASE, 40 * MiB, [(BASE, 20 * MiB, "active_allocated"), (BASE + 20 * MiB, 20 * MiB,
                                                                           "active_allocated")])],
         BASE + 20 * MiB, "starts 20971520 bytes into"),
        # at the start, but other tensors (or free space the engine may reuse) share the segment
        ([segment(BASE, 40 * MiB, [(BASE, 20 * MiB, "active_allocated"), (BASE + 20 * MiB, 20 * MiB,
                                                                           "active_allocated")])],
         BASE, r"1 other block\(s\) \(1 in use\)"),
        ([segment(BASE, 40 * MiB, [(BASE, 20 * MiB, "active_allocated"), (BASE + 20 * MiB, 20 * MiB, "inactive")])],
         BASE, r"1 other block\(s\) \(0 in use\)"),
        ([segment(BASE, 1 << 34, [(BASE, 20 * MiB, "active_allocated")], is_expandable=True)], BASE, "expandable"),
        ([segment(BASE, 20 * MiB, [(BASE, 20 * MiB, "active_allocated")])], BASE + 64 * MiB, "not memory of torch"),
        ([], BASE, "not memory of torch"),
    ],
)  # fmt: skip
def test_shared_segments_are_refused(snap: list[dict[str, Any]], ptr: int, match: str) -> None:
    why = segment_violation(ptr, 20 * MiB, snap)
    assert why is not None
    assert __import__("re").search(match, why), why


def test_a_claim_past_the_segment_is_refused() -> None:
    snap = [segment(BASE, 20 * MiB, [(BASE, 20 * MiB, "active_allocated")])]
    assert "claims" in str(segment_violation(BASE, 21 * MiB, snap))


@given(st.integers(0, 1 << 40))
def test_own_segment_bytes_is_a_whole_large_segment(n: int) -> None:
    got = own_segment_bytes(n)
    assert got >= max(n, 1) and got % ROUND_LARGE == 0 and got >= MIN_OWN_SEGMENT
    assert got - max(n, MIN_OWN_SEGMENT) < ROUND_LARGE  # no more than the allocator's own rounding


def test_import_args_validate_hostile_handles() -> None:
    good = {"handle": base64.b64encode(b"\x01" + bytes(64)).decode(), "size": 20 * MiB, "offset": 0}
    assert import_args(good) == (b"\x01" + bytes(64), 20 * MiB, 0)
    bad: list[Any] = [
        None, [], {}, good | {"extra": 1}, good | {"handle": 5}, good | {"handle": "***"}, good | {"handle": ""},
        good | {"handle": base64.b64encode(bytes(5000)).decode()}, good | {"size": -1}, good | {"size": True},
        good | {"size": 1.5}, good | {"offset": 4096}, good | {"offset": "0"},
    ]  # fmt: skip
    for args in bad:
        with pytest.raises(IpcError):
            import_args(args)


def test_the_daemons_release_cannot_reach_any_counter() -> None:
    """torch's importer subtracts 1 from the counter file it is given when its storage is freed,
    ignoring a name it cannot open; NO_REF_COUNTER is one shm_open refuses whatever /dev/shm holds."""
    _posixshmem = pytest.importorskip("_posixshmem")
    for flags in (os.O_RDWR, os.O_RDWR | os.O_CREAT):
        with pytest.raises(OSError) as e:
            _posixshmem.shm_open(NO_REF_COUNTER.decode(), flags, 0o600)
        assert e.value.errno == errno.EINVAL


def test_ref_counter_value_reads_torchs_counter_file(tmp_path: Any) -> None:
    """The GPU check reads the engine's counter where torch keeps it (int64 slots in /dev/shm)."""
    name = f"/psw-test-counter-{os.getpid()}"
    path = f"/dev/shm{name}"
    with open(path, "wb") as fh:
        fh.write((7).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True))
    try:
        assert cuda_ipc.ref_counter_value(name.encode(), 0) == 7
        assert cuda_ipc.ref_counter_value(name.encode(), 1) == -1
    finally:
        os.unlink(path)

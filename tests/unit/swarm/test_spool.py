"""SpoolChunkStore: the download in progress in an unnamed file, handed over as one verified mapping."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchswarm.protocol.chunks import chunk_views, split
from patchswarm.protocol.errors import ChunkError
from patchswarm.protocol.patchfile import Version, build_version
from patchswarm.protocol.served import ServedModel
from patchswarm.swarm.spool import SpoolChunkStore

RUN = "spool-test"
NOW_MS = 1_800_000_000_000
CHUNK = 4 << 10


def _version(seed: int, version: int = 1) -> Version:
    gen = torch.Generator().manual_seed(seed)
    model = ServedModel.from_tensors({f"w{i}": torch.randn(64, 96, generator=gen).bfloat16() for i in range(3)})
    return build_version(None, model, run_id=RUN, version=version, now_ms=NOW_MS, chunk_size=CHUNK, level=1)


def _with_repeats(v: Version) -> Version:
    """The same manifest over a payload whose chunks 1 and 3 are equal (one hash at two offsets): the
    store sees only hashes, sizes and offsets."""
    payload = bytearray(v.payload)
    payload[3 * CHUNK : 4 * CHUNK] = payload[CHUNK : 2 * CHUNK]
    manifest = dataclasses.replace(v.manifest, chunks=tuple(split(payload, CHUNK)))
    return dataclasses.replace(v, manifest=manifest, payload=bytes(payload))


def _chunks(v: Version) -> list[tuple[bytes, bytes]]:
    return [(ref.hash, bytes(data)) for ref, data in chunk_views(v.payload, v.manifest.chunks)]


def _downloaded(folder: Path, v: Version, max_bytes: int = 1 << 20) -> SpoolChunkStore:
    """A store that began ``v``'s download and received each of its chunks, in order."""
    s = SpoolChunkStore(folder, max_bytes=max_bytes)
    s.begin(v.manifest)
    for h, data in _chunks(v):
        s.put(h, data)
    return s


def test_a_spooled_download_is_one_mapping_of_the_payload_and_its_chunks_stay_servable(tmp_path: Path) -> None:
    v = _with_repeats(_version(1))
    chunks = _chunks(v)
    assert len({h for h, _ in chunks}) < len(chunks)  # (the test covers a repeated chunk)
    s = SpoolChunkStore(tmp_path / "spool", max_bytes=1 << 20)
    s.begin(v.manifest)
    assert s.payload(v.manifest) is None  # nothing yet
    for h, data in reversed(chunks):  # (any order)
        s.put(h, data)
    assert s.nbytes == 0  # nothing in the heap's cache
    assert os.listdir(tmp_path / "spool") == []  # the file has no name
    whole = s.payload(v.manifest)
    assert whole is not None and whole.readonly and bytes(whole) == bytes(v.payload)
    for h, data in chunks:
        assert h in s and s.get(h) == data
    s.close()
    assert bytes(whole) == bytes(v.payload)  # the mapping outlives the store's descriptor


@pytest.mark.parametrize("by", ["release", "next download"])
def test_a_released_spool_keeps_its_newest_chunks_in_memory_within_the_bound(tmp_path: Path, by: str) -> None:
    a, b = _version(1), _version(2, version=2)
    s = _downloaded(tmp_path, a, max_bytes=3 * CHUNK)
    chunks = _chunks(a)
    if by == "release":
        s.release()
        assert s._spool is None
    else:
        s.begin(b.manifest)
    kept = [h for h, _ in chunks if h in s]
    assert kept == [h for h, _ in chunks[-3:]]  # the three last received
    assert s.nbytes == sum(len(d) for _, d in chunks[-3:]) and all(s.get(h) == d for h, d in chunks[-3:])
    s.close()


def test_chunks_held_before_a_download_begins_are_spooled_too(tmp_path: Path) -> None:
    v = _version(3)
    chunks = _chunks(v)
    s = SpoolChunkStore(tmp_path, max_bytes=1 << 20)
    s.put(*chunks[0])  # (cached from an earlier download)
    s.begin(v.manifest)
    for h, data in chunks[1:]:
        s.put(h, data)
    whole = s.payload(v.manifest)
    assert whole is not None and bytes(whole) == bytes(v.payload)
    s.begin(v.manifest)  # a retry of the same download keeps its spool
    assert s.payload(v.manifest) is not None
    s.close()


@pytest.mark.parametrize("served_first", [False, True])
def test_a_spool_changed_on_disk_is_caught(tmp_path: Path, served_first: bool) -> None:
    v = _version(4)
    chunks = _chunks(v)
    s = _downloaded(tmp_path, v)
    spool = s._spool
    assert spool is not None
    os.pwrite(spool.file.fileno(), b"\xff" * 8, len(chunks[0][1]) + 5)  # inside the second chunk
    if served_first:
        assert s.get(chunks[1][0]) is None  # never served, and no longer held: downloaded again
        assert chunks[1][0] not in s and s.payload(v.manifest) is None
        s.close()
        return
    with pytest.raises(ChunkError):
        s.payload(v.manifest)  # never decoded
    assert s._spool is None and chunks[0][0] not in s  # the retry fetches it all again


def test_without_a_usable_folder_the_download_stays_in_memory(tmp_path: Path) -> None:
    (tmp_path / "spool").write_bytes(b"")  # a file where the folder should be
    v = _version(5)
    s = _downloaded(tmp_path / "spool", v, max_bytes=1 << 30)
    assert s.payload(v.manifest) is None  # the caller assembles the chunks from get()
    assert b"".join(s.get(h) or b"" for h, _ in _chunks(v)) == bytes(v.payload)


@pytest.mark.asyncio
async def test_a_release_reads_the_kept_chunks_back_off_the_event_loop_and_serves_meanwhile(tmp_path: Path) -> None:
    # A daemon keeps up to an eighth of the model for peers: read back and hashed on the loop, that
    # would hold the API, the sidecar and every peer's request for seconds.
    v = _version(1)
    chunks = _chunks(v)
    s = _downloaded(tmp_path, v)
    seen: list[bool] = []

    async def meanwhile() -> None:  # runs while the release awaits its thread
        seen.append(all(s.get(h) == data for h, data in chunks))
        seen.append(s._spool is not None)

    await asyncio.gather(s.release_off_loop(), meanwhile())
    assert seen == [True, True]
    assert s._spool is None and s.nbytes == sum(len(d) for _, d in chunks)
    assert all(s.get(h) == data for h, data in chunks)
    await s.release_off_loop()  # (nothing spooled: nothing to do)
    s.close()


_FULL_DISK = """
import logging, resource, signal, sys
from pathlib import Path
from tests.unit.swarm.test_spool import CHUNK, _chunks, _downloaded, _version
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (writes past the limit fail with EFBIG, as on a full disk)
warnings = []
logging.getLogger("patchswarm.swarm").addHandler(logging.Handler())
logging.getLogger("patchswarm.swarm").handlers[0].emit = lambda r: warnings.append(r.getMessage())
v = _version(1)
chunks = _chunks(v)
resource.setrlimit(resource.RLIMIT_FSIZE, (2 * CHUNK + 100, resource.RLIM_INFINITY))
s = _downloaded(Path(sys.argv[1]), v)
assert s.payload(v.manifest) is None, "a partly spooled download is no mapping"
assert b"".join(s.get(h) or b"?" for h, _ in chunks) == bytes(v.payload)
assert s.nbytes == sum(len(d) for _, d in chunks[2:]), s.nbytes
print(len(warnings), warnings[0])
"""


def test_a_full_disk_mid_download_sends_the_rest_of_it_to_memory_with_one_warning(tmp_path: Path) -> None:
    # (a child process: the file size limit that stands in for a full disk is per process)
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    count, _, line = out.stdout.strip().partition(" ")
    assert count == "1" and "the rest of this download is kept in memory" in line, out.stdout

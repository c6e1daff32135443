"""Hypothesis over every parser of untrusted input (targets: tests/support/fuzz_targets.py).

The property, for each parser: arbitrary bytes, byte-level mutations of valid inputs (flips,
truncation, splices, dictionary tokens, huge lengths) and structure-aware ones (msgpack documents
re-encoded with wrong types, boundary values, missing and extra fields; TOML re-written with
wrong-typed values; safetensors headers and patch payload streams edited and re-framed) end in
the parser's documented error (a PatchswarmError; ConfigError for the config; ConstraintError
for the sidecar's weight_version) or a successful parse, never in another exception; and every
valid input parses and round-trips.  The patch codec's own hostile-payload tests are in
tests/unit/protocol/test_codec_bad_input.py; here it is one target among the others.

CI-sized; ``HYPOTHESIS_PROFILE=thorough`` runs more examples, benchmarks/fuzz.py a million.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.config import DaemonConfig
from patchswarm.daemon.sidecar import VersionConstraint, split_body_constraint
from patchswarm.protocol.errors import LimitExceededError, PatchswarmError, TruncatedError
from patchswarm.protocol.head import Head
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate, RootDocument
from patchswarm.protocol.wire import encode_frame
from tests.support import fuzz_targets as ft

NAMES = sorted(ft.TARGETS)
ROOT = Path(__file__).resolve().parents[3]
# Three times the profile's count: 180 per parser and property in CI, 1500 with the thorough profile.
EXAMPLES = settings(
    max_examples=3 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _parse_or_allowed(name: str, data: bytes) -> None:
    ft.check(name, data)  # raises UnexpectedError for anything but the target's own errors


@pytest.mark.parametrize("name", NAMES)
def test_seeds_parse(name: str) -> None:
    for seed in ft.seeds_of(name):
        assert ft.check(name, seed) is None, name


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes(name: str, data: bytes) -> None:
    _parse_or_allowed(name, data)


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(rng=st.randoms(use_true_random=False))
def test_mutated_valid_inputs(name: str, rng: random.Random) -> None:
    _parse_or_allowed(name, ft.mutate(rng, name))


MSGPACK_NAMES = [n for n in NAMES if ft.TARGETS[n].is_msgpack]

# Any msgpack value (within reason) for a structure-aware replacement.
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@pytest.mark.parametrize("name", MSGPACK_NAMES)
@EXAMPLES
@given(seed=st.integers(0, 7), path=st.lists(st.integers(0, 63), min_size=1, max_size=4), value=values)
def test_any_value_anywhere_in_a_document(name: str, seed: int, path: list[int], value: object) -> None:
    """Walk ``path`` into a seed document (index modulo the container size) and put ``value`` there."""
    pool = ft.seeds_of(name)
    root = [msgpack.unpackb(pool[seed % len(pool)], raw=False, use_list=True, strict_map_key=False)]
    parent: object = root
    key: object = 0
    for step in path:
        child = parent[key]  # type: ignore[index]
        if not isinstance(child, list | dict) or not child:
            break
        parent = child
        keys = list(child) if isinstance(child, dict) else list(range(len(child)))
        key = keys[step % len(keys)]
    parent[key] = value  # type: ignore[index]
    _parse_or_allowed(name, msgpack.packb(root[0], use_bin_type=True))


@pytest.mark.parametrize("name", NAMES)
def test_every_truncation_of_a_seed(name: str) -> None:
    seed = ft.seeds_of(name)[0]
    step = max(1, len(seed) // 97)  # about a hundred cut points per seed, always including the ends
    for n in [*range(0, len(seed), step), len(seed) - 1]:
        _parse_or_allowed(name, seed[:n])


# ---------------------------------------------------------------- round trips and huge lengths


def test_documents_round_trip_canonically() -> None:
    patch, anchor = ft.versions()
    for v in (patch, anchor):
        assert Manifest.from_bytes(v.signed.body).to_bytes() == v.signed.body
        assert ft.run_envelope(v.signed.to_bytes()) == v.manifest
    head = ft.head_of()
    assert Head.from_bytes(head.to_bytes()) == head
    root = RootDocument(1, (ft.ROOT.key_id,), (ft.OTHER.key_id,))
    assert RootDocument.from_bytes(root.to_bytes()) == root
    cert = Certificate(ft.TRAINER.key_id, ft.RUN, 0, 5)
    assert Certificate.from_bytes(cert.to_bytes()) == cert
    for frame in ft.gossip_frames():
        assert ft.run_frame(encode_frame(ft.SECRET, frame)) == frame


def test_valid_files_and_bodies_round_trip() -> None:
    base, target = ft.models()
    for packed in ft.seeds_of("patchfile"):
        model, digests = ft.run_patchfile(packed)  # type: ignore[misc]
        assert model.bitwise_equal(target) and model.metadata == target.metadata and digests == target.digests()
    loaded = ft.run_safetensors(ft.seeds_of("safetensors")[0])
    assert isinstance(loaded, ServedModel) and loaded.bitwise_equal(base) and loaded.metadata == base.metadata
    rest, constraint = split_body_constraint(ft.seeds_of("sidecar_body")[0], "application/json")
    assert json.loads(rest) == {"prompt": "hi"} and constraint == VersionConstraint(3, 4)
    cfg = ft.run_config((ft.REPO / "packaging" / "daemon.toml").read_bytes())
    assert isinstance(cfg, DaemonConfig) and cfg["swarm.run_id"] == "run-7"


HUGE_HEADERS = (b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff")
# Measured in a fresh process: tracemalloc counts every thread's allocations, and a thread an earlier
# test left finishing its work (a staged apply's buffer, a publisher's pool) once added 16 MiB here.
_MEASURE = """
import json, sys, tracemalloc
from tests.support import fuzz_targets as ft
peaks = {}
for name, header in json.loads(sys.argv[1]):
    header, seed = bytes.fromhex(header), ft.seeds_of(name)[0]
    tracemalloc.start()
    try:
        for data in (header, header + bytes(16), seed[:1] + header + seed[1:], seed[:-8] + header):
            ft.check(name, data)
        peaks[name + ":" + header.hex()] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
print(json.dumps(peaks))
"""


@pytest.fixture(scope="module")
def huge_header_peaks() -> dict[str, int]:
    cases = json.dumps([(n, h.hex()) for n in MSGPACK_NAMES for h in HUGE_HEADERS])
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, cases], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    peaks: dict[str, int] = json.loads(r.stdout)
    return peaks


@pytest.mark.parametrize(("name", "header"), [(name, header) for name in MSGPACK_NAMES for header in HUGE_HEADERS])
def test_huge_declared_lengths_are_refused_without_allocating(
    name: str, header: bytes, huge_header_peaks: dict[str, int]
) -> None:
    """A 4 GiB bin/str or a 4G-element array/map header: alone, and spliced into a valid document."""
    peak = huge_header_peaks[f"{name}:{header.hex()}"]
    assert peak < 16 << 20, peak


@pytest.mark.parametrize(
    ("declared", "error"),
    [(2**32 - 1, LimitExceededError), ((64 << 20) + 257, LimitExceededError), (1 << 20, TruncatedError)],
)
def test_patch_file_declaring_a_huge_manifest(declared: int, error: type[PatchswarmError]) -> None:
    data = bytearray(ft.seeds_of("patchfile")[0])
    data[12:16] = declared.to_bytes(4, "little")
    with pytest.raises(error):
        ft.run_patchfile(bytes(data))

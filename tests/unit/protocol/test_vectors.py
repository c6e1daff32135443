"""Negative vectors, after Sigstore's conformance suite: one folder per case under tests/vectors/.

    tests/vectors/<parser>/<case>/input.*        the bytes under test
                                  previous*.bin  documents accepted first, in name order (heads, roots)
                                  expected.toml  error = exact class name ("none": must be accepted),
                                                 message = a substring of the error, [context] = inputs

Keys, the certificate and the base/target models the cases refer to are fixture files in
tests/vectors/_fixtures/.  tests/vectors/generate.py (re)creates everything deterministically and
checks each case against :func:`run_case` as it writes it.  Every case must fail with exactly the
expected class and message, and must not allocate more than a bounded amount of memory doing so.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from tests.support.vector_runners import RUNNERS, VECTORS, expected_of, mismatch, run_case

# Most Python-heap bytes a case may allocate while being refused (bombs included).
MAX_PEAK_BYTES = 64 << 20
CASES = sorted(p.parent for p in VECTORS.glob("*/*/expected.toml") if not p.parent.parent.name.startswith("_"))


def test_there_are_cases_for_every_parser() -> None:
    per_parser = {name: sum(1 for c in CASES if c.parent.name == name) for name in RUNNERS}
    assert all(n >= 2 for n in per_parser.values()), per_parser
    assert len(CASES) >= 40
    assert {c.parent.name for c in CASES} <= set(RUNNERS)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_vector(case: Path) -> None:
    expected = expected_of(case)
    assert expected.get("description"), "every case says what it is about"
    tracemalloc.start()
    try:
        got = run_case(case)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    problem = mismatch(case, got)
    assert problem is None, problem
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated"


def test_fixture_data_stays_small() -> None:
    total = sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file())
    assert total < 1 << 20, total

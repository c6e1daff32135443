"""Strict JSON answers (daemon/json_answer.py): never a bare NaN or Infinity, never a 500 for one."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.daemon.json_answer import json_response, strict_dumps

FINITE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _refuse(name: str) -> Any:
    raise ValueError(f"bare {name}")


@given(FINITE_JSON, st.booleans())
def test_finite_values_round_trip_through_a_strict_parser(value: Any, compact: bool) -> None:
    text = strict_dumps(value, compact=compact)
    assert json.loads(text, parse_constant=_refuse) == value
    assert text == json.dumps(value, separators=(",", ":") if compact else None)  # (same bytes as before)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_written_as_null_never_as_bare_constants(bad: float) -> None:
    # (allow_nan=False alone raised here, and every route holding such a float answered 500)
    for value, expected in (
        (bad, None),
        ([1.0, bad], [1.0, None]),
        ({"logits": [bad], "t": (bad, 2)}, {"logits": [None], "t": [None, 2]}),
    ):
        assert json.loads(strict_dumps(value), parse_constant=_refuse) == expected
        assert json.loads(json_response(value).text, parse_constant=_refuse) == expected
    assert json_response({"a": 1.5}, status=201, compact=True).text == '{"a":1.5}'


def test_a_circular_structure_still_raises() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        strict_dumps(loop)

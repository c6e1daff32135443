"""protocol/untrusted_json.py: honest JSON comes back as json.loads gives it (hypothesis); each class of
hostile document is refused with one short UntrustedJSONError line, never RecursionError."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_file import parse_plan_file
from patchswarm.protocol.untrusted_json import MAX_DEPTH, UntrustedJSONError, load_json

leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
documents = st.recursive(
    leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c, max_size=4), max_leaves=20
)


@given(documents)
def test_honest_documents_parse_as_json_loads_does(doc: Any) -> None:
    text = json.dumps(doc)
    assert load_json(text, max_bytes=1 << 20) == json.loads(text)
    assert load_json(text.encode(), max_bytes=1 << 20) == json.loads(text)


HOSTILE = {
    "duplicate key": '{"a": 1, "a": 2}',
    "NaN": '{"a": NaN}',
    "Infinity": "[-Infinity]",
    "float overflow": "[1e999]",
    "deep arrays": "[" * 100_000 + "]" * 100_000,
    "deep objects": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "just past the depth bound": "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
    "huge integer": "[" + "9" * 5000 + "]",
    "lone surrogate value": '["\\ud800"]',
    "lone surrogate key": '{"\\udfff": 1}',
    "not UTF-8": b'{"a": "\xff"}',
    "trailing garbage": "{} {}",
    "empty": "",
}


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_documents_are_refused_in_one_line(data: str | bytes) -> None:
    with pytest.raises(UntrustedJSONError) as e:
        load_json(data, max_bytes=1 << 20)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_size_bound_is_checked_before_parsing() -> None:
    with pytest.raises(UntrustedJSONError, match="more than the 10 allowed"):
        load_json("[" + "1," * 10 + "1]", max_bytes=10)


def test_the_depth_bound_itself_is_allowed() -> None:
    assert load_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, max_bytes=1 << 10) is not None


def test_config_files_may_carry_infinity_as_python_writes_it() -> None:
    doc = load_json('{"x": Infinity, "y": NaN}', max_bytes=1 << 10, allow_nan=True)
    assert doc["x"] == math.inf and math.isnan(doc["y"])
    with pytest.raises(UntrustedJSONError, match="twice"):  # the other checks stay
        load_json('{"x": 1, "x": 2}', max_bytes=1 << 10, allow_nan=True)


def test_a_body_passed_on_as_it_came_may_hold_a_lone_surrogate_but_nothing_else() -> None:
    assert load_json('{"s": "\\ud800"}', max_bytes=1 << 10, allow_surrogates=True) == {"s": "\ud800"}
    for other in ('{"x": 1, "x": 2}', '{"x": NaN}', "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)):
        with pytest.raises(UntrustedJSONError):
            load_json(other, max_bytes=1 << 10, allow_surrogates=True)


def test_a_plan_file_with_rules_given_twice_is_refused() -> None:
    # json.loads kept the last "rules" and the first was silently dropped
    rules = '[{"match": "a", "rule": "ignore"}]'
    data = f'{{"format": "patchswarm-layout-plan", "version": 1, "rules": {rules}, "rules": {rules}}}'
    with pytest.raises(PlanError, match="'rules' appears twice"):
        parse_plan_file(data)

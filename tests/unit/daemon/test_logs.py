"""Daemon log lines: the text format keeps the fields the JSON format has."""

from __future__ import annotations

import json
import logging

from patchswarm.daemon.logs import JsonFormatter, TextFormatter


def record(msg: str = "version %s active", **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("patchswarm.daemon", logging.INFO, __file__, 1, msg, (3,), None)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def test_text_lines_carry_the_fields_as_key_value() -> None:
    line = TextFormatter().format(record(version=3, peer="10.0.0.2:8701", pause_s=0.012))
    assert line == "INFO patchswarm.daemon: version 3 active version=3 peer=10.0.0.2:8701 pause_s=0.012"


def test_text_values_with_spaces_quotes_or_newlines_are_quoted_on_one_line() -> None:
    line = TextFormatter().format(record(reason='bad "head"\nforged', peer="a b"))
    assert "\n" not in line
    assert line.endswith(r' peer="a b" reason="bad \"head\"\nforged"')


def test_text_and_json_carry_the_same_fields() -> None:
    r = record(version=3, run_id="run-7", chunk="ab12", reason="expired")
    obj = json.loads(JsonFormatter().format(r))
    text = TextFormatter().format(r)
    for key in ("version", "run_id", "chunk", "reason"):
        assert f"{key}={obj[key]}" in text


def test_a_line_without_fields_is_unchanged() -> None:
    assert TextFormatter().format(record()) == "INFO patchswarm.daemon: version 3 active"

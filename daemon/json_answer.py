"""JSON the daemon's HTTP servers answer with (the unix-socket API, the sidecar, the engines), encoded
strictly: ``json.dumps`` writes a non-finite float as a bare ``NaN`` or ``Infinity``, which is not JSON
(RFC 8259, section 6) and which strict parsers (browsers, Go, Rust serde) refuse, while
``allow_nan=False`` alone raises and turns the answer into a 500.  Here such a value is written as
``null`` (JSON's "no value"), wherever it sits: a status float, a metric's ratio, a debug logit
(the engines also count those, docs/engines.md), so every answer path gives a valid answer.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

__all__ = ["json_response", "strict_dumps"]


def _finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_or_null(v) for v in obj]
    return obj


def strict_dumps(obj: Any, *, compact: bool = False) -> str:
    """``obj`` as strict JSON, a NaN or an infinity written as ``null``; ``compact``: no spaces after , and :."""
    separators = (",", ":") if compact else None
    try:
        return json.dumps(obj, allow_nan=False, separators=separators)
    except ValueError as e:
        if "JSON compliant" not in str(e):  # (a circular reference: a bug, not a value to null)
            raise
        return json.dumps(_finite_or_null(obj), allow_nan=False, separators=separators)


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None, compact: bool = False
) -> web.Response:
    """``web.json_response`` encoded strictly (``strict_dumps``)."""
    return web.json_response(
        data, status=status, headers=headers, dumps=functools.partial(strict_dumps, compact=compact)
    )

"""JSON the daemon's HTTP servers answer with (the unix-socket API, the sidecar, the engines), encoded
strictly: ``json.dumps`` writes a non-finite float as a bare ``NaN`` or ``Infinity``, which is not JSON
(RFC 8259, section 6) and which strict parsers (browsers, Go, Rust serde) refuse.  Here such a value
raises ValueError instead, so a route that may hold one (the engines' debug logits) decides what to
send (docs/engines.md), and no answer is ever invalid JSON.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

__all__ = ["json_response", "strict_dumps"]


def strict_dumps(obj: Any, *, compact: bool = False) -> str:
    """``obj`` as strict JSON (ValueError on NaN or an infinity); ``compact``: no spaces after , and :."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":") if compact else None)


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None, compact: bool = False
) -> web.Response:
    """``web.json_response`` encoded strictly (``strict_dumps``)."""
    return web.json_response(
        data, status=status, headers=headers, dumps=functools.partial(strict_dumps, compact=compact)
    )

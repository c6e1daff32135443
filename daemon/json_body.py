"""The JSON object a request to one of the daemon's HTTP servers carries (the engines' routes, the
unix-socket API): the one reader of such bodies.

The body is read as it arrives by ``swarm.serving.read_body``, never ``request.read()``: 413 past
``limit`` bytes (checked against Content-Length first), 408 when it has not all come within the server's
body deadline, 400 for a malformed chunked body; those leave as aiohttp's HTTP errors, one line each.
Then it is parsed strictly (protocol/untrusted_json.py: UTF-8, no NaN or Infinity, no key given twice,
bounded nesting) and must be an object; an empty body is the empty object.  Anything else is a
:class:`BodyError` (a ValueError) with one line, which each server answers as its 400.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from patchswarm.protocol.untrusted_json import load_json
from patchswarm.swarm.serving import read_body

__all__ = ["BodyError", "json_object", "parse_object"]


class BodyError(ValueError):
    """A request body that is not one JSON object, in one line (the server's 400)."""


def parse_object(raw: bytes, limit: int) -> dict[str, Any]:
    """``raw`` (a whole body of at most ``limit`` bytes) as a JSON object: ``{}`` when empty."""
    if not raw:
        return {}
    try:
        obj = load_json(raw, max_bytes=limit)
    except ValueError as e:  # (UntrustedJSONError: its one line says why)
        raise BodyError(f"body: {e}") from None
    if not isinstance(obj, dict):
        raise BodyError(f"body must be a JSON object, not {_kind(obj)}")
    return obj


async def json_object(request: web.BaseRequest, limit: int) -> dict[str, Any]:
    """The request's body as a JSON object (see the module's docstring for the refusals)."""
    return parse_object(await read_body(request, limit), limit)


def _kind(obj: Any) -> str:
    if isinstance(obj, list):
        return "an array"
    if isinstance(obj, str):
        return "a string"
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    return "a number"

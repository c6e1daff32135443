"""Reading an engine's answer to a driver's control call (daemon/engine_drivers.py, daemon/copy_drivers.py).

The engine is another process, maybe broken, maybe hostile: its answer is read whole but bounded
(``StreamReader.read(n)`` returns whatever has arrived, so one read can cut a dripped answer short)
and parsed strictly (protocol/untrusted_json.py): nesting deep enough to raise RecursionError, an
integer past Python's digit limit (ValueError), NaN or a key given twice are not an answer, and so
neither escapes the drivers' ``EngineError`` nor passes for a version.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

MAX_TEXT = 300  # of an answer that is not JSON, quoted in an error line


async def read_answer(resp: aiohttp.ClientResponse, max_bytes: int) -> tuple[bytes, bool]:
    """The body (at most ``max_bytes``) and whether the engine sent more than that."""
    raw = bytearray()
    while len(raw) <= max_bytes:
        chunk = await resp.content.read(max_bytes + 1 - len(raw))
        if not chunk:
            break
        raw += chunk
    return bytes(raw[:max_bytes]), len(raw) > max_bytes


def parse_answer(raw: bytes, max_bytes: int) -> Any:
    """The answer as JSON (None when empty), or, when it is not strict JSON, its text cut short
    (for an error line: a str is never a version, a dict or a list of results)."""
    if not raw.strip():
        return None
    try:
        return load_json(raw, max_bytes=max_bytes)
    except ValueError:
        return " ".join(raw[:MAX_TEXT].decode("utf-8", "replace").split())


async def read_json(resp: aiohttp.ClientResponse, max_bytes: int) -> Any:
    """The answer parsed strictly; UntrustedJSONError (a ValueError) past ``max_bytes`` or when it is
    not strict JSON (for a client that needs the JSON, not an error line)."""
    raw, over = await read_answer(resp, max_bytes)
    if over:
        raise UntrustedJSONError(f"an answer over {max_bytes:,} bytes")
    return load_json(raw, max_bytes=max_bytes)


def one_line(value: object, limit: int = 200) -> str:
    """Part of an engine's answer quoted in an error line: one line, at most ``limit`` characters."""
    return " ".join(str(value).split())[:limit]

"""Hypothesis over the unix-socket API's request parsing (POST /v1/ack bodies, GET /v1/wait queries),
on a real socket: any request gets 200 or a 400 with a JSON error, never a 500.

The explicit cases below once got a 500 from ``ack``: a non-finite version (``int(inf)`` raised
OverflowError) and a body nested past the JSON decoder's recursion limit (RecursionError).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.status import Status

EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


async def _exchange(method: str, path: str, body: bytes = b"") -> tuple[int, object]:
    with tempfile.TemporaryDirectory() as d:
        sock = Path(d) / "api.sock"
        runner = await serve_unix(make_api_app(Status("h", "r"), lambda: None, lambda: b""), sock)
        try:
            async with (
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s,
                s.request(method, f"http://d{path}", data=body) as r,
            ):
                return r.status, await r.json(content_type=None) if r.status != 500 else None
        finally:
            await runner.cleanup()


def exchange(method: str, path: str, body: bytes = b"") -> tuple[int, object]:
    return asyncio.run(_exchange(method, path, body))


def _answered(status: int, reply: object) -> None:
    assert status in (200, 400), status
    if status == 400:
        assert isinstance(reply, dict) and reply.get("error") == "BadRequest"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_infinity=False) | st.text(max_size=140),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
ack_bodies = st.one_of(
    st.fixed_dictionaries({"engine": json_values, "version": json_values}),
    st.dictionaries(st.sampled_from(["engine", "version", "x"]), json_values, max_size=3),
    json_values,
).map(lambda v: json.dumps(v).encode())


@EXAMPLES
@given(body=ack_bodies | st.binary(max_size=64))
def test_ack_bodies_get_200_or_400(body: bytes) -> None:
    _answered(*exchange("POST", "/v1/ack", body))


query_values = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.text(alphabet="0123456789.-+eEinfa_ x", max_size=12),
)


def _would_wait(version: str, timeout: str | None) -> bool:
    """A valid long poll blocks for its timeout: only requests answered at once are sent."""
    try:
        want, seconds = int(version), float(timeout if timeout is not None else "30")
    except ValueError:
        return False
    return want >= 0 and 0 < seconds <= 300


@EXAMPLES
@given(version=query_values, timeout=st.none() | query_values)
def test_wait_queries_get_200_or_400(version: str, timeout: str | None) -> None:
    assume(not _would_wait(version, timeout))
    query = {"version": version, **({"timeout": timeout} if timeout is not None else {})}
    _answered(*exchange("GET", "/v1/wait?" + urlencode(query)))


@pytest.mark.parametrize(
    "body",
    [
        b'{"engine":"e","version":Infinity}',
        b'{"engine":"e","version":1e400}',
        b"[" * 5000,
        b'{"engine":"e","version":-5}',
        b'{"engine":"e","version":true}',
        b'{"engine":"e","version":1.5}',
        b'{"engine":"e","version":"12"}',
        b'{"engine":7,"version":1}',
    ],
    ids=["infinity", "1e400", "deep-nesting", "negative", "bool", "float", "string", "engine-not-a-string"],
)
def test_malformed_acks_are_400(body: bytes) -> None:
    status, reply = exchange("POST", "/v1/ack", body)
    assert status == 400 and isinstance(reply, dict) and reply["error"] == "BadRequest"

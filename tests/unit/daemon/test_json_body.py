"""daemon/json_body.py, the one reader of the JSON object a request carries (the engines' routes, the
unix-socket API): over arbitrary bytes, on a real loopback server, every body gets a 200 (an object)
or one 400 or 413 line, never a 500; the parser alone over many more."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.json_body import BodyError, json_object, parse_object
from patchswarm.swarm.serving import serve_tcp

LIMIT = 256

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# Bytes of every kind: JSON (NaN and all, often an object), JSON cut or spliced, keys given twice, any bytes.
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=6), json_values, max_size=4).map(lambda v: json.dumps(v).encode()),
    st.tuples(json_values, st.integers(0, 40)).map(lambda t: json.dumps(t[0]).encode()[: t[1]]),
    st.just(b'{"a": 1, "a": 2}'),
    st.just(b"[" * 3000 + b"]" * 3000),
    st.just(b"{}" + b" " * LIMIT),  # past the limit
    st.binary(max_size=LIMIT + 8),
)


async def _echo(request: web.Request) -> web.Response:
    try:
        body = await json_object(request, LIMIT)
    except ValueError as e:
        return web.Response(status=400, text=f"{e}\n")
    return web.json_response({"keys": sorted(body)})


async def _post_all(payloads: list[bytes]) -> list[tuple[int, str]]:
    app = web.Application(client_max_size=LIMIT)
    app.router.add_post("/", _echo)
    runner, port = await serve_tcp(app, "127.0.0.1", 0)
    out: list[tuple[int, str]] = []
    try:
        async with aiohttp.ClientSession() as s:
            for data in payloads:
                async with s.post(f"http://127.0.0.1:{port}/", data=data) as r:
                    out.append((r.status, await r.text()))
    finally:
        await runner.cleanup()
    return out


def _expected(data: bytes) -> dict[str, Any] | None:
    """The object the reader must give, or None where it must refuse."""
    try:
        return parse_object(data, LIMIT) if len(data) <= LIMIT else None
    except BodyError:
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(payloads=st.lists(bodies, min_size=1, max_size=8))
def test_any_body_over_http_is_an_object_or_one_400_or_413_line(payloads: list[bytes]) -> None:
    for data, (status, text) in zip(payloads, asyncio.run(_post_all(payloads)), strict=True):
        want = _expected(data)
        if want is not None:
            assert status == 200 and json.loads(text) == {"keys": sorted(want)}, (data, status, text)
        elif len(data) > LIMIT:
            assert status == 413, (data, status, text)
        else:
            assert status == 400 and text.count("\n") == 1 and text.startswith("body"), (data, status, text)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(data=bodies)
def test_the_parser_gives_an_object_or_one_line(data: bytes) -> None:
    try:
        obj = parse_object(data, 1 << 20)
    except BodyError as e:
        assert str(e).startswith("body") and "\n" not in str(e)
    else:
        assert isinstance(obj, dict)
        if data:  # strict: what it accepted is the document Python's parser reads (finite, keys once)
            assert obj == json.loads(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"[1]", "must be a JSON object, not an array"),
        (b'"x"', "not a string"),
        (b"NaN", "body: "),
        (b'{"a": 1, "a": 1}', "body: "),
        (b"\xff", "body: "),
    ],
)
def test_refusals_say_why(data: bytes, match: str) -> None:
    with pytest.raises(BodyError, match=match):
        parse_object(data, 1 << 20)

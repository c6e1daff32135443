"""The API's rank parameter (GET /v1/layout?rank=, POST /v1/store body "rank") on a real unix socket:
every hostile value is a 400 with one clear line, never a 500, and the server keeps answering."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from patchswarm.daemon.api import make_api_app, parse_rank, serve_unix
from patchswarm.daemon.status import Status

RANKS = 4


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[aiohttp.ClientSession]:
    st = Status("host-1", "run-1")
    seen: list[Any] = []

    async def register(body: Any, pid: int | None) -> tuple[int, dict[str, Any]]:
        try:
            return 200, {"rank": parse_rank(body.get("rank") if isinstance(body, dict) else None, RANKS)}
        except ValueError as e:
            seen.append(body)
            return 400, {"error": "BadRequest", "message": str(e)}

    app = make_api_app(
        st,
        lambda: None,
        lambda: b"",
        register_store=register,
        ranks=RANKS,
        rank_layout=lambda rank: {"rank": rank},
    )
    runner = await serve_unix(app, tmp_path / "api.sock")
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / "api.sock")))
    yield session
    await session.close()
    await runner.cleanup()


HOSTILE_QUERIES = [
    "",  # none: needed when a daemon feeds several ranks
    "?rank=",
    "?rank=-1",
    "?rank=4",
    "?rank=99999999999999999999999999",
    "?rank=1.0",
    "?rank=1e0",
    "?rank=true",
    "?rank=%20%31",
    "?rank=%D9%A3",  # '٣', an Arabic-Indic 3: str.isdigit() says yes
    "?rank=%C2%B2",  # '²'
    "?rank=0x1",
    "?rank=%00",
    "?rank=0&rank=1",
    "?rank=1&rank=1",
]


@pytest.mark.asyncio
async def test_hostile_rank_queries_get_one_clear_400_and_the_server_keeps_serving(
    api: aiohttp.ClientSession,
) -> None:
    for q in HOSTILE_QUERIES:
        async with api.get(f"http://d/v1/layout{q}") as r:
            body = await r.json()
            assert r.status == 400, (q, r.status, body)
            assert "rank" in body["message"] and "\n" not in body["message"], q
    for k in range(RANKS):
        async with api.get(f"http://d/v1/layout?rank={k}") as r:
            assert r.status == 200 and (await r.json()) == {"rank": k}
    async with api.get("http://d/v1/layout?rank=0003") as r:
        assert r.status == 200 and (await r.json()) == {"rank": 3}


@pytest.mark.asyncio
@pytest.mark.parametrize("rank", [-1, 4, 10**30, True, False, 1.0, 0.0, "x", "٣", None, [0], {"r": 0}])
async def test_hostile_rank_bodies_get_one_clear_400(api: aiohttp.ClientSession, rank: Any) -> None:
    async with api.post("http://d/v1/store", json={"engine": "e", "rank": rank}) as r:
        body = await r.json()
        assert r.status == 400 and "rank" in body["message"], (rank, body)
    async with api.post("http://d/v1/store", json={"engine": "e", "rank": 2}) as r:
        assert r.status == 200 and (await r.json()) == {"rank": 2}


def test_parse_rank_for_one_store_takes_only_zero() -> None:
    # the single-store registration path used `rank not in (None, 0)`: False and 0.0 compare equal to 0
    assert parse_rank(None, 1) == 0 and parse_rank(0, 1) == 0 and parse_rank("0", 1) == 0
    for bad in (False, True, 0.0, 1, "", "٠"):
        with pytest.raises(ValueError):
            parse_rank(bad, 1)

"""JSON that reaches an engine's side of the daemon's wire (the apply text and attach spec a vLLM worker or
SGLang's loader parses, the reference engine's control bodies) nested past Python's stack or with a key
given twice: one SyncError or 400 line, never a RecursionError escaping the ``except ValueError`` around it."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from patchswarm.daemon.param_sync import SyncError, open_rank_store, parse_apply
from patchswarm.daemon.ref_sources import StaticSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.sglang_loader import load_regions
from tests.support.tinylm import random_export

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 50_000 + "1" + "}" * 50_000
TWICE = '{"version": 1, "full": true, "ranks": {}, "version": 2}'


@pytest.mark.parametrize("text", [DEEP, DEEP_OBJECT, TWICE])
def test_the_wire_texts_refuse_hostile_json_in_one_line(text: str) -> None:
    with pytest.raises(SyncError, match="not JSON"):
        parse_apply(text, 0)
    with pytest.raises(SyncError, match="not JSON"):
        open_rank_store(text, 0, "cpu")
    with pytest.raises(SyncError, match="not JSON"):
        load_regions(torch.nn.Linear(1, 1), [(text, torch.empty(0))])


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT, '{"version": 1, "version": 1}'])
async def test_the_reference_engine_answers_400_to_hostile_bodies(body: str) -> None:
    server = await start_engine(StaticSource(random_export(1), version=1))
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/patchswarm/v1/commit", "/pause_generation", "/generate"):
                async with s.post(server.url + path, data=body.encode()) as r:
                    assert r.status == 400, (path, await r.text())
    finally:
        await server.close()

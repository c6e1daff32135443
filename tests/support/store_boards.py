"""Helpers of the object-store board tests (tests/system/test_store_board*.py): small models,
their served form, pulls through a board source, and what a bucket holds."""

from __future__ import annotations

import asyncio

import torch

from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import source_for
from patchswarm.swarm.puller import Puller
from tests.support.boards import Keys
from tests.support.moto_server import Moto

RUN = "run-s3"


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(96, 64, generator=g) for i in range(3)}


def step(w: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        mask = torch.rand(t.shape, generator=g) < 0.05
        t[mask] += 0.01


def served(w: dict[str, torch.Tensor]) -> ServedModel:
    return ServedModel.from_tensors(ServedFormat("bf16").convert(w))


def pull(url: str, keys: Keys, run: str = RUN) -> ServedModel:
    async def go() -> ServedModel:
        src = source_for(url)
        try:
            return (await Puller(src, TrustState(keys.root.key_id), run).catch_up(None)).model
        finally:
            await src.close()

    return asyncio.run(go())


def object_names(moto: Moto, bucket: str) -> set[str]:
    pages = moto.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}

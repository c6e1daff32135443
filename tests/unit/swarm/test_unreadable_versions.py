"""A host whose build reads fewer payload formats than a board's patches use: it learns that from
each version's signed manifest, fetches none of that version's chunks, says so in one line, and
reaches the head along another path (an anchor) where the catalog has one; with none, the catch-up
fails naming the version and the format.  Both catch-up drivers: the puller, and real loopback nodes."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import chunk_rel, manifest_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.errors import NoPathError
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind, Manifest
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller
from tests.support.boards import Keys, board_patches
from tests.support.swarmkit import Swarm

RUN = "run-u"


class Recording(DirSource):
    """A board directory that remembers every path asked of it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.asked: list[str] = []

    async def get(self, rel: str, limit: int) -> bytes | None:
        self.asked.append(rel)
        return await super().get(rel, limit)


class Trainer:
    """A publisher of small steps (anchors at 1, 4, 7, ...): every patch codes its positions under
    base contexts (format 2) unless the publisher is held to format 1."""

    def __init__(self, tmp: Path, payload_format: int = DEFAULT_FORMAT) -> None:
        self.keys = Keys(SigningKey.generate(), SigningKey.generate())
        cert = self.keys.certificate(RUN)
        self.pub = Publisher(
            tmp, self.keys.trainer, run_id=RUN, anchor_every=4, certificate=cert, payload_format=payload_format
        )
        self.g = torch.Generator().manual_seed(0)
        self.w = {f"layer{i}.weight": torch.randn(256, 256, generator=self.g) * 0.02 for i in range(2)}

    def publish(self, versions: int = 1) -> None:
        for _ in range(versions):
            if self.pub.version:
                for t in self.w.values():
                    t.add_(torch.randn(t.shape, generator=self.g) * 3e-5)
            self.pub.publish(self.w)


def chunks_of(pub: Publisher, entry: CatalogEntry) -> set[str]:
    m: Manifest = pub.board.manifest(entry.manifest_id)
    return {chunk_rel(c.hash) for c in m.chunks}


async def held_at(src: DirSource, keys: Keys, version: int) -> Held:
    """What a host holds at ``version`` (an anchor's), taken by a puller of its own."""
    p = Puller(src, TrustState(keys.root.key_id), RUN)
    head = await p.fetch_head()
    anchor = next(e for e in head.catalog if e.version == version and e.kind == Kind.ANCHOR)
    m = await p.fetch_manifest(anchor)
    from patchswarm.protocol.patchfile import apply_version

    model, digests = apply_version(None, m, await p.fetch_payload(m))
    return Held(version, model, digests)


@pytest.mark.asyncio
async def test_a_format_1_host_goes_around_format_2_patches_without_fetching_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(tmp_path / "board")
    trainer.publish(4)
    pub, keys = trainer.pub, trainer.keys
    assert list(board_patches(pub.board, RUN).values()) == [(2, ["SPARSE_CTX", "SPARSE_CTX"])] * 3
    src = Recording(pub.board.root)
    held = await held_at(src, keys, 1)
    src.asked.clear()
    old = Puller(src, TrustState(keys.root.key_id), RUN, payload_formats=(1,))
    head = await old.fetch_head()
    patches = sorted((e for e in head.catalog if e.kind == Kind.PATCH), key=lambda e: e.version)
    assert [e.version for e in old.plan(head, held)] == [2, 3, 4]  # the chain is cheaper than the anchor
    with caplog.at_level(logging.WARNING, logger="patchswarm.pull"):
        got = await old.catch_up(held, head)
    anchor4 = next(e for e in head.catalog if e.version == 4 and e.kind == Kind.ANCHOR)
    assert got.version == 4 and [e.version for e in old.stats.steps] == [4] and old.stats.steps == [anchor4]
    assert old.stats.unreadable == 1  # patch 2's manifest said it; 3 and 4 were planned around unfetched
    assert manifest_rel(patches[0].manifest_id) in src.asked
    for e in patches:
        assert not chunks_of(pub, e) & set(src.asked), f"a chunk of format-2 patch {e.version} was fetched"
        if e.version > 2:
            assert manifest_rel(e.manifest_id) not in src.asked
    lines = [r.getMessage() for r in caplog.records if "payload format" in r.getMessage()]
    assert lines == ["skipping version 2: patch payload format 2 (this build reads 1); planning around it"]
    # A host of this build takes the patches (cheaper), and the same bytes.
    new = Puller(src, TrustState(keys.root.key_id), RUN)
    again = await new.catch_up(held, head)
    assert [e.kind for e in new.stats.steps] == [Kind.PATCH] * 3 and new.stats.unreadable == 0
    assert again.digests == got.digests
    # Past the last anchor only format-2 patches lead on: the catch-up fails, saying why in one line.
    trainer.publish()
    with pytest.raises(NoPathError) as err:
        await old.catch_up(got)
    assert "that this build reads (version 5: patch payload format 2 (this build reads 1))" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.asyncio
async def test_format_1_patches_still_reach_a_format_1_host(tmp_path: Path) -> None:
    """``payload_format=1`` (``--payload-format 1``): the mixed fleet's setting, every patch for every host."""
    trainer = Trainer(tmp_path / "board", payload_format=1)
    trainer.publish(4)
    pub, keys = trainer.pub, trainer.keys
    assert list(board_patches(pub.board, RUN).values()) == [(1, ["SPARSE_ULP", "SPARSE_ULP"])] * 3
    src = DirSource(pub.board.root)
    held = await held_at(src, keys, 1)
    old = Puller(src, TrustState(keys.root.key_id), RUN, payload_formats=(1,))
    got = await old.catch_up(held)
    assert [e.kind for e in old.stats.steps] == [Kind.PATCH] * 3 and old.stats.unreadable == 0
    assert got.version == 4


@pytest.mark.asyncio
async def test_real_nodes_of_both_kinds_reach_the_head_and_the_old_one_fetches_no_format_2_chunk(
    tmp_path: Path,
) -> None:
    s = Swarm(tmp_path)  # the trainer at the default payload format
    s.publish()
    await s.start_seed()
    try:
        old = await s.start_node("old", payload_formats=(1,))
        new = await s.start_node("new")
        await s.wait_all(1)
        s.publish(scale=3e-5)  # version 2: a format-2 patch, and no anchor
        await s.wait_all(2, names=["new"])
        deadline = time.monotonic() + 60
        while old.node.error is None and time.monotonic() < deadline:  # it fetched patch 2's manifest only
            await asyncio.sleep(0.05)
        assert old.node.error is not None
        assert "version 2: patch payload format 2 (this build reads 1)" in old.node.error
        assert old.node.held is not None and old.node.held.version == 1
        s.publish(scale=3e-5)
        await s.wait_all(3, names=["new"])
        s.publish(scale=3e-5)  # version 4: a patch and an anchor
        await s.wait_all(4)
        s.assert_bitwise()
        formats = board_patches(s.board, "swarm-run")
        assert formats and all(fmt == 2 for fmt, _ in formats.values()), formats
        taken = {e.kind for e in old.node.applied}
        assert taken == {Kind.ANCHOR} and old.node.puller.stats.unreadable >= 1
        assert Kind.PATCH in {e.kind for e in new.node.applied} and new.node.puller.stats.unreadable == 0
        # Chunk bytes in: exactly the anchors it applied (nothing of a patch it cannot read).
        got = old.node.metrics.bytes_from_peers + old.node.metrics.bytes_from_seed
        assert got == sum(e.size for e in old.node.applied)
        metrics = DaemonMetrics()
        metrics.sync(old.node.metrics, 4, 4, swarm=old.node)
        assert b"patchswarm_versions_unreadable_total " in metrics.render()
        assert old.node.error is None
    finally:
        await s.close()

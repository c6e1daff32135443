"""Payload format 2 end to end: a publisher writing SPARSE_CTX patches onto a board, and real loopback
nodes taking them through both reader paths (the swarm's staged apply, the daemon's decode_once),
bitwise; a refused format-2 patch leaves the daemon's held base untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchswarm.daemon.shadow import decode_once, materialized
from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.head import Head
from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.patchfile import build_version
from patchswarm.protocol.signed import Envelope
from tests.support.helpers import adam_like_pair
from tests.support.swarmkit import RUN, Swarm


def _daemon_apply(held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
    """The daemon's decode hook, its staged changes laid into a copy (what activation does to the store)."""
    return materialized(decode_once(held, manifest, parts))


@pytest.mark.asyncio
async def test_format2_patches_reach_both_reader_paths_bitwise(tmp_path: Path) -> None:
    s = Swarm(tmp_path, payload_format=2)  # the trainer allows format 2 (readers are under test)
    for _ in range(3):
        s.publish(scale=3e-5)  # small steps: contexts pay (SPARSE_CTX)
    head = Head.from_bytes(Envelope.from_bytes(s.board.read(head_rel(RUN)) or b"", HEAD_TAG).body)
    patches = [e for e in head.catalog if e.kind.value == "patch"]
    assert patches
    await s.start_seed()
    try:
        await s.start_node("staged")
        await s.start_node("daemon", apply=_daemon_apply)
        await s.wait_all(3)
        s.assert_bitwise()
        got = [r.node.held for r in s.nodes.values()]
        for held in got:
            assert held is not None and held.digests == s.served[3].digests()
    finally:
        await s.close()
    # The patches the nodes took were format-2 payloads with SPARSE_CTX records.
    formats = set()
    for path in (tmp_path / "board").rglob("*"):
        data = path.read_bytes() if path.is_file() else b""
        if data[:4] == b"PSWP":
            formats.add(data[4])
    assert 2 in formats, formats


def test_a_refused_format2_patch_leaves_the_held_base_untouched() -> None:
    base, target = adam_like_pair(seed=11)
    v = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, payload_format=2)
    assert Encoding.SPARSE_CTX in {e for e, _ in read_header(v.payload, target.specs).records}
    held = Held(1, base, base.digests())
    before = base.clone()
    bad = bytearray(v.payload)
    bad[-3] ^= 0x10  # inside the last stream: decodes to another target, or fails to decode
    with pytest.raises(PatchswarmError):
        decode_once(held, v.manifest, [bytes(bad)])
    assert base.bitwise_equal(before)
    staged = decode_once(held, v.manifest, [v.payload])
    assert base.bitwise_equal(before)  # staged: nothing written until the activation
    assert materialized(staged).model.bitwise_equal(target)

"""swarm.staging.StagedApply: the same result as apply_chunks, with the copy and the buffer made ahead."""

from __future__ import annotations

import pytest

from patchswarm.protocol.chunks import chunk_views
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.held import Held
from patchswarm.protocol.patchfile import Version, build_version
from patchswarm.protocol.served import ServedModel
from patchswarm.swarm.staging import StagedApply, apply_chunks
from tests.support.helpers import adam_like_pair

RUN = "staging-test"
NOW_MS = 1_800_000_000_000
CHUNK = 4 << 10


def _parts(v: Version) -> list[bytes]:
    """The version's chunks, as a node holds them once downloaded."""
    return [bytes(data) for _, data in chunk_views(v.payload, v.manifest.chunks)]


def _versions() -> tuple[Held, Version, Version, ServedModel]:
    base, target = adam_like_pair(seed=3)
    anchor = build_version(None, base, run_id=RUN, version=1, now_ms=NOW_MS, chunk_size=CHUNK)
    patch = build_version(base, target, run_id=RUN, version=2, base_version=1, now_ms=NOW_MS, chunk_size=CHUNK)
    held = Held(1, base.clone(), base.digests())
    return held, anchor, patch, target


@pytest.mark.asyncio
async def test_prepared_patch_matches_apply_chunks_and_leaves_the_held_version_alone() -> None:
    held, _, patch, target = _versions()
    before = held.model.clone()
    staged = StagedApply()
    staged.prepare(held, patch.manifest)
    copy, buffer = await staged._stages[patch.manifest.manifest_id].task
    assert copy is not None and copy.bitwise_equal(held.model) and buffer.size == patch.manifest.payload_size
    new = await staged(held, patch.manifest, _parts(patch))
    assert new.model is copy  # patched in the copy made ahead, not in a new one
    plain = apply_chunks(held, patch.manifest, _parts(patch))
    assert new.version == 2
    assert new.model.bitwise_equal(target)
    assert new.model.bitwise_equal(plain.model)
    assert new.digests == plain.digests == target.digests()
    assert held.model.bitwise_equal(before)  # the patch went to the staged copy
    assert new.model.data[0].data_ptr() != held.model.data[0].data_ptr()


@pytest.mark.asyncio
async def test_anchor_and_unprepared_calls_apply_like_apply_chunks() -> None:
    held, anchor, patch, target = _versions()
    staged = StagedApply()
    staged.prepare(None, anchor.manifest)
    first = await staged(None, anchor.manifest, _parts(anchor))
    assert first.model.bitwise_equal(held.model)
    unprepared = await staged(held, patch.manifest, _parts(patch))  # no prepare: the plain path
    assert unprepared.model.bitwise_equal(target)


@pytest.mark.asyncio
async def test_a_stage_for_another_held_version_is_not_used() -> None:
    held, _, patch, target = _versions()
    other = Held(1, held.model.clone(), list(held.digests))
    staged = StagedApply()
    staged.prepare(other, patch.manifest)
    new = await staged(held, patch.manifest, _parts(patch))
    assert new.model.bitwise_equal(target)
    assert not staged._stages  # the stale stage was dropped


@pytest.mark.asyncio
async def test_wrong_chunks_fail_with_a_clear_error_and_discard_forgets_the_stage() -> None:
    held, _, patch, _ = _versions()
    staged = StagedApply()
    staged.prepare(held, patch.manifest)
    parts = _parts(patch)
    with pytest.raises(PatchswarmError):
        await staged(held, patch.manifest, parts[:-1])  # a chunk short: the plain path refuses it
    corrupt = [bytes(len(p)) for p in parts]
    staged.prepare(held, patch.manifest)
    with pytest.raises(PatchswarmError):
        await staged(held, patch.manifest, corrupt)
    staged.prepare(held, patch.manifest)
    staged.discard(patch.manifest)
    assert not staged._stages

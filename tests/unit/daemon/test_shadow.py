"""daemon/shadow.py: a version decoded once gives the store the same writes as a diff of two models."""

from __future__ import annotations

import pytest
import torch

from patchswarm.daemon.shadow import (
    StagedVersion,
    decode_once,
    join_payload,
    materialized,
    settle,
    store_updates,
    tune_malloc,
)
from patchswarm.daemon.store_format import StoreError
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.held import Held
from patchswarm.protocol.patchfile import build_version
from patchswarm.protocol.served import ServedModel


def _pair() -> tuple[ServedModel, ServedModel]:
    gen = torch.Generator().manual_seed(11)
    base = ServedModel.from_tensors({f"t{i}": torch.randn(128, 64, generator=gen).bfloat16() for i in range(3)})
    target = base.clone()
    target.data[0].view(torch.int16)[::37] += 1  # sparse
    target.data[2].copy_(torch.randint(0, 256, (target.data[2].numel(),), generator=gen, dtype=torch.uint8))  # dense
    return base, target


def _parts(payload: bytes) -> list[bytes]:
    return [bytes(payload[i : i + 1000]) for i in range(0, len(payload), 1000)]


def test_a_patch_is_staged_against_the_held_model_and_gives_diff_updates_writes() -> None:
    base, target = _pair()
    held = Held(1, base, base.digests())
    v = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0)
    assert len(_parts(bytes(v.payload))) > 1
    staged = decode_once(held, v.manifest, _parts(bytes(v.payload)))
    assert isinstance(staged, StagedVersion) and staged.model is base and staged.digests == target.digests()
    got = store_updates(held, staged)
    want = diff_updates(base, target)
    assert [u.slot for u in got] == [u.slot for u in want] == [0, 2]
    for g, w in zip(got, want, strict=True):
        assert (g.positions is None) == (w.positions is None)
        if g.positions is not None and w.positions is not None:
            assert g.positions.equal(w.positions)
        assert g.new.equal(w.new) and g.old.equal(w.old)
    whole = materialized(staged)
    assert whole.model is not base and whole.model.bitwise_equal(target) and not base.bitwise_equal(target)
    settle(staged, None, store_is_copy=False)  # a private copy: the changes are laid in now
    assert staged.model is base and base.bitwise_equal(target) and staged.changes == []
    assert staged.model.metadata == target.metadata


def test_an_anchor_is_decoded_into_a_new_model_or_into_buffers_given() -> None:
    _, target = _pair()
    v = build_version(None, target, run_id="r", version=5, now_ms=0)
    held = decode_once(None, v.manifest, _parts(bytes(v.payload)))
    assert not isinstance(held, StagedVersion) and held.model.bitwise_equal(target)
    into = ServedModel.zeros_like(target.specs)
    held = decode_once(None, v.manifest, _parts(bytes(v.payload)), into=into)
    assert held.model is into and into.bitwise_equal(target)


def test_payload_assembly_refuses_chunks_that_do_not_add_up_and_drops_its_references() -> None:
    parts = [b"ab", b"cde"]
    assert bytes(join_payload(parts, 5)) == b"abcde" and parts == [b"", b""]
    with pytest.raises(FormatError):
        join_payload([b"ab", b"cde"], 4)
    with pytest.raises(FormatError):
        join_payload([b"ab"], 3)


def test_a_staged_version_against_another_base_is_refused() -> None:
    base, target = _pair()
    v = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0)
    staged = decode_once(Held(1, base, base.digests()), v.manifest, _parts(bytes(v.payload)))
    with pytest.raises(StoreError):
        store_updates(Held(1, base.clone(), base.digests()), staged)
    with pytest.raises(StoreError):
        store_updates(None, staged)


def test_malloc_tuning_is_accepted_by_glibc() -> None:
    assert tune_malloc() is True  # (this project's hosts run glibc; elsewhere it returns False)

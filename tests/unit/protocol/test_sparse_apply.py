"""decode_changes: the same target as apply_version, as changes; nothing written until commit; bad input refused."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import (
    BaseMismatchError,
    FormatError,
    LayoutMismatchError,
    PatchswarmError,
    TargetMismatchError,
)
from patchswarm.protocol.patchfile import Version, apply_version, build_version
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.sparse_apply import DENSE_FRACTION, _patched_digest, commit, decode_changes
from tests.support.helpers import adam_like_pair
from tests.support.strategies import patch_cases, random_words, seeds, words


def _patch(base: ServedModel, target: ServedModel) -> Version:
    return build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0)


@settings(max_examples=60, deadline=None)
@given(patch_cases())
def test_changes_commit_to_the_same_model_as_apply_version(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base, target, _ = case
    v = _patch(base, target)
    before = base.clone()
    changes, digests = decode_changes(base, v.manifest, v.payload)
    assert base.bitwise_equal(before)  # read only
    expected_model, expected_digests = apply_version(base.clone(), v.manifest, v.payload)
    assert digests == expected_digests == target.digests()
    # The changes are exactly the elements that differ, whole tensors past DENSE_FRACTION (computed here
    # from the two models' words, independently of the codec).
    got = {c.index: c for c in changes}
    for i, spec in enumerate(base.specs):
        old, new = words(base, i), words(target, i)
        where = np.flatnonzero(old != new)
        if where.size == 0:
            assert i not in got
            continue
        c = got[i]
        if where.size > DENSE_FRACTION * spec.numel:
            assert c.positions is None
            assert np.array_equal(c.new.numpy(), new) and np.array_equal(c.old.numpy(), old)
        else:
            assert c.positions is not None and np.array_equal(c.positions.numpy(), where)
            assert np.array_equal(c.new.numpy(), new[where]) and np.array_equal(c.old.numpy(), old[where])
    commit(base, changes)
    assert base.bitwise_equal(expected_model) and base.bitwise_equal(target)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 3000), st.integers(1, 700), seeds)
def test_the_slice_by_slice_digest_is_blake3_of_the_patched_words(width: int, n: int, step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = random_words(rng, width, n)
    pos = np.flatnonzero(rng.random(n) < rng.random()).astype(np.int64)
    new = random_words(rng, width, pos.size)
    patched = base.copy()
    patched[pos] = new
    before = base.copy()
    assert _patched_digest(base, pos, new, step * width) == blake3.blake3(patched.tobytes()).digest()
    assert np.array_equal(base, before)


def test_corrupted_payloads_are_refused_and_the_base_is_untouched() -> None:
    base, target = adam_like_pair(seed=4)
    v = _patch(base, target)
    before = base.clone()
    rng = np.random.default_rng(0)
    payload = bytearray(v.payload)
    refused = 0
    for _ in range(40):
        bad = bytearray(payload)
        at = int(rng.integers(len(bad)))
        bad[at] ^= 1 << int(rng.integers(8))
        try:
            decode_changes(base, v.manifest, bytes(bad))
        except PatchswarmError:
            refused += 1
        assert base.bitwise_equal(before)
    assert refused == 40  # one flipped bit anywhere: header, streams or values


def test_wrong_base_layout_anchor_and_lying_digests_are_refused() -> None:
    base, target = adam_like_pair(seed=5)
    v = _patch(base, target)
    with pytest.raises(BaseMismatchError):
        decode_changes(target, v.manifest, v.payload)
    with pytest.raises(LayoutMismatchError):
        decode_changes(ServedModel.from_tensors({"x": target.typed(0)}), v.manifest, v.payload)
    anchor = build_version(None, target, run_id="r", version=2, now_ms=0)
    with pytest.raises(FormatError, match="anchor"):
        decode_changes(base, anchor.manifest, anchor.payload)
    wrong = target.clone()
    wrong_before = wrong.clone()
    # The base's digests claimed for other bytes: the target check catches it, or (format 2) the
    # contexts computed from those bytes fail to decode first.  Nothing is written either way.
    with pytest.raises((TargetMismatchError, FormatError)):
        decode_changes(wrong, v.manifest, v.payload, base_digests=base.digests())
    assert wrong.bitwise_equal(wrong_before)
    v1 = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, payload_format=1)
    with pytest.raises(TargetMismatchError):
        decode_changes(wrong, v1.manifest, v1.payload, base_digests=base.digests())
    assert wrong.bitwise_equal(wrong_before)


def test_a_scribbled_base_tensor_fails_its_own_digest() -> None:
    base, target = adam_like_pair(seed=6)
    v = _patch(base, target)
    digests = base.digests()
    changes, _ = decode_changes(base, v.manifest, v.payload)
    hit = changes[0].index
    flat = base.data[hit]
    flat[0] ^= 0xFF  # what an engine writing into the store would do
    with pytest.raises(TargetMismatchError, match=base.specs[hit].name):
        decode_changes(base, v.manifest, v.payload, base_digests=digests)


def test_dense_records_are_decoded_whole_and_canonicalised() -> None:
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(64, 64, generator=gen).bfloat16()
    base = ServedModel.from_tensors({"a": t, "b": t.clone()})
    a2 = torch.randn(64, 64, generator=gen).bfloat16()  # everything changes: XOR or FULL, written whole
    b2 = t.clone()
    b2.view(torch.int16).view(-1)[::50] ^= 0x5555  # 2% changes, raw: sparse
    target = ServedModel.from_tensors({"a": a2, "b": b2})
    v = _patch(base, target)
    changes, _ = decode_changes(base, v.manifest, v.payload)
    assert [c.positions is None for c in changes] == [True, False]
    assert changes[1].positions is not None and changes[1].count == len(range(0, 64 * 64, 50))
    commit(base, changes)
    assert base.bitwise_equal(target)

from __future__ import annotations

import pytest

from patchswarm.protocol.errors import BaseMismatchError, FormatError, LayoutMismatchError, TargetMismatchError
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.patchfile import apply_version, build_version
from patchswarm.protocol.served import ServedModel
from tests.support.helpers import adam_like_pair


def test_patch_and_anchor_reach_the_target_bitwise() -> None:
    base, target = adam_like_pair(seed=1)
    key = SigningKey.generate()
    patch = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, key=key)
    model, digests = apply_version(base.clone(), patch.manifest, patch.payload)
    assert model.bitwise_equal(target) and digests == target.digests()
    assert model.metadata == target.metadata
    anchor = build_version(None, target, run_id="r", version=2, now_ms=0, key=key)
    assert anchor.manifest.kind == Kind.ANCHOR
    model, _ = apply_version(None, anchor.manifest, anchor.payload)
    assert model.bitwise_equal(target)
    assert patch.manifest.payload_size < anchor.manifest.payload_size / 5


def test_wrong_base_is_refused_before_anything_is_written() -> None:
    base, target = adam_like_pair(seed=2)
    patch = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0)
    with pytest.raises(BaseMismatchError):
        apply_version(target.clone(), patch.manifest, patch.payload)
    other = ServedModel.from_tensors({"x": target.typed(0)})
    with pytest.raises(LayoutMismatchError):
        apply_version(other, patch.manifest, patch.payload)


@pytest.mark.parametrize("fmt", [1, 2])
def test_lying_base_digests_are_caught_by_the_target_check(fmt: int) -> None:
    base, target = adam_like_pair(seed=3)
    patch = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, payload_format=fmt)
    wrong = target.clone()
    # Claim the right base digests for the wrong bytes: the target digest still catches it (format 2's
    # contexts, computed from the wrong base, may already fail to decode).
    with pytest.raises(TargetMismatchError if fmt == 1 else (TargetMismatchError, FormatError)):
        apply_version(wrong, patch.manifest, patch.payload, base_digests=base.digests())

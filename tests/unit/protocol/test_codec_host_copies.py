"""How often the codec's dense paths bring a tensor to the host (protocol/value_coding.py ``to_host``,
the one door of those copies; a no-op on the CPU, so counting its calls here counts the copies a
device tensor would make).  Payloads are checked bitwise against a fresh decode at the same time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from patchswarm.protocol import codec, value_coding
from patchswarm.protocol.codec import apply_patch, diff_tensor, encode_patch
from patchswarm.protocol.patch_format import Encoding
from patchswarm.protocol.served import ServedModel, TensorSpec


@pytest.fixture
def doors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(storage pointer, bytes) of every call of ``to_host`` (the real one still runs)."""
    seen: list[tuple[int, int]] = []
    real = value_coding.to_host

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.untyped_storage().data_ptr(), t.numel() * t.element_size()))
        return real(t)

    monkeypatch.setattr(value_coding, "to_host", spy)
    monkeypatch.setattr(codec, "to_host", spy)
    yield seen


def pair(changed: float, seed: int, n: int = 1 << 16) -> tuple[ServedModel, ServedModel]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    v = w.clone()
    k = int(n * changed)
    if changed >= 1:  # re-initialized: FULL is the smallest record
        v = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    else:
        pos = torch.randperm(n, generator=g)[:k]
        v.view(torch.int16)[pos] += 1
    spec = [TensorSpec("w", "BF16", (n,))]
    return ServedModel.from_tensors({"w": w}), ServedModel(spec, [ServedModel.from_tensors({"w": v}).data[0]])


@pytest.mark.parametrize("changed", [0.3, 1.0])
def test_dense_probe_brings_the_target_across_once(doors: list[tuple[int, int]], changed: float) -> None:
    """30% changed: the dense candidates are tried (sparse wins); re-initialized: FULL wins."""
    base, target = pair(changed, seed=1)
    t = target.data[0]
    # (format 1: format 2's context pass reads every base and target element; not what this counts)
    delta = diff_tensor(base.specs[0], base.data[0], t, payload_format=1)
    assert delta.encoding == (Encoding.FULL if changed == 1.0 else Encoding.SPARSE_ULP)
    target_ptr = t.untyped_storage().data_ptr()
    target_bytes = sum(n for p, n in doors if p == target_ptr)
    other_bytes = sum(n for p, n in doors if p != target_ptr)
    assert target_bytes == t.numel()  # once (it was up to three times: probe, FULL size, FULL write)
    assert other_bytes == t.numel()  # the XOR candidate, once
    doors.clear()
    enc = encode_patch(base, target, payload_format=1)
    assert sum(n for p, n in doors if p == target_ptr) == t.numel()  # writing the record copies nothing more
    assert apply_patch(base.clone(), enc.payload, base.specs).bitwise_equal(target)


def test_sparse_and_unchanged_tensors_never_cross_whole(doors: list[tuple[int, int]]) -> None:
    base, target = pair(0.01, seed=2)
    enc = encode_patch(base, target, payload_format=1)  # (format 1: see above)
    assert not doors
    assert apply_patch(base.clone(), enc.payload, base.specs).bitwise_equal(target)
    assert encode_patch(base, base.clone()).tensors[0].encoding == Encoding.SAME
    assert not doors

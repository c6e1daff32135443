"""The training-trajectory generator: deterministic, Adam-sparse, and every step a lossless patch."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import pytest
import torch

from patchswarm.daemon import trajectory
from patchswarm.daemon.trajectory import PRESETS, Trajectory, changed_fraction, generate, param_count, write_versions
from patchswarm.protocol.codec import apply_patch, encode_patch, iter_updates
from patchswarm.protocol.patch_format import Encoding
from patchswarm.protocol.safetensors_io import load_safetensors
from patchswarm.protocol.served import ServedModel

STEPS = 3


@cache
def _traj() -> Trajectory:
    return generate("tiny", steps=STEPS, lr=1e-6, seed=0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a
    )


def test_tiny_preset_size() -> None:
    assert 100_000 <= param_count("tiny") <= 300_000
    assert 20_000_000 <= param_count("bench") <= 40_000_000


def test_deterministic_for_a_seed() -> None:
    t = _traj()
    again = generate("tiny", steps=STEPS, lr=1e-6, seed=0)
    assert len(t.bf16) == len(t.fp8) == STEPS + 1
    for kind in ("bf16", "fp8"):
        assert all(_same(a, b) for a, b in zip(t.versions(kind), again.versions(kind), strict=True))
    assert t.rewards == again.rewards
    other = generate("tiny", steps=1, lr=1e-6, seed=1, warmup_steps=5)
    assert not _same(other.bf16[0], t.bf16[0])


def test_global_rng_and_flags_untouched() -> None:
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    generate("tiny", steps=1, warmup_steps=2, threads=1)
    assert torch.equal(torch.rand(3), expected)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads


def test_exports() -> None:
    t = _traj()
    v0 = t.fp8[0]
    for name, p in t.bf16[0].items():
        assert p.dtype == torch.bfloat16
        if p.dim() >= 2:
            assert v0[name].dtype == torch.float8_e4m3fn
            assert v0[f"{name}.scale"].dtype == torch.float32 and v0[f"{name}.scale"].shape == (1,)
        else:
            assert v0[name].dtype == torch.bfloat16 and f"{name}.scale" not in v0
    # Scales are fixed at version 0 and never move afterwards.
    for v in t.fp8[1:]:
        assert all(torch.equal(v[n], v0[n]) for n in v0 if n.endswith(".scale"))
    # Dequantized fp8 stays close to the bf16 export.
    w = t.fp8[0]["blocks.0.fc1.weight"].float() * t.fp8[0]["blocks.0.fc1.weight.scale"]
    assert torch.allclose(w, t.bf16[0]["blocks.0.fc1.weight"].float(), atol=float(w.abs().max()) / 8)


def test_each_step_changes_a_small_fraction() -> None:
    t = _traj()
    for i in range(1, STEPS + 1):
        bf16 = changed_fraction(t.bf16[i - 1], t.bf16[i])
        fp8 = changed_fraction(t.fp8[i - 1], t.fp8[i], fp8_only=True)
        assert 0.0005 < bf16 < 0.03, bf16
        assert 0 < fp8 < bf16 / 3, (fp8, bf16)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_every_pair_round_trips_bitwise(kind: str) -> None:
    versions = _traj().served(kind)
    for base, target in itertools.pairwise(versions):
        patch = encode_patch(base, target)
        assert 0 < patch.changed < patch.numel // 20
        assert Encoding.SPARSE_ULP in {s.encoding for s in patch.tensors}
        assert len(patch.payload) < target.nbytes // 20
        out = apply_patch(base.clone(), patch.payload, base.specs)
        assert out.bitwise_equal(target)
        staged = base.clone()  # the decode-only path (torch) gives the same words
        for u in iter_updates(patch.payload, base.specs, base):
            if u.positions is not None:
                staged.data[u.index].view(u.values.dtype)[u.positions] = u.values
            else:
                staged.data[u.index].copy_(u.values)
        assert staged.bitwise_equal(target)
    anchor = encode_patch(None, versions[-1])
    assert apply_patch(None, anchor.payload, versions[-1].specs).bitwise_equal(versions[-1])


def test_write_versions_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = _traj()
    paths = write_versions(t, tmp_path / "w")
    assert len(paths) == 2 * (STEPS + 1)
    for kind in ("bf16", "fp8"):
        for i, model in enumerate(t.served(kind)):
            loaded = load_safetensors(tmp_path / "w" / kind / f"v{i:04d}.safetensors")
            assert loaded.bitwise_equal(model)
            assert loaded.metadata["trajectory.version"] == str(i)
    argv = ["--preset", "tiny", "--steps", "1", "--warmup-steps", "3", "--out", str(tmp_path / "c")]
    assert trajectory.main(argv) == 0
    assert "v0 -> v1" in capsys.readouterr().out
    assert isinstance(load_safetensors(tmp_path / "c" / "fp8" / "v0001.safetensors"), ServedModel)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="preset"):
        generate("huge")
    with pytest.raises(ValueError, match="rl"):
        generate("tiny", rl="dpo")
    with pytest.raises(ValueError, match="kind"):
        _traj().versions("fp4")
    assert set(PRESETS) >= {"tiny", "bench"}

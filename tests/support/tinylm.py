"""The tiny trajectory model (daemon/trajectory.py, preset "tiny") for the reference-engine tests: an
exported state of a seeded model, and greedy decoding with the nn.Module itself (the oracle that the
functional forward of daemon/refengine.py is checked against).  Shared by tests/unit/daemon/test_refengine.py
and test_sidecar.py."""

from __future__ import annotations

import torch

from patchswarm.daemon import trajectory as tr

PRESET = tr.PRESETS["tiny"]


def random_export(seed: int, kind: str = "bf16") -> dict[str, torch.Tensor]:
    model = tr.TinyLM(PRESET)
    model.init_weights(torch.Generator().manual_seed(seed))
    return tr.export_bf16(model) if kind == "bf16" else tr.export_fp8(model, tr.fp8_scales(model))


def module_from_export(w: dict[str, torch.Tensor]) -> tr.TinyLM:
    model = tr.TinyLM(PRESET)
    state = {}
    for name, _ in model.named_parameters():
        x = w[name].float()
        if f"{name}.scale" in w:
            x = x * w[f"{name}.scale"].float()
        state[name] = x
    model.load_state_dict(state)
    return model.eval()


def greedy_reference(w: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the nn.Module itself (the oracle for the functional forward)."""
    model = module_from_export(w)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ctx = torch.tensor([seq[-PRESET.seq_len :]])
            seq.append(int(model(ctx)[0, -1].argmax()))
    return seq[len(prompt) :]

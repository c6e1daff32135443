"""(Re)create the codec's positive test vectors (docs/format.md, "Test vectors"), deterministically.

    .venv/bin/python tests/vectors/_codec/generate.py

``base.safetensors``, ``target.safetensors``, and ``payload-format1.bin`` / ``payload-format2.bin``:
the payloads that turn the base into the target, written in that payload format (format 2: at
least one SPARSE_CTX record).  Two tensors, a bf16 matrix and an fp8 e4m3 matrix, one
small AdamW-like step apart.  tests/unit/protocol/test_codec_ctx.py decodes each against its base.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[2]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[2]))

import torch  # noqa: E402

from patchswarm.protocol.codec import apply_patch, encode_patch  # noqa: E402
from patchswarm.protocol.patch_format import Encoding  # noqa: E402
from patchswarm.protocol.safetensors_io import save_safetensors  # noqa: E402
from patchswarm.protocol.served import ServedModel  # noqa: E402


def pair() -> tuple[ServedModel, ServedModel]:
    g = torch.Generator().manual_seed(37)
    a = torch.randn(64, 64, generator=g) * 0.02
    b = torch.randn(64, 64, generator=g) * 0.5
    step_a = a - 4e-6 * torch.sign(torch.randn(a.shape, generator=g))
    step_b = b - 4e-3 * torch.sign(torch.randn(b.shape, generator=g))
    base = {"a.weight": a.bfloat16(), "b.weight": b.to(torch.float8_e4m3fn)}
    target = {"a.weight": step_a.bfloat16(), "b.weight": step_b.to(torch.float8_e4m3fn)}
    return ServedModel.from_tensors(base), ServedModel.from_tensors(target)


def main() -> None:
    base, target = pair()
    save_safetensors(base, HERE / "base.safetensors")
    save_safetensors(target, HERE / "target.safetensors")
    for fmt in (1, 2):
        patch = encode_patch(base, target, payload_format=fmt)
        assert patch.payload[4] == fmt
        assert (Encoding.SPARSE_CTX in [t.encoding for t in patch.tensors]) == (fmt == 2)
        assert apply_patch(base.clone(), patch.payload, base.specs).bitwise_equal(target)
        (HERE / f"payload-format{fmt}.bin").write_bytes(patch.payload)
        print(fmt, len(patch.payload), [(t.name, t.encoding.name, t.changed) for t in patch.tensors])


if __name__ == "__main__":
    main()

"""Reading and writing served versions as safetensors files (header metadata preserved)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from protocol.errors import FormatError, UnsupportedDtypeError
from protocol.served import ServedModel, typed_view


def load_safetensors(path: str | os.PathLike[str], device: str = "cpu") -> ServedModel:
    path = Path(path)
    try:
        with safetensors.safe_open(str(path), framework="pt", device=device) as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError:
        raise
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "dtype" in msg.lower():
            raise UnsupportedDtypeError(f"{path}: {msg}") from None
        raise FormatError(f"{path}: not a readable safetensors file ({msg})") from None
    return ServedModel.from_tensors(tensors, metadata)


def save_safetensors(model: ServedModel, path: str | os.PathLike[str]) -> None:
    """Write atomically: a reader sees the old file or the complete new one, never a partial one."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for spec, data in model:
        tensors[spec.name] = typed_view(data.cpu(), spec)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        safetensors.torch.save_file(tensors, tmp, metadata=model.metadata or None)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

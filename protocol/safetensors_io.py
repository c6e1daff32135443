"""Reading and writing served versions as safetensors files (header metadata preserved)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from patchswarm.protocol.errors import FormatError, UnsupportedDtypeError
from patchswarm.protocol.files import MissingFileError, open_regular, write_atomic
from patchswarm.protocol.served import ServedModel, typed_view

MAX_MODEL_FILE_BYTES = 1 << 42  # 4 TiB: any model; the bound is for a file that is not one
_FD_DIR = Path("/proc/self/fd")


def load_safetensors(path: str | os.PathLike[str], device: str = "cpu") -> ServedModel:
    """A model from a safetensors file: a regular file (a FIFO or a device is refused before it is
    read), mapped by safetensors through the descriptor that was checked, not opened again by name."""
    path = Path(path)
    try:
        fd = open_regular(path, MAX_MODEL_FILE_BYTES)
    except MissingFileError:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    try:
        with safetensors.safe_open(str(_FD_DIR / str(fd)), framework="pt", device=device) as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "dtype" in msg.lower():
            raise UnsupportedDtypeError(f"{path}: {msg}") from None
        raise FormatError(f"{path}: not a readable safetensors file ({msg})") from None
    finally:
        os.close(fd)
    return ServedModel.from_tensors(tensors, metadata)


def save_safetensors(model: ServedModel, path: str | os.PathLike[str]) -> None:
    """Write atomically: a reader sees the old file or the complete new one, never a partial one."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for spec, data in model:
        tensors[spec.name] = typed_view(data.cpu(), spec)
    write_atomic(path, fill=lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=model.metadata or None))

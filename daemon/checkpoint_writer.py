"""Writing a served version as a Hugging Face checkpoint directory an engine's normal loader reads.

Shards of at most ``max_shard_bytes`` (tensors packed in name order, so the split is the same on every
host), ``model.safetensors.index.json`` when there is more than one (or a single ``model.safetensors``),
``config.json`` and ``generation_config.json`` from the version's ``checkpoint.files`` metadata (the
served dtype and ``served.quantization_config`` merged into config.json), tied tensors left out as
the source checkpoint had them.

The directory appears whole or not at all: it is built as ``DIR.tmp-<random>`` beside DIR, every
file fsynced, then swapped into place (``renameat2(RENAME_EXCHANGE)`` where the kernel has it, else
two renames, so DIR is at any moment the old directory, the new one, or briefly absent; never half
of one).  An existing DIR is replaced only if it holds nothing but checkpoint files.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon.checkpoint import (
    FILES_KEY,
    FORMAT_KEY,
    INDEX_NAME,
    MAX_SMALL_FILES_BYTES,
    QUANT_KEY,
    SINGLE_NAME,
    TIED_KEY,
    CheckpointError,
    check_tensor_name,
    plain_file_name,
)
from patchswarm.protocol.files import fsync_dir
from patchswarm.protocol.served import ServedModel, TensorSpec
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size, "5GB"
# The dtype config.json names for each served format (fp8: the unquantized tensors are bf16).
CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "bfloat16"}
_ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned


@dataclass(frozen=True)
class WrittenCheckpoint:
    path: Path
    shards: list[str]
    files: list[str]  # every file written, shards included


def shard_plan(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Tensors in name order, packed greedily into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own), as transformers splits: deterministic for one layout."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for s in sorted(specs, key=lambda s: s.name):
        if not shards or (size + s.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


# Bounds on what a manifest's checkpoint metadata may make a host write (docs/models.md): the files a
# reader carries are <= 256 KiB together; JSON escaping can grow text up to 6x, hence the raw bounds.
MAX_FILES = 16
MAX_FILES_RAW = 6 * MAX_SMALL_FILES_BYTES
MAX_QUANT_BYTES = 64 << 10
MAX_TIED_RAW = 1 << 20
MAX_TIED = 1024


def _metadata_json(metadata: dict[str, str], key: str, max_bytes: int) -> Any:
    """A manifest metadata value parsed strictly (protocol/untrusted_json.py); None when absent."""
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        return load_json(raw, max_bytes=max_bytes)
    except UntrustedJSONError as e:
        raise CheckpointError(f"metadata {key}: {e}") from None


def tied_aliases(metadata: dict[str, str]) -> dict[str, str]:
    """``checkpoint.tied`` as {alias: source}; CheckpointError when it is not a list of name pairs."""
    pairs = _metadata_json(metadata, TIED_KEY, MAX_TIED_RAW)
    if pairs is None:
        return {}
    if (
        not isinstance(pairs, list)
        or len(pairs) > MAX_TIED
        or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs)
    ):
        raise CheckpointError(f"metadata {TIED_KEY}: expected a list of at most {MAX_TIED} [alias, source] name pairs")
    for a, src in pairs:
        check_tensor_name(a, f"metadata {TIED_KEY}")
        check_tensor_name(src, f"metadata {TIED_KEY}")
    return {a: src for a, src in pairs}


def checkpoint_files(metadata: dict[str, str]) -> dict[str, str]:
    """The small files to write (config.json with the served dtype and quantization merged in)."""
    doc = _metadata_json(metadata, FILES_KEY, MAX_FILES_RAW)
    files: dict[str, str] = {}
    if doc is not None:
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise CheckpointError(f"metadata {FILES_KEY}: expected a JSON object of file name to text")
        if len(doc) > MAX_FILES:
            raise CheckpointError(f"metadata {FILES_KEY}: {len(doc)} files, more than the {MAX_FILES} allowed")
        size = sum(len(v.encode("utf-8", "surrogatepass")) for v in doc.values())
        if size > MAX_SMALL_FILES_BYTES:
            raise CheckpointError(
                f"metadata {FILES_KEY}: {size:,} bytes of files, more than the {MAX_SMALL_FILES_BYTES:,} allowed"
            )
        for name, text in doc.items():
            if not plain_file_name(name, ".json"):
                raise CheckpointError(f"metadata {FILES_KEY}: {name[:80]!r} is not a plain .json file name")
            files[name] = text
    if "config.json" in files:
        files["config.json"] = _served_config(files["config.json"], metadata)
    return files


def _served_config(text: str, metadata: dict[str, str]) -> str:
    try:
        cfg = load_json(text, max_bytes=MAX_SMALL_FILES_BYTES, allow_nan=True)
    except UntrustedJSONError as e:
        raise CheckpointError(f"metadata {FILES_KEY}: config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"metadata {FILES_KEY}: config.json is not a JSON object")
    dtype = CONFIG_DTYPE.get(metadata.get(FORMAT_KEY, ""))
    if dtype is not None:
        cfg["dtype"] = dtype  # transformers >= 4.56 spelling; older ones read torch_dtype
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype
    quant = _metadata_json(metadata, QUANT_KEY, MAX_QUANT_BYTES)
    if quant is not None:
        if not isinstance(quant, dict):
            raise CheckpointError(f"metadata {QUANT_KEY}: expected a JSON object")
        cfg["quantization_config"] = quant
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def write_checkpoint(
    model: ServedModel, path: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> WrittenCheckpoint:
    """Write ``model`` (and its metadata) as a checkpoint directory at ``path``, whole or not at all."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    target = Path(path)
    files = checkpoint_files(model.metadata)
    aliases = tied_aliases(model.metadata)
    held = {s.name for s in model.specs}
    for alias, source in sorted(aliases.items()):
        # a tied alias is left out of the files: one the version holds would be lost, and one whose
        # source it lacks could not be restored by a loader
        if alias in held or source not in held:
            why = "is in the version" if alias in held else f"its source {source!r} is not"
            raise CheckpointError(f"metadata {TIED_KEY}: tied tensor {alias!r} {why}")
    data = {s.name: (s, d) for s, d in model if s.name not in aliases}
    plan = shard_plan([s for s, _ in data.values()], max_shard_bytes)
    names = (
        [SINGLE_NAME]
        if len(plan) == 1
        else [f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]
    )
    existing = _existing_checkpoint(target)
    if existing is not None:
        _check_replaceable(target, existing)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{target.name}.tmp-{secrets.token_hex(6)}"
    os.mkdir(tmp, 0o755)
    try:
        weight_map: dict[str, str] = {}
        for shard, specs in zip(names, plan, strict=True):
            _write_shard(tmp / shard, [data[s.name] for s in specs])
            weight_map.update({s.name: shard for s in specs})
        written = list(names)
        if len(plan) > 1:
            total = sum(s.nbytes for s, _ in data.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_file(tmp / INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(INDEX_NAME)
        for name, text in sorted(files.items()):
            _write_file(tmp / name, text.encode("utf-8", "surrogatepass"))
            written.append(name)
        fsync_dir(tmp)
        _swap_into_place(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not e.filename:  # a write's ENOSPC / EFBIG names no file: say where
            raise OSError(e.errno, e.strerror or str(e), str(target)) from None
        raise
    return WrittenCheckpoint(target, names, written)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _write_shard(path: Path, tensors: list[tuple[TensorSpec, torch.Tensor]]) -> None:
    """One safetensors file, streamed from the served buffers (no second copy of the shard).

    The format (https://github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets}} padded with spaces, the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec, _ in tensors:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % _ALIGN)
    with open(path, "xb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for spec, buf in tensors:
            if spec.nbytes:
                fh.write(buf.cpu().contiguous().numpy().data)
        fh.flush()
        os.fsync(fh.fileno())


_CHECKPOINT_SUFFIXES = (".safetensors", ".json")


def _existing_checkpoint(target: Path) -> list[str] | None:
    """The names in an existing DIR (None when DIR does not exist)."""
    if not os.path.lexists(target):
        return None
    if target.is_symlink() or not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory; refusing to replace it")
    return sorted(os.listdir(target))


def _check_replaceable(target: Path, names: list[str]) -> None:
    """An existing DIR is replaced only when it is empty or a checkpoint: nothing but .safetensors /
    .json files, model.safetensors or the index among them (a folder of someone's JSON files is not one)."""
    for n in names:
        p = target / n
        if not n.endswith(_CHECKPOINT_SUFFIXES) or not (p.is_file() or p.is_symlink()):
            raise CheckpointError(
                f"{target}: holds {n!r}, which is not a checkpoint file; refusing to replace the directory"
            )
    if names and SINGLE_NAME not in names and INDEX_NAME not in names:
        raise CheckpointError(
            f"{target}: exists and holds no {SINGLE_NAME} or {INDEX_NAME}, so it is not a checkpoint; "
            "refusing to replace the directory"
        )


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the kernel or libc cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, target: Path) -> None:
    if not os.path.lexists(target):
        os.rename(tmp, target)  # a directory created meanwhile makes this fail (ENOTEMPTY), not merge
    elif _exchange(tmp, target):
        shutil.rmtree(tmp)  # tmp now holds the old directory
    else:
        old = target.parent / f"{target.name}.old-{secrets.token_hex(6)}"
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old)
    fsync_dir(target.parent)


_VERSION_DIR = re.compile(r"v([0-9]{1,20})")
_LEFTOVER = re.compile(r"v[0-9]{1,20}\.(tmp|old)-[0-9a-f]{12}|\.current\.tmp-[0-9a-f]{12}")
CURRENT = "current"


def export_version(model: ServedModel, root: str | os.PathLike[str], version: int, keep: int = 2) -> Path:
    """The daemon's ``export.dir``: write ``root/v<version>``, repoint the symlink ``root/current`` at it
    (atomically: a new link renamed over the old), and remove all but the newest ``keep`` versions
    (never the current one) and what an interrupted export left behind."""
    top = Path(root)
    top.mkdir(parents=True, exist_ok=True)
    name = f"v{version}"
    write_checkpoint(model, top / name)
    link = top / f".{CURRENT}.tmp-{secrets.token_hex(6)}"
    os.symlink(name, link)  # relative: the export directory can move or be mounted elsewhere
    try:
        os.replace(link, top / CURRENT)
    except BaseException:
        link.unlink(missing_ok=True)
        raise
    fsync_dir(top)
    entries = os.listdir(top)
    versions = sorted(int(m.group(1)) for n in entries if (m := _VERSION_DIR.fullmatch(n)))
    old = [f"v{v}" for v in versions[:-keep] if v != version]
    for n in old + [n for n in entries if _LEFTOVER.fullmatch(n)]:
        p = top / n
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return top / name

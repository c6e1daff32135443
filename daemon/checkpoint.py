"""Reading a Hugging Face checkpoint into the canonical served form.

A checkpoint is a directory with ``model.safetensors.index.json`` and its shards, a directory with one
``model.safetensors``, or a single ``.safetensors`` file.  What comes out is a dict of typed tensors
under the checkpoint's own names (``model.layers.0.self_attn.q_proj.weight``) plus the manifest metadata
that lets a host write the checkpoint back (``checkpoint.files``, ``checkpoint.tied``; docs/models.md).

Every part is hostile input: the index is bounded and parsed strictly (protocol/untrusted_json.py: a
tensor named twice is refused, not silently overwritten as ``json.loads`` would), shard names are
plain file names in the directory (``plain_file_name``: no ``/``, no ``..``, no hidden names), every
shard the index names must exist, and every tensor must be where the index says and nowhere else.
Shards are read by the project's one bounded
safetensors reader (protocol/safetensors_io.py).  The index format is the one transformers writes
(https://github.com/huggingface/transformers/blob/main/src/transformers/modeling_utils.py,
``save_pretrained``): ``{"metadata": {"total_size": N}, "weight_map": {tensor: shard file}}``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.files import InputFileError, MissingFileError, read_file
from patchswarm.protocol.safetensors_io import load_safetensors
from patchswarm.protocol.served import ServedModel, raw_bytes
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SMALL_FILES = ("config.json", "generation_config.json")  # carried in checkpoint.files
MAX_INDEX_BYTES = 32 << 20  # DeepSeek-V3's index (~92k tensors) is about 9 MB
MAX_SMALL_FILES_BYTES = 256 << 10  # config.json + generation_config.json together
MAX_TENSORS = 1 << 20
MAX_NAME_BYTES = 1024  # a tensor name
FILES_KEY = "checkpoint.files"
TIED_KEY = "checkpoint.tied"
FORMAT_KEY = "served.format"
QUANT_KEY = "served.quantization_config"


class CheckpointError(FormatError):
    """A checkpoint that cannot be read as one: one line naming the file and what is wrong."""


@dataclass
class Checkpoint:
    """A checkpoint's tensors (typed, on the CPU) and what a writer needs to rebuild it."""

    tensors: dict[str, torch.Tensor]
    files: dict[str, str] = field(default_factory=dict)  # small JSON files: name -> text
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias left out, tensor it equals)

    def metadata(self) -> dict[str, str]:
        """The manifest metadata keys this checkpoint carries (none for a bare file)."""
        out: dict[str, str] = {}
        if self.files:
            out[FILES_KEY] = json.dumps(self.files, sort_keys=True, separators=(",", ":"))
        if self.tied:
            out[TIED_KEY] = json.dumps([list(p) for p in self.tied], separators=(",", ":"))
        return out


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path`` (a directory or a .safetensors file); CheckpointError if it is not one."""
    p = Path(path)
    if not p.is_dir():
        model = load_safetensors(p)
        return Checkpoint({s.name: model.typed(i) for i, s in enumerate(model.specs)})
    files = _small_files(p)
    if (p / INDEX_NAME).exists() or (p / INDEX_NAME).is_symlink():
        tensors = _read_sharded(p)
    elif (p / SINGLE_NAME).exists():
        model = load_safetensors(p / SINGLE_NAME)
        tensors = {s.name: model.typed(i) for i, s in enumerate(model.specs)}
    else:
        raise CheckpointError(f"{p}: no {INDEX_NAME} or {SINGLE_NAME} in this directory")
    tied = _untie(p, tensors, files.get("config.json"))
    return Checkpoint(tensors, files, tied)


# ---------------------------------------------------------------- the index


def parse_index(data: bytes, where: str = INDEX_NAME) -> dict[str, str]:
    """The weight map of an index file: tensor name -> shard file name, every entry checked."""
    try:
        doc = load_json(data, max_bytes=MAX_INDEX_BYTES)
    except UntrustedJSONError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CheckpointError(f"{where}: expected an object with a weight_map object")
    meta = doc.get("metadata", {})
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: metadata must be an object")
    total = meta.get("total_size")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int | float) or total < 0):
        raise CheckpointError(f"{where}: metadata.total_size must be a non-negative number")
    wm: dict[str, Any] = doc["weight_map"]
    if not wm:
        raise CheckpointError(f"{where}: the weight_map names no tensor")
    if len(wm) > MAX_TENSORS:
        raise CheckpointError(f"{where}: {len(wm)} tensors, more than the {MAX_TENSORS} allowed")
    for name, shard in wm.items():
        check_tensor_name(name, where)
        if not isinstance(shard, str) or not plain_file_name(shard, ".safetensors"):
            raise CheckpointError(
                f"{where}: tensor {name!r} is in {shard!r}, which is not a .safetensors file name in this directory"
            )
    return wm


def check_tensor_name(name: str, where: str) -> None:
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES or not name.isprintable():
        raise CheckpointError(f"{where}: {name[:80]!r} is not a tensor name (printable, 1 to {MAX_NAME_BYTES} bytes)")


def plain_file_name(name: str, suffix: str) -> bool:
    """The one check of a file name that comes from a checkpoint or a manifest (shards in an index,
    ``checkpoint.files`` keys) before it is read or written: a file directly in the checkpoint
    directory, ending in ``suffix``, with no separator, no ``..``, nothing hidden, no control or
    invisible (format) characters, no surrogates, at most 255 bytes; never the index's own name
    unless that is what is asked for."""
    return (
        len(name) > len(suffix)
        and name.endswith(suffix)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and name.isprintable()
        and (name != INDEX_NAME or suffix == INDEX_NAME)
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def _read_sharded(d: Path) -> dict[str, torch.Tensor]:
    where = str(d / INDEX_NAME)
    try:
        data = read_file(d / INDEX_NAME, MAX_INDEX_BYTES)
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
    wm = parse_index(data, where)
    by_shard: dict[str, set[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, set()).add(name)
    missing = sorted(s for s in by_shard if not (d / s).is_file())
    if missing:
        raise CheckpointError(
            f"{where}: shard {missing[0]} is missing or not a file ({len(missing)} of {len(by_shard)} shards)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(by_shard):
        try:
            model = load_safetensors(d / shard)
        except MissingFileError as e:
            raise CheckpointError(str(e)) from None
        names = {s.name for s in model.specs}
        for n in sorted(names - by_shard[shard]):
            other = wm.get(n)
            why = f"the index puts it in {other}" if other else "the index does not name it"
            raise CheckpointError(f"{d / shard}: holds tensor {n!r}, but {why}")
        absent = sorted(by_shard[shard] - names)
        if absent:
            raise CheckpointError(f"{d / shard}: the index puts tensor {absent[0]!r} here, but the shard lacks it")
        for i, s in enumerate(model.specs):
            tensors[s.name] = model.typed(i)
    return tensors


# ---------------------------------------------------------------- config and tied weights


def _small_files(d: Path) -> dict[str, str]:
    files: dict[str, str] = {}
    left = MAX_SMALL_FILES_BYTES
    for name in SMALL_FILES:
        try:
            raw = read_file(d / name, left)
        except MissingFileError:
            continue
        except InputFileError as e:
            raise CheckpointError(f"{e} (config files may hold {MAX_SMALL_FILES_BYTES >> 10} KiB together)") from None
        left -= len(raw)
        try:
            if not isinstance(load_json(raw, max_bytes=MAX_SMALL_FILES_BYTES, allow_nan=True), dict):
                raise UntrustedJSONError("not an object")
        except UntrustedJSONError as e:
            raise CheckpointError(f"{d / name}: not a JSON object ({e})") from None
        files[name] = raw.decode("utf-8")
    return files


def tie_flag(config_text: str | None) -> bool:
    """Whether config.json ties the output embedding to the input one (``tie_word_embeddings``,
    top level or in ``text_config`` as multimodal configs put it).  Absent means not tied: the
    default differs per model class, and only what the file says is known."""
    if not config_text:
        return False
    try:
        cfg = load_json(config_text, max_bytes=MAX_SMALL_FILES_BYTES, allow_nan=True)
    except UntrustedJSONError as e:
        raise CheckpointError(f"config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json: not a JSON object")
    for c in (cfg, cfg.get("text_config"), cfg.get("language_config")):
        if isinstance(c, dict) and isinstance(c.get("tie_word_embeddings"), bool):
            return bool(c["tie_word_embeddings"])
    return False


def _embedding_pair(names: set[str] | list[str]) -> tuple[str, str] | None:
    """(lm_head name, input embedding name) by the transformers convention, or None."""
    embeds = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    if not embeds:
        return None
    embed = "model.embed_tokens.weight" if "model.embed_tokens.weight" in embeds else embeds[0]
    prefix = embed.removesuffix("embed_tokens.weight").removesuffix("model.")
    return f"{prefix}lm_head.weight", embed


def _untie(d: Path, tensors: dict[str, torch.Tensor], config_text: str | None) -> list[tuple[str, str]]:
    """Ship a tied output embedding once: left out (as transformers saves it) or equal bit for bit."""
    if not tie_flag(config_text):
        return []
    pair = _embedding_pair(list(tensors))
    if pair is None:
        return []
    alias, source = pair
    if alias in tensors:
        a, s = tensors[alias], tensors[source]
        same = a.dtype == s.dtype and a.shape == s.shape and torch.equal(raw_bytes(a), raw_bytes(s))
        if not same:
            raise CheckpointError(
                f"{d / 'config.json'}: tie_word_embeddings is true but {alias} differs from {source}; "
                "fix the config or the weights"
            )
        del tensors[alias]
    return [(alias, source)]


def read_served(path: str | os.PathLike[str]) -> ServedModel:
    """A served version from a checkpoint directory (its checkpoint metadata included) or from a
    safetensors file (its header metadata, as ``save_safetensors`` writes it)."""
    if not Path(path).is_dir():
        return load_safetensors(path)
    ck = read_checkpoint(path)
    return ServedModel.from_tensors(ck.tensors, ck.metadata())


def wants_directory(out: str, *, like_dir: bool = False, metadata: dict[str, str] | None = None) -> bool:
    """Whether an output path names a checkpoint directory: it is one or ends in '/'; or, unless it
    ends in .safetensors, the input was one (``like_dir``) or the version carries checkpoint files."""
    if out.endswith("/") or os.path.isdir(out):
        return True
    if out.endswith(".safetensors"):
        return False
    return like_dir or bool(metadata and FILES_KEY in metadata)

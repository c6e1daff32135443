"""A Hugging Face causal LM whose parameters are zero-copy views of weight-store tensors.

The model is built from DIR's config.json on the meta device (no memory, no random init), then
every parameter is replaced by the store tensor of the same Hugging Face name (canonical names,
docs/models.md); tied aliases (``lm_head.weight`` when ``tie_word_embeddings``) get the view of
the tensor they are tied to, so the store's bytes are the model's bytes: a version the daemon
writes in place is what the next forward pass computes with.  Non-persistent buffers (rotary
``inv_freq``) are not in a checkpoint: their modules are built again off the meta device, which
computes them as ``from_pretrained`` does.  A store that does not match the config (names,
shapes, dtypes) is refused in one line, and so is an fp8 store (transformers serves fp8 weights
only through its GPU kernels).

transformers is imported here only (the daemon never needs it).  Read, not copied:
https://github.com/huggingface/transformers/blob/main/src/transformers/modeling_utils.py
(``_move_missing_keys_from_meta_to_device``, ``_init_weights`` for rotary embeddings).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from patchswarm.protocol.untrusted_json import load_json

MAX_CONFIG_BYTES = 256 << 10  # config.json + generation_config.json, as the checkpoint reader bounds them
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_LAYER = re.compile(r"\.layers\.(\d{1,9})\.")


class ModelMismatch(ValueError):
    """The store's tensors are not the parameters of the model DIR's config describes (one line)."""


def load_config(checkpoint: Path) -> Any:
    """DIR's config.json as a transformers config (bounded, strict JSON first: hostile input)."""
    import transformers

    path = checkpoint / "config.json"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ModelMismatch(f"{path}: {e.strerror or e}") from None
    try:
        obj = load_json(raw, max_bytes=MAX_CONFIG_BYTES, allow_nan=True)
    except ValueError as e:
        raise ModelMismatch(f"{path}: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model_type"), str):
        raise ModelMismatch(f"{path}: no model_type")
    try:
        return transformers.AutoConfig.from_pretrained(str(checkpoint))
    except Exception as e:  # (a hostile file: transformers raises KeyError, TypeError, its validation errors...)
        raise ModelMismatch(f"{path}: transformers cannot read it: {one_line(e)}") from None


def one_line(e: BaseException) -> str:
    """What a third-party parser said of a file it refused, in one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def load_tokenizer(checkpoint: Path) -> Any:
    """DIR's tokenizer; ModelMismatch (one line) for files the tokenizer cannot read."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    except Exception as e:  # (the Rust tokenizer raises bare Exception; transformers KeyError on a bad tokenizer.json)
        raise ModelMismatch(f"the tokenizer files cannot be read: {one_line(e)}") from None


def _check_layer_count(config: Any, store: Mapping[str, torch.Tensor]) -> None:
    """Refuse a config asking more decoder layers than the store holds before building it: building
    ten million layers, even on the meta device, takes hours."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if type(layers) is not int:
        return
    held = {int(m.group(1)) for n in store if (m := _LAYER.search(n))}
    if held and not 0 < layers <= max(held) + 1:
        raise ModelMismatch(f"config.json's num_hidden_layers is {layers}; the store holds layers 0..{max(held)}")


def config_dtype(config: Any) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.bfloat16


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Give every module holding a non-persistent (meta) buffer real values: build that module again off
    the meta device from its config (rotary embeddings compute ``inv_freq`` in their constructor)."""
    owners: dict[str, torch.nn.Module] = {}
    for mod_name, mod in model.named_modules():
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            owners[mod_name] = mod
    for mod_name, mod in owners.items():
        cfg = getattr(mod, "config", None)
        bad = f"cannot compute buffer {mod_name}.{next(iter(mod._buffers))} of {type(mod).__name__}"
        if cfg is None or any(True for _ in mod.parameters(recurse=False)):
            raise ModelMismatch(bad)
        try:
            with torch.device("cpu"):
                fresh = type(mod)(cfg)
        except Exception as e:
            raise ModelMismatch(f"{bad}: {e}") from None
        parent_name, leaf = _split(mod_name)
        setattr(model.get_submodule(parent_name), leaf, fresh.to(device))
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ModelMismatch(f"cannot compute buffer {left[0]}")


def check_store(store: Mapping[str, torch.Tensor], wanted: Mapping[str, torch.Tensor]) -> None:
    """Refuse (one line) a store whose names, shapes or dtypes are not the model's."""
    fp8 = sorted(n for n, t in store.items() if t.dtype in FP8_DTYPES or n.endswith((".weight_scale", "_scale_inv")))
    if fp8:
        raise ModelMismatch(
            f"the store serves fp8 weights ({fp8[0]}): transformers cannot serve them on CPU; "
            "publish the run with --served-format bf16 for this engine"
        )
    missing = sorted(set(wanted) - set(store))
    if missing:
        raise ModelMismatch(f"the store has no tensor {missing[0]} (the config's model needs {len(wanted)} tensors)")
    extra = sorted(set(store) - set(wanted))
    if extra:
        raise ModelMismatch(f"the store holds {extra[0]}, which the config's model has no parameter for")
    for name, want in wanted.items():
        got = store[name]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ModelMismatch(
                f"{name}: the store holds {str(got.dtype).removeprefix('torch.')}{list(got.shape)}, "
                f"the config wants {str(want.dtype).removeprefix('torch.')}{list(want.shape)}"
            )


def _tie_groups(model: torch.nn.Module, store: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each parameter name -> the store name it reads: itself, or (tied) the one name of its group in the store."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    out: dict[str, str] = {}
    for names in groups.values():
        present = [n for n in names if n in store]
        if len(present) > 1:
            raise ModelMismatch(f"the store holds both {present[0]} and {present[1]}, which the config ties")
        source = present[0] if present else names[0]
        out |= dict.fromkeys(names, source)
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import transformers

    logging: Any = transformers.logging
    old = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(old)


def build_model(config: Any, store: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The causal LM of ``config`` with every parameter a view of ``store``'s tensor of that name.

    The store's tensors are used as they are (no copy, no cast): ``param.data_ptr()`` lies inside the
    store's mapping.  The model's dtype is the store's floating dtype (the config's when they are
    mixed).  ModelMismatch when the store does not fit the config."""
    import transformers

    devices = {t.device for t in store.values()}
    if len(devices) != 1:
        raise ModelMismatch(f"the store's tensors are on {len(devices)} devices, not one")
    device = devices.pop()
    # The served dtype is the store's (a trainer's float32 config.json serves bf16 weights just the same).
    floats = {t.dtype for t in store.values() if t.is_floating_point() and t.dtype not in FP8_DTYPES}
    dtype = floats.pop() if len(floats) == 1 else config_dtype(config)
    auto: Any = transformers.AutoModelForCausalLM
    _check_layer_count(config, store)
    try:
        with _quiet(), torch.device("meta"):
            model: torch.nn.Module = auto.from_config(config, dtype=dtype)
    except Exception as e:  # (config values transformers accepts and then cannot build: a negative size...)
        raise ModelMismatch(f"config.json: transformers cannot build the model: {one_line(e)}") from None
    sources = _tie_groups(model, store)
    wanted = {src: p for name, p in model.named_parameters(remove_duplicate=False) if (src := sources[name]) == name}
    check_store(store, wanted)
    params: dict[str, torch.nn.Parameter] = {}
    for name in sources:
        src = sources[name]
        if src not in params:
            params[src] = torch.nn.Parameter(store[src], requires_grad=False)
        mod_name, leaf = _split(name)
        model.get_submodule(mod_name)._parameters[leaf] = params[src]
    _rebuild_buffers(model, device)
    model.eval()
    return model

"""Weight-update requests for SGLang and vLLM, built from named torch tensors (docs/design.md#inference-engines).

Nothing here talks to an engine: every builder returns an :class:`EngineRequest` (method, path,
JSON body, query) that the activation driver sends.  The tensors travel by reference, as torch
multiprocessing reductions: on CUDA an IPC handle over the same device memory (the exporter must
keep that memory alive until the engine has loaded it: ``EngineRequest.keepalive`` holds it), on
CPU a shared-memory file descriptor (CPU tensors are moved into shared memory by torch; this is
what the tests use, engines load from CUDA).

SGLang: ``POST /update_weights_from_tensor`` with ``load_format="flattened_bucket"``.  Each entry
of ``serialized_named_tensors`` (one per TP rank) is the base64 of a ``ForkingPickler`` pickle of
``{"flattened_tensor": <1-D uint8 tensor>, "metadata": [<name, shape, dtype, start_idx, end_idx,
numel>, ...]}``, offsets in bytes; the engine rebuilds each tensor as
``flat[start_idx:end_idx].view(dtype).reshape(shape)``.  The metadata entries are
``types.SimpleNamespace`` objects: SGLang reads them by attribute and its restricted unpickler
admits ``types.*`` and ``torch.*``, so no SGLang class is needed on this side.  When every tensor
is a contiguous view of one storage (the weight store's buffer), the bucket *is* that storage: no
copy, one IPC handle for the whole model.

vLLM (IPC weight-transfer backend): ``POST /start_weight_update``, ``POST /update_weights
{"update_info": {names, dtype_names, shapes, ipc_handles_pickled}}`` where the pickled handles
are one ``{gpu_uuid: (rebuild_fn, args)}`` per tensor, then ``POST /finish_weight_update
{"weight_version"}``.
"""

from __future__ import annotations

import base64
import io
import math
import pickle
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import IO, Any, Literal

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reductions with ForkingPickler

LOAD_FORMAT = "flattened_bucket"
DEFAULT_ALIGN = 16
# Index of the device in the argument tuple of torch's CUDA tensor reduction (rebuild_cuda_tensor).
CUDA_DEVICE_ARG = 6

DeviceIds = Literal["uuid", "index"]
NamedTensors = Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One HTTP call to an engine.  ``keepalive``: objects that must outlive the call (the memory
    the IPC handles in the body point at); not part of the request."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, str] = field(default_factory=dict)
    keepalive: tuple[object, ...] = field(default=(), compare=False, repr=False)


def _items(tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    return items


# ---------------------------------------------------------------- the flattened bucket


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """Where one tensor lies in a bucket (SGLang's ``FlattenedTensorMetadata``; offsets in bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int

    @property
    def numel(self) -> int:
        """Bytes, as SGLang counts them (the element count of the uint8 slice)."""
        return self.end_idx - self.start_idx

    def to_wire(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name=self.name,
            shape=torch.Size(self.shape),
            dtype=self.dtype,
            start_idx=self.start_idx,
            end_idx=self.end_idx,
            numel=self.numel,
        )


@dataclass(frozen=True, slots=True)
class FlattenedBucket:
    """Named tensors as one flat uint8 tensor plus where each one lies in it."""

    flattened_tensor: torch.Tensor
    metadata: tuple[BucketEntry, ...]
    zero_copy: bool = False

    def __post_init__(self) -> None:
        flat = self.flattened_tensor
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError("the flattened tensor must be 1-D uint8")
        for e in self.metadata:
            nbytes = math.prod(e.shape) * e.dtype.itemsize
            if not 0 <= e.start_idx <= e.end_idx <= flat.numel() or e.end_idx - e.start_idx != nbytes:
                raise ValueError(f"{e.name}: bytes [{e.start_idx}, {e.end_idx}) do not hold {e.dtype}{e.shape}")
            if e.start_idx % e.dtype.itemsize:
                raise ValueError(f"{e.name}: offset {e.start_idx} is not aligned to {e.dtype.itemsize} bytes")

    @classmethod
    def from_tensors(cls, tensors: NamedTensors, *, align: int = DEFAULT_ALIGN) -> FlattenedBucket:
        """Zero-copy over the shared storage when every tensor is a contiguous view of the same one;
        otherwise a new buffer with each tensor copied in at an ``align``-byte boundary."""
        items = _items(tensors)
        if not items:
            raise ValueError("cannot build an empty bucket")
        if align <= 0 or align & (align - 1):
            raise ValueError("align must be a power of two")
        shared = _shared_storage(items)
        if shared is not None:
            entries = tuple(_entry(name, t, _byte_offset(t)) for name, t in items)
            return cls(shared, entries, zero_copy=True)
        device = items[0][1].device
        entries_list: list[BucketEntry] = []
        offset = 0
        for name, t in items:
            if t.device != device:
                raise ValueError(f"{name}: on {t.device}, the bucket is on {device}")
            offset = -(-offset // align) * align
            entries_list.append(_entry(name, t, offset))
            offset += t.numel() * t.element_size()
        flat = torch.zeros(offset, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for (_, t), e in zip(items, entries_list, strict=True):
                if e.numel:
                    flat[e.start_idx : e.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return cls(flat, tuple(entries_list))

    def reconstruct(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors as views of the bucket (what the engine does on its side)."""
        flat = self.flattened_tensor
        return [(e.name, flat[e.start_idx : e.end_idx].view(e.dtype).reshape(e.shape)) for e in self.metadata]

    def to_wire(self) -> dict[str, Any]:
        """The object SGLang deserializes for ``load_format="flattened_bucket"``."""
        return {"flattened_tensor": self.flattened_tensor, "metadata": [e.to_wire() for e in self.metadata]}


def _entry(name: str, t: torch.Tensor, start: int) -> BucketEntry:
    return BucketEntry(name, tuple(t.shape), t.dtype, start, start + t.numel() * t.element_size())


def _byte_offset(t: torch.Tensor) -> int:
    return int(t.storage_offset()) * t.element_size() if t.numel() else 0


def _shared_storage(items: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The one storage all (non-empty) tensors are contiguous views of, as a uint8 tensor."""
    nonempty = [t for _, t in items if t.numel()]
    if not nonempty:
        return None
    storage = nonempty[0].untyped_storage()
    for t in nonempty:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
    return torch.empty(0, dtype=torch.uint8, device=nonempty[0].device).set_(storage)


# ---------------------------------------------------------------- serialization


def _reduce_tensor(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's own reduction, looked up at call time (so a patched one, e.g. SGLang's, is honoured)."""
    rebuild, args = reductions.reduce_tensor(t)  # type: ignore[no-untyped-call]
    return rebuild, tuple(args)


def with_device_uuid(args: tuple[Any, ...], uuid: str) -> tuple[Any, ...]:
    """A CUDA reduction's arguments with the device index replaced by the GPU's UUID (what SGLang's
    patched ``rebuild_cuda_tensor`` accepts, and robust to different ``CUDA_VISIBLE_DEVICES``)."""
    if len(args) <= CUDA_DEVICE_ARG:
        return args
    return (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _reduce_tensor_by_uuid(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = _reduce_tensor(t)
    if t.is_cuda:
        args = with_device_uuid(args, gpu_uuid(t.device))
    return rebuild, args


class _IpcPickler(ForkingPickler):
    """ForkingPickler (torch's shared-memory / CUDA IPC reductions), optionally naming GPUs by UUID."""

    def __init__(self, file: IO[bytes], device_ids: DeviceIds) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        if device_ids == "uuid":
            table = dict(self.dispatch_table)
            table[torch.Tensor] = _reduce_tensor_by_uuid
            table[torch.nn.Parameter] = _reduce_tensor_by_uuid
            self.dispatch_table = table


def serialize_ipc(obj: object, *, device_ids: DeviceIds = "uuid") -> str:
    """Base64 of a ``ForkingPickler`` pickle (SGLang's ``MultiprocessingSerializer(output_str=True)``)."""
    if device_ids not in ("uuid", "index"):
        raise ValueError("device_ids must be 'uuid' or 'index'")
    buf = io.BytesIO()
    _IpcPickler(buf, device_ids).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _WeightUnpickler(pickle.Unpickler):
    """Loads only what a weight payload needs, with SGLang's allow-list (module prefixes)."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "types.", "torch.", "multiprocessing.resource_sharer.")
    DENIED = frozenset({("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("types", "CodeType"),
                        ("types", "FunctionType")})  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.DENIED or not (module + ".").startswith(self.ALLOWED):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weight payload")
        return super().find_class(module, name)


def deserialize_ipc(data: str | bytes) -> Any:
    """The inverse of :func:`serialize_ipc` (rebuilds tensors over the shared memory)."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    return _WeightUnpickler(io.BytesIO(raw)).load()


# ---------------------------------------------------------------- SGLang


def _version_str(version: int | str | None) -> str | None:
    return None if version is None else str(version)


def sglang_update_weights_from_tensor(
    tensors: NamedTensors | FlattenedBucket,
    *,
    tp_size: int = 1,
    weight_version: int | str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    device_ids: DeviceIds = "uuid",
) -> EngineRequest:
    """``POST /update_weights_from_tensor`` carrying one flattened bucket (serialized once per TP
    rank, so each rank releases its own IPC references)."""
    if tp_size < 1:
        raise ValueError("tp_size must be at least 1")
    bucket = tensors if isinstance(tensors, FlattenedBucket) else FlattenedBucket.from_tensors(tensors)
    wire = bucket.to_wire()
    body = {
        "serialized_named_tensors": [serialize_ipc(wire, device_ids=device_ids) for _ in range(tp_size)],
        "load_format": LOAD_FORMAT,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": _version_str(weight_version),
    }
    return EngineRequest("POST", "/update_weights_from_tensor", body, keepalive=(bucket,))


def sglang_bucketed_updates(
    tensors: NamedTensors,
    *,
    bucket_bytes: int = 1 << 30,
    weight_version: int | str | None = None,
    **options: Any,
) -> list[EngineRequest]:
    """The same update cut into buckets of about ``bucket_bytes`` (a tensor is never split): only the
    last request flushes the cache and sets the weight version.  ``options``: as
    :func:`sglang_update_weights_from_tensor` (``tp_size``, ``abort_all_requests``, ``device_ids``)."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in _items(tensors):
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    if not groups[-1]:
        raise ValueError("no tensors to send")
    flush = options.pop("flush_cache", True)
    abort = options.pop("abort_all_requests", False)
    return [
        sglang_update_weights_from_tensor(
            group,
            weight_version=weight_version if i == len(groups) - 1 else None,
            flush_cache=flush and i == len(groups) - 1,
            abort_all_requests=abort and i == 0,
            **options,
        )
        for i, group in enumerate(groups)
    ]


def load_sglang_bucket(serialized: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """What an SGLang rank does with its ``serialized_named_tensors`` entry (for tests and fakes)."""
    obj = deserialize_ipc(serialized)
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise ValueError("not a flattened-bucket payload")
    flat = obj["flattened_tensor"]
    if not isinstance(flat, torch.Tensor):
        raise ValueError("flattened_tensor is not a tensor")
    entries = tuple(BucketEntry(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in obj["metadata"])
    return FlattenedBucket(flat, entries).reconstruct()


def sglang_pause_generation(mode: Literal["abort", "retract", "in_place"] = "in_place") -> EngineRequest:
    return EngineRequest("POST", "/pause_generation", {"mode": mode})


def sglang_continue_generation() -> EngineRequest:
    return EngineRequest("POST", "/continue_generation", {})


def sglang_update_weight_version(version: int | str, *, abort_all_requests: bool = False) -> EngineRequest:
    return EngineRequest(
        "POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": abort_all_requests}
    )


def sglang_flush_cache() -> EngineRequest:
    return EngineRequest("POST", "/flush_cache")


# ---------------------------------------------------------------- vLLM


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


IpcHandle = tuple[Any, tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class VllmUpdateInfo:
    """The IPC backend's ``update_info``: per tensor its name, dtype name, shape and
    ``{device_key: (rebuild_fn, args)}``.  ``keepalive``: the tensors the handles point at."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, IpcHandle]]
    keepalive: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """With live handles, for in-process or Ray delivery (``llm.update_weights(update_info=...)``)."""
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes,
                "ipc_handles": self.ipc_handles}  # fmt: skip

    def to_http(self) -> dict[str, Any]:
        """JSON-safe: the handles pickled and base64-encoded in ``ipc_handles_pickled`` (vLLM's HTTP mode,
        which ``pickle.loads`` them and puts its own device index in place of the exporter's)."""
        # ForkingPickler: CUDA handles pickle as with pickle.dumps; CPU storages go by shared memory.
        pickled = serialize_ipc(self.ipc_handles, device_ids="index")
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes,
                "ipc_handles_pickled": pickled}  # fmt: skip


def vllm_update_info(tensors: NamedTensors, *, device_key: str | None = None) -> VllmUpdateInfo:
    """Handles for every tensor.  The key is the GPU's UUID for CUDA tensors (a vLLM worker looks
    its own GPU's UUID up), ``device_key`` when given, else ``"cpu"`` (tests only).  Tensors that
    share one storage share one CUDA IPC allocation, which the receiver opens once."""
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, IpcHandle]] = []
    kept: list[torch.Tensor] = []
    for name, t in _items(tensors):
        w = t.detach().contiguous()
        key = device_key if device_key is not None else gpu_uuid(w.device) if w.is_cuda else w.device.type
        names.append(name)
        dtypes.append(dtype_name(w.dtype))
        shapes.append(list(w.shape))
        handles.append({key: _reduce_tensor(w)})
        kept.append(w)
    return VllmUpdateInfo(names, dtypes, shapes, handles, tuple(kept))


def vllm_update_weights(tensors: NamedTensors, *, device_key: str | None = None) -> EngineRequest:
    """``POST /update_weights {"update_info": {names, dtype_names, shapes, ipc_handles_pickled}}``."""
    info = vllm_update_info(tensors, device_key=device_key)
    return EngineRequest("POST", "/update_weights", {"update_info": info.to_http()}, keepalive=info.keepalive)


def load_vllm_handles(update_info: Mapping[str, Any], device_key: str) -> list[tuple[str, torch.Tensor]]:
    """What a vLLM worker does with ``update_info`` (for tests and fakes; CPU handles only rebuild
    in the exporting process, CUDA ones anywhere on the node)."""
    if "ipc_handles_pickled" in update_info:
        handles = _WeightUnpickler(io.BytesIO(base64.b64decode(update_info["ipc_handles_pickled"]))).load()
    else:
        handles = update_info["ipc_handles"]
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape, handle in zip(
        update_info["names"], update_info["dtype_names"], update_info["shapes"], handles, strict=True
    ):
        rebuild, args = handle[device_key]
        t = rebuild(*args)
        if dtype_name(t.dtype) != dtype or list(t.shape) != list(shape):
            raise ValueError(f"{name}: handle rebuilds {t.dtype}{tuple(t.shape)}, metadata says {dtype}{shape}")
        out.append((name, t))
    return out


def vllm_start_weight_update(*, is_checkpoint_format: bool = True) -> EngineRequest:
    return EngineRequest("POST", "/start_weight_update", {"is_checkpoint_format": is_checkpoint_format})


def vllm_finish_weight_update(weight_version: int | str | None = None) -> EngineRequest:
    return EngineRequest("POST", "/finish_weight_update", {"weight_version": _version_str(weight_version)})


def vllm_init_weight_transfer_engine(init_info: Mapping[str, Any] | None = None) -> EngineRequest:
    """The IPC backend needs no initialization info (the backend is chosen by the server's config)."""
    return EngineRequest("POST", "/init_weight_transfer_engine", {"init_info": dict(init_info or {})})


def vllm_pause(mode: Literal["abort", "wait", "keep"] = "keep", *, clear_cache: bool = False) -> EngineRequest:
    return EngineRequest("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})


def vllm_resume() -> EngineRequest:
    return EngineRequest("POST", "/resume", {})


def vllm_update_sequence(
    tensors: NamedTensors, weight_version: int | str, *, device_key: str | None = None
) -> list[EngineRequest]:
    """start, update, finish: the calls of one vLLM weight update, in order."""
    return [
        vllm_start_weight_update(),
        vllm_update_weights(tensors, device_key=device_key),
        vllm_finish_weight_update(weight_version),
    ]

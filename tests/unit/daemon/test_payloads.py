"""Structure of the SGLang and vLLM weight-update payloads, and that they rebuild the inputs bitwise.

CPU tensors travel through shared memory (torch's file-descriptor reduction), so every
deserialization here happens in the exporting process; CUDA handles (any process on the node)
are exercised only where a GPU is present.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle

import pytest
import torch

from patchswarm.daemon import payloads as P

# Module prefixes SGLang's SafeUnpickler admits (python/sglang/srt/utils/common.py), less those
# a weight payload never needs.
SGLANG_ALLOWED = ("builtins.", "collections.", "copyreg.", "types.", "torch.", "multiprocessing.resource_sharer.",
                  "multiprocessing.reduction.")  # fmt: skip


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(5, 3, generator=g),  # 60 bytes: the next offset needs alignment
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes, odd element count
        "c.fp8": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "d.i64": torch.arange(4, dtype=torch.int64) - 2,
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(3.5, dtype=torch.float64),
        "g.empty": torch.empty(0, 4, dtype=torch.float16),
        "h.nan": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float32),
    }


class RecordingUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.globals: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str) -> object:
        self.globals.append((module, name))
        return super().find_class(module, name)


# ---------------------------------------------------------------- the bucket


def test_bucket_copies_into_aligned_offsets_and_rebuilds_bitwise() -> None:
    tensors = mixed_tensors()
    bucket = P.FlattenedBucket.from_tensors(tensors)
    assert not bucket.zero_copy
    flat = bucket.flattened_tensor
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert [e.name for e in bucket.metadata] == list(tensors)
    for e in bucket.metadata:
        t = tensors[e.name]
        assert e.start_idx % P.DEFAULT_ALIGN == 0
        assert e.numel == e.end_idx - e.start_idx == t.numel() * t.element_size()
        assert e.shape == tuple(t.shape) and e.dtype == t.dtype
    ends = [e.end_idx for e in bucket.metadata]
    assert flat.numel() == max(ends)
    for name, t in bucket.reconstruct():
        assert bitwise_equal(t, tensors[name]), name


def test_bucket_over_one_storage_is_zero_copy() -> None:
    buf = torch.zeros(256, dtype=torch.uint8)
    views = {
        "w": buf[0:48].view(torch.float32).reshape(3, 4),
        "b": buf[64:72].view(torch.bfloat16),
        "q": buf[100:110].view(torch.float8_e4m3fn).reshape(2, 5),
    }
    views["w"].copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    bucket = P.FlattenedBucket.from_tensors(views)
    assert bucket.zero_copy
    assert bucket.flattened_tensor.data_ptr() == buf.data_ptr() and bucket.flattened_tensor.numel() == 256
    assert [(e.start_idx, e.end_idx) for e in bucket.metadata] == [(0, 48), (64, 72), (100, 110)]
    rebuilt = dict(bucket.reconstruct())
    buf[64:72] = 7  # the bucket aliases the store: a write there is what the engine reads
    assert torch.equal(raw(rebuilt["b"]), torch.full((8,), 7, dtype=torch.uint8))
    assert torch.equal(rebuilt["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_bucket_falls_back_to_a_copy_for_separate_or_strided_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bucket = P.FlattenedBucket.from_tensors({"t": base.t(), "x": base[0]})
    assert not bucket.zero_copy
    rebuilt = dict(bucket.reconstruct())
    assert torch.equal(rebuilt["t"], base.t()) and torch.equal(rebuilt["x"], base[0])


def test_bucket_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        P.FlattenedBucket.from_tensors({})
    with pytest.raises(ValueError, match="unique"):
        P.FlattenedBucket.from_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="power of two"):
        P.FlattenedBucket.from_tensors({"a": torch.zeros(1)}, align=3)
    flat = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="aligned"):
        P.FlattenedBucket(flat, (P.BucketEntry("a", (2,), torch.float32, 2, 10),))
    with pytest.raises(ValueError, match="do not hold"):
        P.FlattenedBucket(flat, (P.BucketEntry("a", (4,), torch.float32, 8, 24),))
    with pytest.raises(ValueError, match="1-D uint8"):
        P.FlattenedBucket(torch.zeros(4), ())


# ---------------------------------------------------------------- SGLang


def test_sglang_request_structure() -> None:
    req = P.sglang_update_weights_from_tensor(mixed_tensors(), tp_size=2, weight_version=12, flush_cache=False)
    assert (req.method, req.path, req.params) == ("POST", "/update_weights_from_tensor", {})
    body = req.json
    assert body is not None
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                         "weight_version"}  # fmt: skip
    assert body["load_format"] == "flattened_bucket"
    assert body["flush_cache"] is False and body["abort_all_requests"] is False
    assert body["weight_version"] == "12"
    assert len(body["serialized_named_tensors"]) == 2
    assert all(isinstance(s, str) and base64.b64decode(s, validate=True) for s in body["serialized_named_tensors"])
    json.dumps(body)  # the whole body travels as JSON
    assert len(req.keepalive) == 1 and isinstance(req.keepalive[0], P.FlattenedBucket)


def test_sglang_payload_deserializes_to_the_inputs() -> None:
    tensors = mixed_tensors()
    req = P.sglang_update_weights_from_tensor(tensors, tp_size=2)
    assert req.json is not None
    for rank_payload in req.json["serialized_named_tensors"]:  # every rank gets its own copy
        u = RecordingUnpickler(base64.b64decode(rank_payload))
        obj = u.load()
        assert set(obj) == {"flattened_tensor", "metadata"}
        flat = obj["flattened_tensor"]
        assert isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1
        # SGLang's reconstruction (FlattenedTensorBucket.reconstruct_tensors), by attribute access.
        rebuilt = {m.name: flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape) for m in obj["metadata"]}
        for m in obj["metadata"]:
            assert isinstance(m.shape, torch.Size) and isinstance(m.dtype, torch.dtype)
            assert m.numel == m.end_idx - m.start_idx
        assert list(rebuilt) == list(tensors)
        for name, t in tensors.items():
            assert bitwise_equal(rebuilt[name], t), name
        # Everything the pickle imports passes SGLang's restricted unpickler.
        assert u.globals and all((mod + ".").startswith(SGLANG_ALLOWED) for mod, _ in u.globals), u.globals
        assert ("types", "SimpleNamespace") in u.globals


def test_load_sglang_bucket_round_trip() -> None:
    tensors = mixed_tensors()
    req = P.sglang_update_weights_from_tensor(tensors)
    assert req.json is not None
    rebuilt = P.load_sglang_bucket(req.json["serialized_named_tensors"][0])
    assert [n for n, _ in rebuilt] == list(tensors)
    assert all(bitwise_equal(t, tensors[n]) for n, t in rebuilt)


def test_sglang_zero_copy_bucket_shares_memory_with_the_source() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    views = {"a": buf[0:16].view(torch.float32), "b": buf[16:24].view(torch.bfloat16)}
    req = P.sglang_update_weights_from_tensor(views)
    assert req.json is not None
    rebuilt = dict(P.load_sglang_bucket(req.json["serialized_named_tensors"][0]))
    buf[0:4] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)  # 1.0f, written after serialization
    assert rebuilt["a"][0].item() == 1.0


def test_restricted_unpickler_refuses_foreign_globals() -> None:
    evil = pickle.dumps(os.getcwd)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        P.deserialize_ipc(evil)
    with pytest.raises(ValueError, match="flattened-bucket"):
        P.load_sglang_bucket(P.serialize_ipc({"x": 1}))


def test_sglang_bucketed_updates_split_and_flush_once() -> None:
    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(5)}  # 256 bytes each
    reqs = P.sglang_bucketed_updates(tensors, bucket_bytes=600, weight_version=3, abort_all_requests=True)
    assert len(reqs) == 3
    bodies = [r.json for r in reqs]
    assert all(b is not None for b in bodies)
    assert [b["flush_cache"] for b in bodies if b] == [False, False, True]
    assert [b["weight_version"] for b in bodies if b] == [None, None, "3"]
    assert [b["abort_all_requests"] for b in bodies if b] == [True, False, False]
    names = [n for b in bodies if b for n, _ in P.load_sglang_bucket(b["serialized_named_tensors"][0])]
    assert names == list(tensors)


def test_cuda_device_is_named_by_uuid() -> None:
    args = (torch.Tensor, (2,), (1,), 0, torch.UntypedStorage, torch.float32, 3, b"handle", 8, 0, False)
    swapped = P.with_device_uuid(args, "GPU-1234")
    assert swapped[P.CUDA_DEVICE_ARG] == "GPU-1234"
    assert swapped[: P.CUDA_DEVICE_ARG] == args[: P.CUDA_DEVICE_ARG]
    assert swapped[P.CUDA_DEVICE_ARG + 1 :] == args[P.CUDA_DEVICE_ARG + 1 :]
    assert P.with_device_uuid(args[:3], "GPU-1234") == args[:3]  # CPU reductions carry no device
    with pytest.raises(ValueError, match="device_ids"):
        P.serialize_ipc({}, device_ids="name")  # type: ignore[arg-type]


def test_sglang_control_requests() -> None:
    assert P.sglang_pause_generation() == P.EngineRequest("POST", "/pause_generation", {"mode": "in_place"})
    assert P.sglang_continue_generation() == P.EngineRequest("POST", "/continue_generation", {})
    assert P.sglang_update_weight_version(9).json == {"new_version": "9", "abort_all_requests": False}
    assert P.sglang_flush_cache().path == "/flush_cache"


# ---------------------------------------------------------------- vLLM


def test_vllm_update_weights_structure() -> None:
    tensors = mixed_tensors()
    req = P.vllm_update_weights(tensors)
    assert (req.method, req.path) == ("POST", "/update_weights")
    assert req.json is not None
    info = req.json["update_info"]
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
    assert info["names"] == list(tensors)
    assert info["dtype_names"] == ["float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "float64", "float16",
                                   "float32"]  # fmt: skip
    assert info["shapes"] == [list(t.shape) for t in tensors.values()]
    json.dumps(req.json)
    handles = P.deserialize_ipc(info["ipc_handles_pickled"])
    assert len(handles) == len(tensors)
    assert all(set(h) == {"cpu"} and callable(h["cpu"][0]) and isinstance(h["cpu"][1], tuple) for h in handles)
    # (A CPU handle opens once: rebuild from the handles just unpickled.)
    unpickled = {k: v for k, v in info.items() if k != "ipc_handles_pickled"} | {"ipc_handles": handles}
    rebuilt = P.load_vllm_handles(unpickled, "cpu")
    assert all(bitwise_equal(t, tensors[n]) for n, t in rebuilt)


def test_vllm_pickled_handles_load_like_a_worker() -> None:
    tensors = {"x": torch.arange(5, dtype=torch.int32), "y": torch.ones(2, 2, dtype=torch.bfloat16)}
    req = P.vllm_update_weights(tensors)
    assert req.json is not None
    rebuilt = P.load_vllm_handles(req.json["update_info"], "cpu")
    assert all(bitwise_equal(t, tensors[n]) for n, t in rebuilt)


def test_vllm_update_info_live_handles_and_device_key() -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}  # not contiguous: copied, kept alive
    info = P.vllm_update_info(tensors, device_key="GPU-abc")
    d = info.to_dict()
    assert set(d) == {"names", "dtype_names", "shapes", "ipc_handles"}
    assert list(d["ipc_handles"][0]) == ["GPU-abc"]
    assert len(info.keepalive) == 1 and info.keepalive[0].is_contiguous()
    ((name, t),) = P.load_vllm_handles(d, "GPU-abc")
    assert name == "w" and torch.equal(t, tensors["w"])
    bad = dict(d, shapes=[[6]])
    with pytest.raises(ValueError, match="metadata says"):
        P.load_vllm_handles(bad, "GPU-abc")


def test_vllm_control_requests() -> None:
    seq = P.vllm_update_sequence({"a": torch.zeros(2)}, 5)
    assert [r.path for r in seq] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert seq[0].json == {"is_checkpoint_format": True}
    assert seq[2].json == {"weight_version": "5"}
    assert P.vllm_pause() == P.EngineRequest("POST", "/pause", None, {"mode": "keep", "clear_cache": "false"})
    assert P.vllm_resume().path == "/resume"
    assert P.vllm_init_weight_transfer_engine().json == {"init_info": {}}
    assert P.dtype_name(torch.bfloat16) == "bfloat16"


# ---------------------------------------------------------------- CUDA (only where a GPU is present)


def _child_sum(payload: str, kind: str, queue: object) -> None:
    import torch.multiprocessing as mp  # noqa: F401

    if kind == "sglang":
        tensors = P.load_sglang_bucket(payload)
    else:
        tensors = P.load_vllm_handles(json.loads(payload), P.gpu_uuid(torch.device("cuda", 0)))
    queue.put(sorted((n, float(t.float().sum().item())) for n, t in tensors))  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_cuda_handles_open_in_another_process(kind: str) -> None:
    import torch.multiprocessing as mp

    tensors = {"a": torch.arange(8, dtype=torch.float32, device="cuda"), "b": torch.ones(3, 3, device="cuda")}
    if kind == "sglang":
        req = P.sglang_update_weights_from_tensor(tensors, device_ids="index")
        assert req.json is not None
        payload = req.json["serialized_named_tensors"][0]
    else:
        req = P.vllm_update_weights(tensors)
        assert req.json is not None
        payload = json.dumps(req.json["update_info"])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_sum, args=(payload, kind, queue))
    proc.start()
    got = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert got == [("a", 28.0), ("b", 9.0)]

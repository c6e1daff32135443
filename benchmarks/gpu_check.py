"""GPU checks that are not pytest tests: the codec's torch path and the store digest on a device.

    python -m benchmarks.gpu_check [--device cuda:0] [--gb 2] [--frac 0.005] [--tensor-mb 128] [--json OUT.json]
    python -m benchmarks.gpu_check --format2-only [--format2-mb 512]     (e alone)

a) Codec on the device: a synthetic bf16 model (0.5% of values moved by one or two ulps) lives on
   the device; ``encode_patch`` scans it there (protocol.diffscan's torch path) and the payload must
   be byte-identical to the one encoded from a host copy; ``apply_patch`` onto a device copy of the
   base must rebuild the target bit for bit.  Prints both encode times and the device apply time.
b) Digest where the weights live: ``daemon.device_blake3.device_digests`` (BLAKE3 in torch ops) over
   the model's tensors on the device against the blake3 library over a host copy; prints both
   times and the GB/s of the device digest, and its peak scratch against ``scratch_bound``.
c) Host copies of the codec's dense paths: a tensor 30% changed (dense candidates tried) and one
   re-initialized (FULL) are encoded on the device; each crosses to the host once (counted at
   ``protocol.value_coding.to_host``) and the payload equals the host encode's.
d) The version fence with an asynchronous reader (docs/weightstore.md section 5): an engine buffer
   of ``--fence-gb`` on the device, a writer thread flipping it between two versions (5% of the words
   scattered per write, under the fence), and a reader that launches a copy of the whole store on a
   side stream and never syncs it itself.  With the old fence (sequence re-read as soon as the copy
   is launched, no readers' lock) torn copies pass as consistent (counted, expected > 0); with
   ``FenceReader.consistent(fn, sync=side_stream)`` none may (a mismatch).  Also the cost of one
   fenced read with nothing to read (lock + seqlock + sync), with and without the readers' lock.
   ``--fence-only`` runs this part alone.  On ``--device cpu`` the side stream is the CPU twin
   (daemon/cpu_stream.py).
e) Format 2's context pass where the store lives (``--format2-mb``; ``--format2-only`` runs it alone):
   an AdamW-like step of one large bf16 tensor (a change is a rounding boundary crossed, likelier
   the smaller the value), encoded on the host in payload format 1 and 2 (SPARSE_CTX required);
   ``apply_patch`` of each onto a device copy of the base (best of 2, the first warms), the
   format-2 result bitwise equal to the target and to the host decode, with no host copy of the
   base (counted at ``protocol.value_coding.to_host``); and format 2 encoded from the device copies:
   the host encode's bytes, no host copy.  Prints both device apply times, their ratio
   and the device memory the format-2 apply used above the model (its batches bound it).  On
   ``--device cpu`` the torch pass runs on the host (``context_pass_torch.ON_CPU``).

Any mismatch exits 1.  Run by benchmarks/gpu_check.sh; ``--device cpu`` runs the same code on
the host (a check of the script itself, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.codec_contexts import adam_like_synthetic
from patchswarm.daemon.cpu_stream import CpuStream
from patchswarm.daemon.device_blake3 import default_batch, device_digests, scratch_bound
from patchswarm.daemon.engine import FenceReader, allocate
from patchswarm.daemon.store_format import StoreLayout, TensorUpdate
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol import codec, context_pass_torch, value_coding
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest

COLS = 4096


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def synthetic(total: int, frac: float, device: torch.device, tensor_mb: int = 128) -> tuple[ServedModel, ServedModel]:
    """Two bf16 versions around N(0, 0.02): ``frac`` of the values moved by one or two ulps."""
    rows = max(1, (tensor_mb << 20) // (COLS * 2))
    g = torch.Generator(device=device).manual_seed(0)
    specs, old, new = [], [], []
    for i in range(max(1, total // (rows * COLS * 2))):
        w = (torch.randn(rows * COLS, generator=g, device=device) * 0.02).to(torch.bfloat16).view(torch.int16)
        k = int(w.numel() * frac)
        pos = torch.randint(0, w.numel(), (k,), generator=g, device=device)
        v = w.clone()
        v[pos] += torch.randint(1, 3, (k,), dtype=torch.int16, generator=g, device=device)
        specs.append(TensorSpec(f"layers.{i:04d}.weight", "BF16", (rows, COLS)))
        old.append(w.view(torch.uint8))
        new.append(v.view(torch.uint8))
    return ServedModel(specs, old), ServedModel(specs, new)


def device_copy_s(device: torch.device, data: list[torch.Tensor], reps: int = 3) -> float:
    """Best of ``reps``: copy every tensor into its own buffer on the same device."""
    copies = [torch.empty_like(t) for t in data]
    return min(timed(device, lambda: [c.copy_(t) for c, t in zip(copies, data, strict=True)])[1] for _ in range(reps))


def scatter_floor(device: torch.device, base: ServedModel, target: ServedModel) -> tuple[float, float]:
    """Best of 3: the changed words alone written to their places (positions and values already on
    the device, no decoding), then gathered and written back; the floor of any in-place apply."""
    w16 = [t.view(torch.int16).view(-1).clone() for t in base.data]
    new16 = [t.view(torch.int16).view(-1) for t in target.data]
    pos = [torch.nonzero(a != b).view(-1) for a, b in zip(w16, new16, strict=True)]
    vals = [b[p] for b, p in zip(new16, pos, strict=True)]
    jobs = list(zip(w16, pos, vals, strict=True))
    scatter = min(timed(device, lambda: [w.index_put_((p,), v) for w, p, v in jobs])[1] for _ in range(3))
    both = min(timed(device, lambda: [w.index_put_((p,), w[p]) for w, p, _ in jobs])[1] for _ in range(3))
    return scatter, both


def to_host(m: ServedModel) -> ServedModel:
    return ServedModel(m.specs, [t.cpu() for t in m.data])


def dense_host_copies(device: torch.device, n: int = 1 << 23) -> dict[str, float]:
    """Copies of the target to the host (in tensor sizes) when encoding a dense change on ``device``;
    -1.0 if the payload differs from the host encode's."""
    seen: list[tuple[int, int]] = []
    real = value_coding.to_host

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.untyped_storage().data_ptr(), t.numel() * t.element_size()))
        return real(t)

    g = torch.Generator(device=device).manual_seed(1)
    out: dict[str, float] = {}
    for label, frac in (("30%", 0.3), ("reinit", 1.0)):
        w = (torch.randn(n, generator=g, device=device) * 0.02).to(torch.bfloat16)
        v = (torch.randn(n, generator=g, device=device) * 0.02).to(torch.bfloat16) if frac == 1.0 else w.clone()
        if frac < 1.0:
            pos = torch.randint(0, n, (int(n * frac),), generator=g, device=device)
            v.view(torch.int16)[pos] += 1
        specs = [TensorSpec("w", "BF16", (n,))]
        base, target = ServedModel(specs, [w.view(torch.uint8)]), ServedModel(specs, [v.view(torch.uint8)])
        seen.clear()
        value_coding.to_host, codec.to_host = spy, spy  # type: ignore[assignment]
        try:
            enc = encode_patch(base, target)
        finally:
            value_coding.to_host, codec.to_host = real, real  # type: ignore[assignment]
        ptr = target.data[0].untyped_storage().data_ptr()
        copies = sum(b for p, b in seen if p == ptr) / target.nbytes
        same = enc.payload == encode_patch(to_host(base), to_host(target)).payload
        out[label] = copies if same else -1.0
    return out


def format2_check(device: torch.device, mb: int) -> dict[str, Any]:
    """e) a format-2 patch of one large bf16 tensor applied on ``device`` against format 1 (module doc)."""
    base, target = adam_like_synthetic(mb << 20, 1, 2e-7, seed=2)
    out: dict[str, Any] = {"tensor_bytes": base.nbytes}
    payloads = {fmt: encode_patch(base, target, payload_format=fmt).payload for fmt in (1, 2)}
    records = read_header(payloads[2], base.specs).records
    out["changed"] = records[0][1]
    out["sparse_ctx"] = records[0][0] == Encoding.SPARSE_CTX
    out["payload_bytes"] = {fmt: len(p) for fmt, p in payloads.items()}
    host_decode, out["apply_host_format2_s"] = timed(
        torch.device("cpu"), lambda: apply_patch(base.clone(), payloads[2], base.specs)
    )
    dev_base = [t.to(device) for t in base.data]
    copies: list[int] = []
    real = value_coding.to_host

    def spy(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.numel() * t.element_size())
        return real(t)

    saved = context_pass_torch.ON_CPU
    context_pass_torch.ON_CPU = True  # (on a CUDA device the torch pass runs anyway)
    try:
        dev_target = ServedModel(base.specs, [t.to(device) for t in target.data])
        dev_model = ServedModel(base.specs, dev_base)
        encode_patch(dev_model, dev_target, payload_format=2)  # warm
        copies.clear()
        value_coding.to_host = spy  # type: ignore[assignment]
        try:
            enc, out["encode_device_format2_s"] = timed(
                device, lambda: encode_patch(dev_model, dev_target, payload_format=2)
            )
        finally:
            value_coding.to_host = real  # type: ignore[assignment]
        out["encode_device_format2_identical"] = enc.payload == payloads[2]
        out["encode_device_format2_host_copies"] = sum(copies)
        for fmt, payload in payloads.items():
            runs = []
            for _ in range(2):  # the first also warms the kernels and the allocator
                work = ServedModel(base.specs, [t.clone() for t in dev_base])
                floor = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                copies.clear()
                value_coding.to_host = spy  # type: ignore[assignment]
                try:
                    runs.append(timed(device, lambda w=work, p=payload: apply_patch(w, p, base.specs)))  # type: ignore[misc]
                finally:
                    value_coding.to_host = real  # type: ignore[assignment]
                if device.type == "cuda":
                    out[f"apply_device_format{fmt}_scratch"] = torch.cuda.max_memory_allocated(device) - floor
            out[f"apply_device_format{fmt}_s"] = min(r[1] for r in runs)
            out[f"host_copies_format{fmt}"] = sum(copies)
            got = to_host(runs[-1][0])
            out[f"format{fmt}_bitwise"] = got.bitwise_equal(target)
            if fmt == 2:
                out["format2_equals_host_decode"] = got.bitwise_equal(host_decode)
    finally:
        context_pass_torch.ON_CPU = saved
    out["format2_over_format1"] = out["apply_device_format2_s"] / out["apply_device_format1_s"]
    out["ok"] = (
        out["sparse_ctx"]
        and out["format1_bitwise"]
        and out["format2_bitwise"]
        and out["format2_equals_host_decode"]
        and out["host_copies_format2"] == 0
        and out["encode_device_format2_identical"]
        and out["encode_device_format2_host_copies"] == 0
    )
    return out


def print_format2(f: dict[str, Any], device: torch.device) -> None:
    scratch = f.get("apply_device_format2_scratch")
    print(f"format 2 on {device}: one bf16 tensor of {f['tensor_bytes'] / 1e9:.2f} GB, {f['changed']:,} changed, "
          f"payloads {f['payload_bytes'][1]:,} B (format 1) and {f['payload_bytes'][2]:,} B (format 2, SPARSE_CTX "
          f"{f['sparse_ctx']}); apply on {device}: format 1 {f['apply_device_format1_s'] * 1e3:.1f} ms, format 2 "
          f"{f['apply_device_format2_s'] * 1e3:.1f} ms (**{f['format2_over_format1']:.2f}x**; host decode "
          f"{f['apply_host_format2_s'] * 1e3:.0f} ms); bitwise: target {f['format2_bitwise']}, host decode "
          f"{f['format2_equals_host_decode']}; host copies of the base {f['host_copies_format2']} B; encode on "
          f"{device} {f['encode_device_format2_s'] * 1e3:.0f} ms, payload identical to the host's "
          f"{f['encode_device_format2_identical']}, host copies {f['encode_device_format2_host_copies']} B"
          + (f"; device memory above the model {scratch / 2**20:.0f} MiB" if scratch is not None else ""))  # fmt: skip


def fence_check(device: torch.device, gb: float, reads: int = 300) -> dict[str, Any]:
    """d) torn copies the old fence lets through and the new one does not (see the module doc)."""
    n = max(1 << 12, int(gb * 1e9) // 4)
    spec = TensorSpec("w", "I32", (n,))
    name = f"psw-gpu-check-fence-{os.getpid()}"
    store = WeightStore.create(name, StoreLayout.from_specs([spec]), engine_buffer=True)
    out: dict[str, Any] = {"store_bytes": 4 * n}
    try:
        view = allocate(store.attach_info(), device)
        assert view.handle is not None
        store.bind_buffer(view.data, int(view.handle["buffer_id"]))  # (daemon and engine in one process)
        g = torch.Generator(device=device).manual_seed(3)
        a = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g, device=device)
        pos = torch.arange(int(torch.randint(0, 20, (1,))), n, 20, device=device)
        b = a.clone()
        b[pos] = torch.randint(-(2**31), 2**31 - 1, (pos.numel(),), dtype=torch.int32, generator=g, device=device)
        store.load(ServedModel([spec], [a.view(torch.uint8)]), 1, bytes(32), verify=False)
        # version k holds a (k odd) or b (k even); each write is the scatter between them
        staged = {
            0: store.stage([TensorUpdate(0, pos, b[pos], a[pos])]),
            1: store.stage([TensorUpdate(0, pos, a[pos], b[pos])]),
        }
        side: Any = torch.cuda.Stream(device) if device.type == "cuda" else CpuStream("fence-reader")
        copy = torch.empty_like(view.data)

        def launch() -> None:  # the reader's read: a copy of the whole store, queued and not waited for
            if device.type == "cuda":
                with torch.cuda.stream(side):
                    copy.copy_(view.data)
            else:
                side.launch(lambda: copy.copy_(view.data))

        stop, writes = threading.Event(), [0]

        def writer() -> None:
            k = 1
            while not stop.is_set():
                k += 1
                store.write_fenced(store.header(), k, k.to_bytes(32, "little"), staged[k % 2])
                writes[0] += 1
                time.sleep(2e-3)  # (writes are rare in real runs: leave the readers gaps to enter)

        fence = view.fence
        for mode in ("old", "new"):
            w = threading.Thread(target=writer)
            writes[0], torn_unseen, changed = 0, 0, 0
            stop.clear()
            w.start()
            try:
                for _ in range(reads):
                    if mode == "old":  # the fence before: no lock, seq re-read as soon as fn returns
                        start = fence.wait_stable()
                        launch()
                        moved = fence.seq() != start.seq
                        side.synchronize()  # (to check the copy; the old fence never waited for it)
                        version = start.version
                    else:
                        obs = fence.consistent(launch, sync=side)
                        moved, version = obs.changed, obs.version or 0
                    changed += moved
                    if not moved and not torch.equal(copy[: 4 * n].view(torch.int32), a if version % 2 else b):
                        torn_unseen += 1
            finally:
                stop.set()
                w.join()
            out[mode] = {"reads": reads, "writes": writes[0], "changed": changed, "torn_unseen": torn_unseen}
        # The cost of the fence itself: one read with nothing to read, best of 5 x 2000.
        bare = FenceReader(fence.control, fence.buffer_id, device=fence.device)
        for label, reader in (("with_lock", fence), ("seqlock_only", bare)):
            best = min(
                timed(device, lambda r=reader: [r.consistent(lambda: None) for _ in range(2000)])[1] for _ in range(5)
            )  # type: ignore[misc]
            out[f"fenced_read_us_{label}"] = best / 2000 * 1e6
        if isinstance(side, CpuStream):
            side.close()
        view.close()
    finally:
        store.destroy()
    out["ok"] = out["new"]["torn_unseen"] == 0 and out["new"]["writes"] > 0
    return out


def print_fence(res: dict[str, Any], device: torch.device) -> None:
    f = res["fence"]
    print(f"fence on {device} ({f['store_bytes'] / 1e9:.2f} GB store, a reader copying it on a side stream, racing "
          f"writes): old fence {f['old']['torn_unseen']} torn copies passed as consistent of {f['old']['reads']} "
          f"({f['old']['writes']} writes, {f['old']['changed']} seen changed); new fence {f['new']['torn_unseen']} "
          f"of {f['new']['reads']} ({f['new']['writes']} writes, {f['new']['changed']} seen changed); one fenced "
          f"read {f['fenced_read_us_with_lock']:.1f} us with the readers' lock, "
          f"{f['fenced_read_us_seqlock_only']:.1f} us seqlock only")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gb", type=float, default=2.0, help="model size in GB")
    ap.add_argument("--frac", type=float, default=0.005)
    ap.add_argument("--tensor-mb", type=int, default=128, help="size of each tensor (the last model tensor is whole)")
    ap.add_argument("--fence-gb", type=float, default=1.0, help="store size of the fence check (d)")
    ap.add_argument("--fence-only", action="store_true", help="run only the fence check (d)")
    ap.add_argument("--format2-mb", type=int, default=512, help="bf16 tensor size of the format-2 check (e); 0: skip")
    ap.add_argument("--format2-only", action="store_true", help="run only the format-2 check (e)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA not available, skipped")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": "CUDA not available"}))
        return 0
    res: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        res["device_name"] = torch.cuda.get_device_name(dev)
    if args.format2_only:
        res["format2"] = format2_check(dev, args.format2_mb)
        print_format2(res["format2"], dev)
        res["ok"] = res["format2"]["ok"]
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print("gpu_check.py:", "OK" if res["ok"] else "MISMATCH")
        return 0 if res["ok"] else 1
    res["fence"] = fence_check(dev, args.fence_gb)
    print_fence(res, dev)
    if args.fence_only:
        res["ok"] = res["fence"]["ok"]
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print("gpu_check.py:", "OK" if res["ok"] else "MISMATCH")
        return 0 if res["ok"] else 1
    base, target = synthetic(int(args.gb * 1e9), args.frac, dev, args.tensor_mb)
    res["model_bytes"], res["tensors"] = base.nbytes, len(base)
    print(f"model: {base.nbytes / 1e9:.2f} GB bf16 in {len(base)} tensors on {dev}, {args.frac:.2%} changed")

    # The device's own copy bandwidth is the yardstick (one read + one write of the model), as one
    # host memcpy is for the CPU goals: encode >= 0.5x memcpy, in-place apply < 0.1x memcpy.
    res["memcpy_device_s"] = device_copy_s(dev, base.data)

    # The floor of an in-place apply on this device, side by side (see scatter_floor).
    res["scatter_device_s"], res["gather_scatter_device_s"] = scatter_floor(dev, base, target)
    mem = res["memcpy_device_s"]
    sc, gs = res["scatter_device_s"], res["gather_scatter_device_s"]
    print(f"in-place floor on {dev}: scatter of the changed words {sc * 1e3:.2f} ms ({sc / mem:.2f}x memcpy), "
          f"gather+scatter {gs * 1e3:.2f} ms ({gs / mem:.2f}x memcpy)")  # fmt: skip

    # a) codec: device encode == host encode, device apply rebuilds the target
    encode_patch(ServedModel(base.specs[:1], base.data[:1]), ServedModel(target.specs[:1], target.data[:1]))  # warm
    runs = [timed(dev, lambda: encode_patch(base, target)) for _ in range(2)]
    enc_dev, res["encode_device_s"] = runs[0][0], min(r[1] for r in runs)
    hb, ht = to_host(base), to_host(target)
    enc_host, res["encode_host_s"] = timed(torch.device("cpu"), lambda: encode_patch(hb, ht))
    res["payload_bytes"] = len(enc_dev.payload)
    res["payload_identical"] = enc_dev.payload == enc_host.payload
    applied: list[tuple[ServedModel, float]] = []
    for _ in range(2):  # the first also warms the scatter kernels
        work = ServedModel(base.specs, [t.clone() for t in base.data])
        applied.append(timed(dev, lambda w=work: apply_patch(w, enc_dev.payload, base.specs)))  # type: ignore[misc]
    res["apply_device_s"] = min(a[1] for a in applied)
    res["apply_bitwise"] = all(a[0].bitwise_equal(target) for a in applied)
    res["memcpy_over_encode"] = mem / res["encode_device_s"]
    res["apply_over_memcpy"] = res["apply_device_s"] / mem
    print(
        f"codec: encode on {dev} {res['encode_device_s']:.3f} s, on host {res['encode_host_s']:.2f} s, "
        f"payload {res['payload_bytes'] / 1e6:.1f} MB identical={res['payload_identical']}; "
        f"apply (decode on the host + scatter) on {dev} {res['apply_device_s']:.3f} s "
        f"bitwise={res['apply_bitwise']}"
    )
    rw = 2 * base.nbytes / mem / 1e9
    print(f"codec ratios on {dev}: device memcpy {mem * 1e3:.2f} ms ({rw:.0f} GB/s read+write); "
          f"memcpy/encode {res['memcpy_over_encode']:.3f} (CPU goal >= 0.5), "
          f"apply/memcpy {res['apply_over_memcpy']:.2f} (CPU goal < 0.1)")  # fmt: skip

    # b) digests where the weights live
    device_digests(target.data[:1])  # warm-up (allocator, kernels)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    floor = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    on_dev, res["digest_device_s"] = timed(dev, lambda: device_digests(target.data))
    if dev.type == "cuda":
        res["digest_scratch_peak"] = torch.cuda.max_memory_allocated(dev) - floor
        res["digest_scratch_bound"] = scratch_bound(
            target.nbytes, len(target), default_batch(target.nbytes // 1024 + len(target), dev)
        )
        print(f"digest scratch on {dev}: peak {res['digest_scratch_peak'] / 2**20:.0f} MiB, "
              f"bound {res['digest_scratch_bound'] / 2**20:.0f} MiB")  # fmt: skip
    on_host, res["digest_host_copy_s"] = timed(dev, lambda: [bytes_digest(t) for t in target.data])
    res["digests_equal"] = on_dev == on_host
    res["digest_device_gb_s"] = target.nbytes / 1e9 / res["digest_device_s"]
    print(f"digest: on {dev} {res['digest_device_s']:.2f} s ({res['digest_device_gb_s']:.2f} GB/s), host copy + "
          f"blake3 {res['digest_host_copy_s']:.2f} s, equal={res['digests_equal']}")  # fmt: skip
    res["dense_host_copies"] = dense_host_copies(dev)
    print(f"dense encode on {dev}: host copies per tensor {res['dense_host_copies']}")
    ok = res["payload_identical"] and res["apply_bitwise"] and res["digests_equal"]
    ok = ok and res.get("digest_scratch_peak", 0) <= res.get("digest_scratch_bound", 0)
    ok = ok and all(v == 1.0 for v in res["dense_host_copies"].values()) and res["fence"]["ok"]
    if args.format2_mb > 0:
        res["format2"] = format2_check(dev, args.format2_mb)
        print_format2(res["format2"], dev)
        ok = ok and res["format2"]["ok"]
    res["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print("gpu_check.py:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sharded trainers: ranks add disjoint shards (from their own threads), finalize writes one version.

The codec's split into ``diff_tensor`` (per tensor, anywhere) and ``assemble`` (once, in layout
order) is what makes this possible: the payload is byte for byte the one ``encode_patch`` makes.
With the same key and clock, a sharded publisher leaves exactly the board an unsharded one does.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from patchswarm.daemon import publish_work
from patchswarm.daemon.board import Board
from patchswarm.daemon.fp8 import ALL_MATRICES
from patchswarm.daemon.publisher import Publisher, PublishInfo, ShardedPublish, ShardPart
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import chunk_rel
from patchswarm.protocol.codec import TensorDelta, assemble, diff_tensor, encode_patch
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import SigningKey, TrustedKeys
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.patch_format import Encoding
from patchswarm.protocol.served import ServedModel
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller
from tests.support.boards import board_files, board_patches, small_model
from tests.support.strategies import patch_cases

RUN = "sharded"
VERSIONS = 5


# ---------------------------------------------------------------- codec: diff_tensor + assemble


@settings(max_examples=200)
@given(patch_cases(max_numel=2000))
def test_assembled_deltas_are_byte_identical_to_encode_patch(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base, target, _ = case
    for level in (1, 3):
        # Deltas made out of order (as ranks would), assembled in layout order.
        order = list(range(len(target)))
        random.Random(len(order)).shuffle(order)
        made: dict[int, TensorDelta] = {
            i: diff_tensor(target.specs[i], base.data[i], target.data[i], level) for i in order
        }
        want = encode_patch(base, target, level=level)
        got = assemble([made[i] for i in range(len(target))], level)
        assert got.payload == want.payload and got.raw_size == want.raw_size and got.tensors == want.tensors
    anchor = assemble([diff_tensor(s, None, d) for s, d in target])
    assert anchor.payload == encode_patch(None, target).payload
    assert all(t.encoding == Encoding.FULL for t in anchor.tensors)


def test_assemble_and_diff_tensor_refuse_bad_input() -> None:
    m = ServedModel.from_tensors({"a": torch.zeros(4), "b": torch.ones(3)})
    da, db = (diff_tensor(s, None, d) for s, d in m)
    with pytest.raises(ValueError, match="layout order"):
        assemble([db, da])
    with pytest.raises(ValueError, match="layout order"):
        assemble([da, da])
    with pytest.raises(ValueError, match="flat uint8"):
        diff_tensor(m.specs[0], m.data[1], m.data[0])


# ---------------------------------------------------------------- sharded publisher


def train_states(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """FP32 state dicts after each of ``steps`` AdamW steps (normal lr first, then RL-like tiny lr)."""
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        loss = model(torch.randint(0, 200, (16, 8), generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            for group in opt.param_groups:
                group["lr"] = 1e-6
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def split(state: Mapping[str, torch.Tensor], ranks: int, shift: int = 0) -> list[dict[str, torch.Tensor]]:
    names = sorted(state)
    return [{n: state[n] for i, n in enumerate(names) if (i + shift) % ranks == r} for r in range(ranks)]


def add_concurrently(shard: ShardedPublish, shards: list[dict[str, torch.Tensor]]) -> list[ShardPart]:
    """Every rank adds its shard from its own thread, as ranks of a trainer would."""
    errors: list[BaseException] = []
    parts: dict[int, ShardPart] = {}

    def run(rank: int) -> None:
        try:
            parts[rank] = shard.add(rank, shards[rank], version=shard.version)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [parts[r] for r in range(len(shards))]


def publish_sharded_parts(
    pub: Publisher, state: Mapping[str, torch.Tensor], ranks: int = 2, shift: int = 0
) -> tuple[PublishInfo, list[ShardPart]]:
    with pub.begin_sharded(ranks) as shard:  # aborted if a rank fails
        parts = add_concurrently(shard, split(state, ranks, shift))
        return shard.finalize(), parts


def publish_sharded(pub: Publisher, state: Mapping[str, torch.Tensor], ranks: int = 2, shift: int = 0) -> PublishInfo:
    return publish_sharded_parts(pub, state, ranks, shift)[0]


def fixed_clock() -> Callable[[], float]:
    t0 = time.time()
    return lambda: t0


def pull(board: Board, key: SigningKey, held: Held | None = None) -> Held:
    return asyncio.run(Puller(DirSource(board.root), TrustedKeys(frozenset([key.key_id])), RUN).catch_up(held))


def file_bytes(board: Board) -> dict[str, bytes]:
    return {n: board.path(n).read_bytes() for n in board_files(board)}


def test_two_ranks_leave_exactly_the_board_of_one_publisher(tmp_path: Path) -> None:
    key = SigningKey.generate()
    clock = fixed_clock()
    kw = {"run_id": RUN, "anchor_every": 2, "keep_anchors": 2, "clock": clock}
    plain = Publisher(tmp_path / "plain", key, **kw)  # type: ignore[arg-type]
    sharded = Publisher(tmp_path / "sharded", key, **kw)  # type: ignore[arg-type]
    fmt = ServedFormat("bf16")
    served: dict[int, ServedModel] = {}
    for v, state in enumerate(train_states(VERSIONS), start=1):
        a = plain.publish(state)
        b, parts = publish_sharded_parts(sharded, state)
        assert isinstance(a, PublishInfo) and b.version == a.version == v
        assert (b.patch_bytes, b.anchor_bytes, b.changed_fraction, b.manifest_id) == (
            a.patch_bytes,
            a.anchor_bytes,
            a.changed_fraction,
            a.manifest_id,
        )
        assert set(b.stages) >= {"cast", "diff" if v > 1 else "anchor", "digests", "sign", "write"}
        served[v] = ServedModel.from_tensors(fmt.convert(state))
        if v >= 3:  # RL-like steps: what the ranks hand over is a few percent of their tensors
            assert 0 < b.changed_fraction < 0.02
            assert sum(p.delta_bytes for p in parts) < b.served_bytes / 10
            assert all(p.base_version == v - 1 for p in parts)
        # Same key, same clock: every file (chunks, manifests, head) is byte for byte the same.
        assert file_bytes(plain.board) == file_bytes(sharded.board)
    assert 0 < b.changed_fraction < 0.5 and b.patch_bytes < b.served_bytes / 4
    # Pull from nothing, and from each stale version the board still serves a path from.
    got = pull(sharded.board, key)
    assert got.version == VERSIONS and got.model.bitwise_equal(served[VERSIONS])
    for stale in range(1, VERSIONS):
        held = Held(stale, served[stale].clone(), served[stale].digests())
        got = pull(sharded.board, key, held)
        assert got.version == VERSIONS and got.model.bitwise_equal(served[VERSIONS]), stale


def test_payload_format_2_sharded_is_the_one_publisher_board_and_pulls_bitwise(tmp_path: Path) -> None:
    key = SigningKey.generate()
    kw = {"run_id": RUN, "anchor_every": 100, "clock": fixed_clock(), "payload_format": 2}
    plain = Publisher(tmp_path / "plain", key, **kw)  # type: ignore[arg-type]
    sharded = Publisher(tmp_path / "sharded", key, **kw)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(5)
    state = {k: v.clone() for k, v in small_model(5).state_dict().items()}
    for v in range(1, 4):  # small dense updates (docs/benchmarks.md: where base contexts pay)
        if v > 1:
            state = {k: t + torch.randn(t.shape, generator=g) * 1e-4 for k, t in state.items()}
        assert isinstance(plain.publish(state), PublishInfo)
        publish_sharded(sharded, state)
        assert file_bytes(plain.board) == file_bytes(sharded.board)
    patches = board_patches(sharded.board, RUN)
    assert sorted(patches) == [2, 3] and all(f == 2 and "SPARSE_CTX" in e for f, e in patches.values()), patches
    want = ServedModel.from_tensors(ServedFormat("bf16").convert(state))
    got = pull(sharded.board, key)
    assert got.version == 3 and got.model.bitwise_equal(want)


@pytest.mark.parametrize("bad", [0, 3, True, "2", 2.0])
def test_publisher_refuses_a_payload_format_it_cannot_write(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="payload_format must be"):
        Publisher(tmp_path, SigningKey.generate(), run_id=RUN, payload_format=bad)  # type: ignore[arg-type]
    assert not list(tmp_path.rglob("*"))


def test_tensors_moving_between_ranks_and_unsharded_versions_still_patch(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id=RUN, anchor_every=100)
    fmt = ServedFormat("bf16")
    states = train_states(6, seed=3)
    infos = [
        publish_sharded(pub, states[0]),  # 1: anchor
        publish_sharded(pub, states[1], shift=1),  # every tensor moved to the other rank
        publish_sharded(pub, states[2], ranks=3),  # three ranks now
    ]
    plain = pub.publish(states[3])  # an unsharded version in between
    assert isinstance(plain, PublishInfo)
    infos += [plain, publish_sharded(pub, states[4]), publish_sharded(pub, states[5])]
    assert [i.version for i in infos] == [1, 2, 3, 4, 5, 6]
    assert infos[0].anchor_bytes and all(i.anchor_bytes is None and i.patch_bytes > 0 for i in infos[1:])
    head_model = ServedModel.from_tensors(fmt.convert(states[5]))
    v3 = ServedModel.from_tensors(fmt.convert(states[2]))
    assert pull(pub.board, key).model.bitwise_equal(head_model)
    assert pull(pub.board, key, Held(3, v3, v3.digests())).model.bitwise_equal(head_model)
    # A new tensor changes the layout: that version is an anchor only.
    grown = dict(states[5])
    grown["zz.extra"] = torch.ones(7)
    info = publish_sharded(pub, grown)
    assert info.patch_bytes == 0 and info.anchor_bytes
    assert pull(pub.board, key).model.bitwise_equal(ServedModel.from_tensors(fmt.convert(grown)))


def test_resumed_publisher_patches_sharded_versions(tmp_path: Path) -> None:
    key = SigningKey.generate()
    states = train_states(3, seed=4)
    first = Publisher(tmp_path, key, run_id=RUN)
    first.publish(states[0])
    first.publish(states[1])
    again = Publisher(tmp_path, key, run_id=RUN)  # ranks hold nothing yet: their bases come from the board
    info = publish_sharded(again, states[2])
    assert info.version == 3 and info.anchor_bytes is None and info.patch_bytes > 0
    want = ServedModel.from_tensors(ServedFormat("bf16").convert(states[2]))
    assert pull(again.board, key).model.bitwise_equal(want)


def test_sharded_errors_are_clear_and_leave_nothing_behind(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id=RUN)
    states = train_states(3, seed=1)
    publish_sharded(pub, states[0])
    before = file_bytes(pub.board)
    halves = split(states[1], 2)

    shard = pub.begin_sharded(2)
    assert shard.version == 2 and not shard.anchor
    with pytest.raises(RuntimeError, match="sharded version 2 is already open"):
        pub.begin_sharded(2)
    with pytest.raises(RuntimeError, match="finalize or abort"):
        pub.publish(states[1])
    with pytest.raises(ValueError, match="adds to version 7, but this sharded publish is version 2"):
        shard.add(0, halves[0], version=7)
    with pytest.raises(ValueError, match="outside world size 2"):
        shard.add(2, halves[0])
    shard.add(0, halves[0])
    with pytest.raises(ValueError, match="rank 0 already added"):
        shard.add(0, halves[0])
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] have not added"):
        shard.finalize()
    assert file_bytes(pub.board) == before
    shard.add(1, halves[1])  # still open after the refusal: the missing rank can still come
    assert shard.finalize().version == 2
    with pytest.raises(RuntimeError, match="already finalized"):
        shard.add(1, halves[1])

    # The same tensor in two shards.
    dup = pub.begin_sharded(2)
    name = sorted(states[2])[0]
    dup.add(0, halves[0] | {name: states[2][name]})
    dup.add(1, {**split(states[2], 2)[1], name: states[2][name]})
    with pytest.raises(ValueError, match=f"tensor '{name}' is in the shards of ranks 0 and 1"):
        dup.finalize()
    dup.abort()
    assert pub.version == 2  # the version number was given back
    with pytest.raises(RuntimeError, match="already aborted"):
        dup.finalize()

    # A handle used as a context manager aborts when the block fails.
    with pytest.raises(KeyError), pub.begin_sharded(1) as s:
        s.add(0, states[2])
        raise KeyError("training step failed")
    assert pub.version == 2
    info = publish_sharded(pub, states[2])
    assert info.version == 3 and info.patch_bytes > 0
    with pytest.raises(ValueError, match="world_size"):
        pub.begin_sharded(0)


# ---------------------------------------------------------------- the publisher's own buffers


def test_weights_already_in_the_served_dtype_updated_in_place(tmp_path: Path) -> None:
    """bf16 master weights updated in place: each version is a copy, not a view of the live weights."""
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id=RUN)
    w = {"w": torch.randn(64, 64).to(torch.bfloat16), "step": torch.zeros((), dtype=torch.int64)}
    want: list[ServedModel] = []
    for _ in range(4):
        info = pub.publish(w)
        assert isinstance(info, PublishInfo)
        want.append(ServedModel.from_tensors({k: v.clone() for k, v in w.items()}))
        if info.version > 1:
            assert info.changed_fraction > 0.5
        w["w"].mul_(1.5)
        w["step"] += 1
    assert pull(pub.board, key).model.bitwise_equal(want[-1])


def test_background_mode_with_recycled_buffers(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id=RUN, background=True, queue_size=4, anchor_every=4)
    states = train_states(7, seed=2)
    futures = [pub.publish(s) for s in states[:4]]
    pub.flush()
    futures += [pub.publish(s) for s in states[4:]]
    infos = [f.result(timeout=60) for f in futures if isinstance(f, Future)]
    assert [i.version for i in infos] == list(range(1, 8))
    # A sharded version after background ones: the queue is flushed first.
    info = publish_sharded(pub, states[6])
    assert info.version == 8 and info.changed_fraction == 0.0
    pub.close()
    fmt = ServedFormat("bf16")
    want = ServedModel.from_tensors(fmt.convert(states[6]))
    assert pull(pub.board, key).model.bitwise_equal(want)
    v5 = ServedModel.from_tensors(fmt.convert(states[4]))
    assert pull(pub.board, key, Held(5, v5, v5.digests())).model.bitwise_equal(want)
    head = pub.board.manifest(info.manifest_id)
    assert head.kind == Kind.PATCH and head.base_version == 7


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "as_is", "fp8_e4m3"])
def test_blockwise_cast_scan_hash_matches_whole_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Tiny blocks: changes only in a late block, only in the first, nowhere, odd tails, every dtype."""
    monkeypatch.setattr(publish_work, "BLOCK_BYTES", 64)
    key = SigningKey.generate()
    # fp8 over names that are not checkpoint names: every floating matrix is selected.
    served = ServedFormat(fmt, quantize=ALL_MATRICES)
    pub = Publisher(tmp_path / "blocks", key, run_id=RUN, served_format=served, anchor_every=100)
    g = torch.Generator().manual_seed(7)
    state = {
        "a.late": torch.randn(40, 33, generator=g),
        "b.first": torch.randn(1001, generator=g),
        "c.same": torch.randn(300, generator=g),
        "d.ints": torch.randint(-100, 100, (77,), generator=g),
        "e.scalar": torch.tensor(3.5),
        "f.empty": torch.zeros(0, 4),
        "g.strided": torch.randn(16, 48, generator=g).t(),
        "h.f64": torch.randn(13, dtype=torch.float64, generator=g),
    }
    want: list[ServedModel] = []
    reference = ServedFormat(fmt, quantize=ALL_MATRICES)
    for step in range(4):
        if step:
            state["a.late"].view(-1)[-3:] += 0.5 * step
            state["b.first"][:2] -= 0.25
            state["d.ints"][70] += 1
            state["e.scalar"] += 1
            state["g.strided"][5, 3] += 1.0
            state["h.f64"][12] *= 2
        info = pub.publish(state)
        assert isinstance(info, PublishInfo)
        want.append(ServedModel.from_tensors(reference.convert(state)))
        m = pub.board.manifest(info.manifest_id)
        assert list(m.digests) == want[-1].digests()
        if step:
            assert info.patch_bytes > 0 and 0 < info.changed_fraction < 0.2
            # Byte for byte the payload encode_patch makes from whole tensors.
            payload = b"".join(pub.board.path(chunk_rel(c.hash)).read_bytes() for c in m.chunks)
            assert payload == encode_patch(want[-2], want[-1]).payload
    got = pull(pub.board, key)
    assert got.version == 4 and got.model.bitwise_equal(want[-1])
    held = Held(2, want[1].clone(), want[1].digests())
    assert pull(pub.board, key, held).model.bitwise_equal(want[-1])


def test_a_failed_publish_leaves_the_chain_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = SigningKey.generate()
    pub = Publisher(tmp_path, key, run_id=RUN)
    states = train_states(3, seed=6)
    pub.publish(states[0])
    before = file_bytes(pub.board)
    real = publish_work.diff_tensor

    def failing(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        if spec.name.startswith("3."):
            raise MemoryError("injected")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(publish_work, "diff_tensor", failing)
    with pytest.raises(MemoryError, match="injected"):
        pub.publish(states[1])
    with pytest.raises(MemoryError, match="injected"):
        publish_sharded(pub, states[1])
    assert file_bytes(pub.board) == before
    monkeypatch.setattr(publish_work, "diff_tensor", real)
    info = pub.publish(states[2])  # version numbers are never reused; the patch is against version 1
    assert isinstance(info, PublishInfo) and info.version == 3 and info.patch_bytes > 0
    assert pub.board.manifest(info.manifest_id).base_version == 1
    want = ServedModel.from_tensors(ServedFormat("bf16").convert(states[2]))
    assert pull(pub.board, key).model.bitwise_equal(want)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
@pytest.mark.parametrize("on_host", [True, False], ids=["served-on-host", "served-on-gpu"])
def test_master_weights_on_the_gpu_publish_the_board_of_cpu_ones(tmp_path: Path, on_host: bool) -> None:
    """A trainer whose FP32 masters live on the GPU casts there; the served copy goes to pinned host
    buffers (the default) or stays on the GPU and is diffed there.  bf16 casts round the same
    everywhere, so with the same key and clock every file on the board is byte for byte the one a
    CPU publisher writes, sharded or not."""
    key = SigningKey.generate()
    clock = fixed_clock()
    kw = {"run_id": RUN, "anchor_every": 3, "keep_anchors": 2, "clock": clock}
    host = Publisher(tmp_path / "host", key, **kw)  # type: ignore[arg-type]
    gpu = Publisher(tmp_path / "gpu", key, **kw)  # type: ignore[arg-type]
    gpu_sharded = Publisher(tmp_path / "gpu-sharded", key, **kw)  # type: ignore[arg-type]
    gpu.served_on_host = gpu_sharded.served_on_host = on_host
    fmt = ServedFormat("bf16")
    for v, state in enumerate(train_states(VERSIONS), start=1):
        on_gpu = {k: t.to("cuda") for k, t in state.items()}
        a, b = host.publish(state), gpu.publish(on_gpu)
        c = publish_sharded(gpu_sharded, on_gpu)
        assert isinstance(a, PublishInfo) and isinstance(b, PublishInfo)
        assert (b.version, b.manifest_id, b.changed_fraction) == (v, a.manifest_id, a.changed_fraction)
        assert c.manifest_id == a.manifest_id
        assert file_bytes(gpu.board) == file_bytes(host.board) == file_bytes(gpu_sharded.board)
        assert gpu._prev is not None and all(t.is_cuda != on_host for t in gpu._prev.data)
        assert all(t.is_pinned() for t in gpu._prev.data) == on_host
    got = pull(gpu.board, key)
    assert got.version == VERSIONS and got.model.bitwise_equal(ServedModel.from_tensors(fmt.convert(state)))


@CUDA
def test_fp8_master_weights_on_the_gpu_publish_what_they_serve(tmp_path: Path) -> None:
    """fp8 e4m3 with fixed block scales computed on the GPU: every version pulled from the board is
    bitwise the GPU's own conversion (scales included), from nothing and from the version before."""
    key = SigningKey.generate()
    fmt = ServedFormat("fp8_e4m3", block=16, quantize=ALL_MATRICES)
    pub = Publisher(tmp_path, key, run_id=RUN, anchor_every=100, served_format=fmt)
    ref = ServedFormat("fp8_e4m3", block=16, quantize=ALL_MATRICES)
    held: Held | None = None
    for v, state in enumerate(train_states(VERSIONS, seed=5), start=1):
        on_gpu = {k: t.to("cuda") for k, t in state.items()}
        info = pub.publish(on_gpu)
        assert isinstance(info, PublishInfo) and info.version == v
        want = ServedModel.from_tensors({k: t.cpu() for k, t in ref.convert(on_gpu).items()})
        assert pull(pub.board, key).model.bitwise_equal(want)
        got = pull(pub.board, key, held)
        assert got.version == v and got.model.bitwise_equal(want)
        held = Held(v, want.clone(), want.digests())

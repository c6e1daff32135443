"""Rank stores in one process: N stores fed from one canonical model through a layout plan.

Each rank's bytes are compared with the slice of the version computed independently (torch.chunk /
cat, tests/support/rank_plans.py); crashes are exceptions raised at each named point (the real
kill -9 runs are tests/unit/daemon/test_rank_crash.py and tests/system/test_daemon_ranks.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.engine import attach
from patchswarm.daemon.engine_driver import Activation, Region
from patchswarm.daemon.fence_lock import ReadersStalled
from patchswarm.daemon.journal import journal_path, read_journal, read_journals
from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.rank_plans import PlanRefused, read_plan_file, resolve_plan
from patchswarm.daemon.rank_rollout import activate_ranks
from patchswarm.daemon.rank_stores import RankStores, rank_store_names
from patchswarm.daemon.shadow import StagedVersion, decode_once
from patchswarm.daemon.status import Status
from patchswarm.daemon.store_format import StoreError, StoreLayout, StoreLayoutMismatch, StoreState
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.held import Held
from patchswarm.protocol.layout_flat import RankChanges
from patchswarm.protocol.layout_plan import rank_model
from patchswarm.protocol.patchfile import build_version
from patchswarm.protocol.served import ServedModel, TensorSpec, raw_bytes
from tests.support.rank_plans import (
    FUSED,
    ONE_WIDTH,
    SPECS,
    expected_rank,
    llama_rank,
    llama_state,
    split_plan,
    version_model,
)
from tests.support.store_worker import remove_segments, unique_name

SEED = 5


class Crash(BaseException):  # (a kill: nothing in the stores catches it)
    pass


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("rk")
    yield n
    remove_segments(n)


def make(name: str, world: int, tmp: Path, **kw: object) -> RankStores:
    jd = tmp / "journal"
    jd.mkdir(exist_ok=True)
    return RankStores(name, world, jd, engine_kind=False, **kw)  # type: ignore[arg-type]


def assert_ranks_hold(rs: RankStores, world: int, version: int, specs: list[TensorSpec] = SPECS) -> None:
    """Every rank's header names ``version`` and its bytes are that version's slice, bit for bit."""
    m = version_model(SEED, version, specs)
    for r in range(world):
        store = rs.store(r)
        assert store is not None
        h = store.header()
        assert (h.version, h.state, h.stable) == (version, StoreState.READY, True), f"rank {r}"
        want = expected_rank(m, world, r)
        assert [s.name for s in store.layout.specs] == sorted(want)
        for i, s in enumerate(store.layout.specs):
            assert torch.equal(store.slot_bytes(i), raw_bytes(want[s.name])), f"rank {r} {s.name} v{version}"
        assert store.root() == h.root  # the per-rank root, computed where the weights live


def apply(rs: RankStores, version: int, specs: list[TensorSpec] = SPECS) -> None:
    new = version_model(SEED, version, specs)
    updates = None if version == 1 else diff_updates(version_model(SEED, version - 1, specs), new)
    rs.apply(version, new, updates)


@pytest.mark.parametrize("specs", [SPECS, ONE_WIDTH], ids=["per-parameter", "one-pass"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_holds_its_slice_after_every_version(
    name: str, tmp_path: Path, world: int, specs: list[TensorSpec]
) -> None:
    rs = make(name, world, tmp_path)
    rs.prepare(split_plan(specs, world), specs)
    assert (rs.flat is not None) == (specs is ONE_WIDTH)  # (the routing this case means to test)
    assert [s.segment.name for s in rs.stores if s is not None] == rank_store_names(name, world)
    for v in range(1, 5):
        apply(rs, v, specs)
        assert_ranks_hold(rs, world, v, specs)
        assert rs.common_version() == v
        assert not journal_path(rs.journal_dir).exists()
    entries = rs.entries()
    assert [(e["rank"], e["version"], e["state"]) for e in entries] == [(r, 4, "ready") for r in range(world)]
    assert [bytes.fromhex(e["root"]) for e in entries] == rs.rank_roots()
    rs.close()


def test_names_keep_the_single_store_name_for_one_rank() -> None:
    assert rank_store_names("s", 1) == ["s"]
    assert rank_store_names("s", 3) == ["s.r0", "s.r1", "s.r2"]


CRASH_POINTS = [
    "journal_tmp", "journaled", "rank0:odd", "rank0:mid_write", "rank0:written", "rank0:flipped",
    "between_ranks", "rank1:odd", "rank1:mid_write", "rank1:written", "rank1:flipped", "all_flipped",
]  # fmt: skip


def raise_at(point: str) -> Callable[[str], None]:
    def fault(at: str) -> None:
        if at == point:
            raise Crash(at)

    return fault


@pytest.mark.parametrize("specs", [SPECS, ONE_WIDTH], ids=["per-parameter", "one-pass"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_any_point_leaves_every_rank_at_one_version(
    name: str, tmp_path: Path, point: str, specs: list[TensorSpec]
) -> None:
    world = 2
    rs = make(name, world, tmp_path)
    rs.prepare(split_plan(specs, world), specs)
    apply(rs, 1, specs)
    apply(rs, 2, specs)
    rs.fault = raise_at(point)
    with pytest.raises(Crash):
        apply(rs, 3, specs)
    if point not in ("journal_tmp",):
        assert len(read_journals(rs.journal_dir) or []) == world  # one journal for every rank
    # A restarted daemon: re-open the stores, recover from the journal.
    again = make(name, world, tmp_path)
    again.open_existing()
    version = again.recover()
    expect = 2 if point == "journal_tmp" else 3  # a complete journal is rolled forward on every rank
    assert version == expect
    assert_ranks_hold(again, world, expect, specs)
    assert not journal_path(rs.journal_dir).exists()
    rs.close()
    again.close()


def test_a_rank_journal_is_not_one_stores_journal(name: str, tmp_path: Path) -> None:
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(SPECS, 2), SPECS)
    apply(rs, 1)
    rs.fault = raise_at("journaled")
    with pytest.raises(Crash):
        apply(rs, 2)
    with pytest.raises(StoreLayoutMismatch, match="covers 2 rank stores"):
        read_journal(rs.journal_dir)
    rs.close()


def test_bad_plans_are_refused_before_anything_is_written(name: str, tmp_path: Path) -> None:
    rs = make(name, 2, tmp_path)
    with pytest.raises(PlanRefused, match=r"store\.plan: .*down\.weight"):
        rs.prepare(split_plan(SPECS, 2, leave_out="down.weight"), SPECS)  # a canonical tensor unmapped
    with pytest.raises(PlanRefused, match=r"for 4 ranks, store\.ranks is 2"):
        rs.prepare(split_plan(SPECS, 4), SPECS)
    odd = [*SPECS[:4], TensorSpec("up.weight", "F16", (127, 16))]
    with pytest.raises(PlanRefused):  # 127 rows do not split in two
        rs.prepare(split_plan(odd, 2), odd)
    assert not any(Path("/dev/shm").glob(f"{name}*")), "a refused plan created a store"
    assert rs.stores == [None, None]


def test_a_rank_store_of_another_plan_is_recreated(name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Rank 1's segment left by a run with a world of 4 (another size and layout).
    stale = WeightStore.create(f"{name}.r1", StoreLayout.from_specs(split_plan(SPECS, 4).rank_specs(1)))
    stale.close()
    rs = make(name, 2, tmp_path)
    rs.open_existing()
    assert rs.stores[1] is not None and rs.stores[0] is None
    assert rs.recover() is None  # rank 0 missing: nothing to serve yet
    with caplog.at_level(logging.WARNING, logger="patchswarm.store"):
        rs.prepare(split_plan(SPECS, 2), SPECS)
    assert any(f"{name}.r1 (rank 1) was laid out for another plan or world size" in r.message for r in caplog.records)
    apply(rs, 1)
    assert_ranks_hold(rs, 2, 1)
    rs.close()


def test_an_engine_rank_store_of_another_plan_is_refused(name: str, tmp_path: Path) -> None:
    stale = WeightStore.create(
        f"{name}.r0", StoreLayout.from_specs(split_plan(SPECS, 4).rank_specs(0)), engine_buffer=True
    )
    stale.close()
    rs = RankStores(name, 2, tmp_path, engine_kind=True)
    rs.open_existing()
    with pytest.raises(StoreError, match=r"rank 0\) is laid out for another plan or world size"):
        rs.prepare(split_plan(SPECS, 2), SPECS)
    assert rs.stores[1] is None  # nothing created


def test_a_rank_store_larger_than_store_size_is_refused(name: str, tmp_path: Path) -> None:
    rs = make(name, 2, tmp_path, capacity=1000)
    with pytest.raises(StoreError, match="needs"):
        rs.prepare(split_plan(SPECS, 2), SPECS)
    assert rs.stores == [None, None]


def test_a_rank_that_verifies_wrong_rolls_every_rank_back(name: str, tmp_path: Path) -> None:
    """A rank whose written values do not read back: every rank ends at the old version."""
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(SPECS, 2), SPECS)
    apply(rs, 1)
    bad = rs.stores[1]
    assert bad is not None
    real = bad.write_values
    bad.write_values = lambda staged, *, new=True: real(staged, new=new) and not new  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        apply(rs, 2)
    bad.write_values = real  # type: ignore[method-assign]
    assert rs.common_version() == 1
    assert_ranks_hold(rs, 2, 1)
    rs.close()


def test_a_reloaded_rank_joins_the_others(name: str, tmp_path: Path) -> None:
    """A rank that lost its contents (FAILED) is loaded whole while the others take the update in place."""
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(SPECS, 2), SPECS)
    apply(rs, 1)
    failed = rs.stores[0]
    assert failed is not None
    failed.mark_failed()
    assert rs.common_version() is None
    apply(rs, 2)
    assert_ranks_hold(rs, 2, 2)
    rs.close()


def _child_activates(name: str, world: int, journal_dir: Path, version: int, point: str) -> None:
    """In a forked child: the daemon's rank stores activating ``version``, SIGKILLed at ``point``."""
    try:
        rs = RankStores(name, world, journal_dir, engine_kind=False)
        rs.open_existing()
        rs.prepare(split_plan(SPECS, world), SPECS)
        rs.roots = [s.header().root if s is not None else None for s in rs.stores]  # (as after apply)
        rs.arm_faults(point)
        apply(rs, version)
    finally:
        os._exit(3)  # reached only if the point was not: the parent sees exit status 3


@pytest.mark.parametrize("world", [2, 4])
def test_sigkill_at_each_point_twice_leaves_every_rank_at_one_version(name: str, tmp_path: Path, world: int) -> None:
    rs = make(name, world, tmp_path)
    rs.prepare(split_plan(SPECS, world), SPECS)
    apply(rs, 1)
    rs.close()
    points = [p.replace("rank1", f"rank{world - 1}") for p in CRASH_POINTS] * 2
    version = 1
    for point in points:
        pid = os.fork()
        if pid == 0:
            _child_activates(name, world, tmp_path / "journal", version + 1, point)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, status)
        again = make(name, world, tmp_path)
        again.open_existing()
        got = again.recover()
        assert got == (version if point == "journal_tmp" else version + 1), point
        assert_ranks_hold(again, world, got)
        again.close()
        version = got


def test_an_error_between_ranks_is_recovered_at_once(name: str, tmp_path: Path) -> None:
    """Any error inside the fences (not only a failed read-back) is finished from the journal at once:
    the daemon keeps running with every rank at one version and no fence left odd."""
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(SPECS, 2), SPECS)
    apply(rs, 1)

    def fail(point: str) -> None:
        if point == "rank1:odd":
            raise RuntimeError("device error")

    rs.fault = fail
    with pytest.raises(RuntimeError):
        apply(rs, 2)
    assert not journal_path(rs.journal_dir).exists()
    assert rs.common_version() == 2  # the journal was complete: rolled forward on every rank
    assert_ranks_hold(rs, 2, 2)
    rs.close()


def llama_plan_file(tmp: Path) -> Path:
    """The tiny Llama (tests/support/rank_plans.py) as a plan file (docs/models.md's format)."""
    qkv = [f"model.layers.{{L}}.self_attn.{x}_proj.weight" for x in "qkv"]
    gate_up = [f"model.layers.{{L}}.mlp.{x}_proj.weight" for x in ("gate", "up")]
    rules: list[dict[str, object]] = [
        {"match": "model.embed_tokens.weight", "rule": "vocab"},
        {"match": "lm_head.weight", "rule": "vocab"},
        *[
            {"match": src, "rule": "fuse", "into": "model.layers.{L}.self_attn.qkv_proj.weight", "dim": 0,
             "heads": [4, 2, 2], "order": qkv}
            for src in qkv
        ],
        *[
            {"match": src, "rule": "fuse", "into": "model.layers.{L}.mlp.gate_up_proj.weight", "dim": 0,
             "order": gate_up}
            for src in gate_up
        ],
        {"match": "model.layers.{L}.self_attn.o_proj.weight", "rule": "split", "dim": 1},
        {"match": "model.layers.{L}.mlp.down_proj.weight", "rule": "split", "dim": 1},
        {"match": "model.layers.{L}.input_layernorm.weight", "rule": "replicate"},
        {"match": "model.layers.{L}.post_attention_layernorm.weight", "rule": "replicate"},
        {"match": "model.norm.weight", "rule": "replicate"},
    ]  # fmt: skip
    path = tmp / "llama.plan.json"
    path.write_text(json.dumps({"format": "patchswarm-layout-plan", "version": 1, "rules": rules}))
    return path


@pytest.mark.parametrize("tp", [2, 4])
def test_a_plan_file_gives_the_engines_slices(tmp_path: Path, tp: int) -> None:
    state, _ = llama_state(1)
    model = ServedModel.from_tensors({k: v.to(torch.bfloat16) for k, v in state.items()})
    path = str(llama_plan_file(tmp_path))
    plan = resolve_plan(path, tp, model.specs, {}, read_plan_file(path))
    typed = {s.name: model.typed(i) for i, s in enumerate(model.specs)}
    for r in range(tp):
        got = rank_model(plan, model, r)
        want = llama_rank(typed, tp, r)
        assert [s.name for s in got.specs] == sorted(want)
        assert all(torch.equal(got.data[i], raw_bytes(want[s.name])) for i, s in enumerate(got.specs))


def test_bad_plan_files_are_refused_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "patchswarm-layout-plan", "version": 1, "rules": [{"match": "x", "rule": "split"}]}')
    with pytest.raises(PlanRefused, match=r"^store\.plan: .*bad\.json: plan file: ") as e:
        read_plan_file(str(bad))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanRefused, match="cannot read the plan file"):
        read_plan_file(str(tmp_path / "missing.json"))
    # Parses, but leaves a tensor of the model unmapped: refused when the model is known.
    state, _ = llama_state(1)
    model = ServedModel.from_tensors({k: v.to(torch.bfloat16) for k, v in state.items()})
    path = llama_plan_file(tmp_path)
    doc = json.loads(path.read_text())
    doc["rules"] = [r for r in doc["rules"] if r["match"] != "model.norm.weight"]
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanRefused, match=r"model\.norm\.weight"):
        resolve_plan(str(path), 2, model.specs, {}, read_plan_file(str(path)))


def _llama_versions(n: int) -> list[ServedModel]:
    """The tiny Llama in bf16 and ``n - 1`` successors: a few words moved in every tensor, and in
    version 3 one tensor rewritten whole (a dense change)."""
    state, _ = llama_state(2)
    base = ServedModel.from_tensors({k: v.to(torch.bfloat16) for k, v in state.items()})
    out = [base]
    g = torch.Generator().manual_seed(7)
    for v in range(1, n):
        m = out[-1].clone()
        for i, spec in enumerate(m.specs):
            w = m.data[i].view(torch.int16)
            if v == 3 and spec.name.endswith("layers.1.mlp.down_proj.weight"):
                w.copy_(torch.randint(-(1 << 14), 1 << 14, w.shape, dtype=torch.int16, generator=g))
                continue
            pos = torch.randint(0, w.numel(), (max(1, w.numel() // 200),), generator=g)
            w[pos] += 1
        out.append(m)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_roots_kept_per_parameter_equal_roots_computed_from_scratch(name: str, tmp_path: Path, tp: int) -> None:
    """Each rank's root is updated from the parameters a version's changes reach; after several
    versions (sparse and dense changes, kv heads replicated at TP=4, vocabulary padding) it equals the
    root of the rank built whole from the canonical model and the root hashed from the store."""
    from patchswarm.protocol.layout_builtin import builtin_plan

    _, config = llama_state(2)
    versions = _llama_versions(5)
    plan = builtin_plan(json.loads(config), versions[0].specs, tp)
    rs = make(name, tp, tmp_path)
    rs.prepare(plan, versions[0].specs)
    for v, model in enumerate(versions, start=1):
        updates = None if v == 1 else diff_updates(versions[v - 2], model)
        rs.apply(v, model, updates)
        for k in range(tp):
            store = rs.store(k)
            assert store is not None
            scratch = rank_model(plan, model, k).root()
            assert rs.roots[k] == scratch == store.root() == store.header().root, f"rank {k} v{v}"
        assert updates is None or any(u.positions is None for u in updates) == (v == 4)
    rs.close()


class _CopyEngine:
    copies = True  # (an engine that copies: the daemon builds the regions it takes)


class _Host:
    """What ``activate_ranks`` uses of the rollout daemon (daemon/rank_rollout.py ``RankHost``)."""

    def __init__(self, tmp: Path) -> None:
        self.cfg = {"store.plan": "none", "sidecar.commit_mode": "quiesce"}
        self.status = Status("node", "run")
        self.metrics = DaemonMetrics()
        self.gate = None
        self.served: int | None = None
        self.driver = _CopyEngine()
        self.committed: list[Activation] = []  # what the engine was asked to take
        self.shadow: Held | None = None
        self.journal_dir = tmp / "journal"
        self.rank_devices: list[str | None] = []
        self._activating = asyncio.Lock()
        self._loading = None

    async def _drain_sidecar(self, mode: str, version: int) -> None:
        raise AssertionError("no sidecar here")

    async def _load_registered(self) -> None:
        raise AssertionError("no engine buffers here")

    async def _engine_pause(self) -> None:
        raise AssertionError("no engine here")

    async def _engine_resume(self) -> None:
        raise AssertionError("no engine here")

    async def _end_activation(self, ack: int | None, *, attempted: bool, paused: bool) -> None:
        assert self.gate is None and not paused  # (no sidecar, no pause here)

    def _activation(self, version: int, *, full: bool, regions: object = None) -> Activation:
        return Activation(version, self.served, full, {} if full else dict(regions or {}))  # type: ignore[call-overload]

    async def _engine_commit(self, activation: Activation) -> int | None:
        self.committed.append(activation)
        self.served = activation.version
        return activation.version


async def _inline(fn: Callable[..., object], *args: object) -> object:
    return fn(*args)


@pytest.mark.asyncio
async def test_a_patch_decoded_once_reaches_every_rank_and_a_failed_activation_leaves_the_copy_as_it_was(
    name: str, tmp_path: Path
) -> None:
    """The daemon's canonical copy takes a staged version's changes before the ranks are written (their
    digests need the new model) and gives them back when the activation fails: no second copy."""
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(SPECS, 2), SPECS)
    host = _Host(tmp_path)
    v1, v2 = version_model(SEED, 1), version_model(SEED, 2)
    held = Held(1, v1.clone(), v1.digests())
    assert await activate_ranks(host, rs, held, _inline)  # type: ignore[arg-type]
    host.shadow = held
    patch = build_version(v1, v2, run_id="r", version=2, base_version=1, now_ms=0)
    staged = decode_once(held, patch.manifest, [bytes(patch.payload)])
    assert isinstance(staged, StagedVersion) and staged.model is held.model

    def refuse(*_: object, **__: object) -> None:
        assert held.model.bitwise_equal(v2)  # (the changes are in the copy while the ranks are written)
        raise StoreError("injected: the ranks refuse")

    rs.finish_apply = refuse  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreError, match="injected"):
        await activate_ranks(host, rs, staged, _inline)  # type: ignore[arg-type]
    assert held.model.bitwise_equal(v1) and staged.changes
    assert_ranks_hold(rs, 2, 1)
    assert not journal_path(rs.journal_dir).exists()  # (prepared before the write, abandoned: removed)
    del rs.finish_apply  # (the class's own again)
    before = [_rank_store(rs, k).read_model() for k in range(2)]
    assert await activate_ranks(host, rs, staged, _inline)  # type: ignore[arg-type]
    assert_ranks_hold(rs, 2, 2)
    assert held.model.bitwise_equal(v2) and staged.changes == []
    # The engine was asked to take version 1 whole, then version 2 as the byte ranges that changed.
    assert [(a.version, a.previous, a.full) for a in host.committed] == [(1, None, True), (2, 1, False)]
    for k in range(2):
        _assert_covered(before[k], _rank_store(rs, k).read_model(), host.committed[1].regions[k])


def _rank_store(rs: RankStores, k: int) -> WeightStore:
    store = rs.store(k)
    assert store is not None
    return store


def _assert_covered(before: ServedModel, after: ServedModel, regions: tuple[Region, ...]) -> None:
    """Every byte that differs between two versions of a store lies in one of ``regions``."""
    for i, spec in enumerate(after.specs):
        a = before.typed(i).contiguous().reshape(-1).view(torch.uint8)
        b = after.typed(i).contiguous().reshape(-1).view(torch.uint8)
        covered = torch.zeros(spec.nbytes, dtype=torch.bool)
        for r in regions:
            if r.name == spec.name:
                covered[r.start : r.end] = True
        assert bool(covered[a != b].all()), f"{spec.name}: a changed byte outside the regions"


def test_a_routed_run_reaching_past_its_parameter_is_refused_before_anything_is_written(
    name: str, tmp_path: Path
) -> None:
    # Routing in one pass hands each rank its changes as word indices into the whole store: a change
    # labelled for one parameter must not land in the next one (the store's bound alone allows it;
    # the journal, per slot, would then hold a position its replay refuses).
    rs = make(name, 1, tmp_path)
    rs.prepare(split_plan(ONE_WIDTH, 1), ONE_WIDTH)
    assert rs.flat is not None
    apply(rs, 1, ONE_WIDTH)
    store = rs.store(0)
    assert store is not None
    before = [store.slot_bytes(i).clone() for i in range(len(store))]
    old = store.slot_words(1)[:1].clone()
    for slot, at in ((0, rs.bases[0][1]), (1, rs.bases[0][1] - 1)):  # (past slot 0's end; before slot 1's start)
        run = RankChanges([slot], [1], torch.tensor([at]), old + 1, old)
        with pytest.raises(ValueError, match="outside its parameter"):
            rs._stage([0], 2, rs.rank_roots(), [run])  # (refused while staging, before the journal)
        assert all(torch.equal(store.slot_bytes(i), b) for i, b in enumerate(before))
        assert store.header().version == 1 and not journal_path(rs.journal_dir).exists()
    rs.close()


def test_a_version_without_changes_activates_on_rank_stores_of_four_byte_words(name: str, tmp_path: Path) -> None:
    # (the one-pass routing gave the ranks of an empty version empty bf16 words, which a store of
    # F32 words refused: the activation failed)
    specs = sorted(
        [
            TensorSpec(FUSED[0], "F32", (64, 32)),
            TensorSpec(FUSED[1], "F32", (32, 32)),
            TensorSpec("c.bias", "F32", (64,)),
        ],
        key=lambda s: s.name,
    )
    rs = make(name, 2, tmp_path)
    rs.prepare(split_plan(specs, 2), specs)
    assert rs.flat is not None
    apply(rs, 1, specs)
    rs.apply(2, version_model(SEED, 1, specs), [])
    assert rs.common_version() == 2 and not journal_path(rs.journal_dir).exists()
    want = version_model(SEED, 1, specs)
    for r in range(2):
        store = rs.store(r)
        assert store is not None and store.root() == store.header().root
        exp = expected_rank(want, 2, r)
        assert all(torch.equal(store.slot_bytes(i), raw_bytes(exp[s.name])) for i, s in enumerate(store.layout.specs))
    rs.close()


def test_a_stalled_reader_of_one_rank_stops_the_activation_before_any_rank_is_written(
    name: str, tmp_path: Path
) -> None:
    """Every rank's readers are waited for before any rank's fence moves: a reader of rank 1 that
    never finishes leaves rank 0 unwritten too (never one rank ahead), and the retry goes through."""
    world = 2
    rs = make(name, world, tmp_path)
    rs.prepare(split_plan(SPECS, world), SPECS)
    apply(rs, 1)
    stores = [rs.store(r) for r in range(world)]
    assert stores[0] is not None and stores[1] is not None
    view = attach(stores[1].attach_info())
    inside, release = threading.Event(), threading.Event()
    reader = threading.Thread(target=lambda: view.fence.consistent(lambda: (inside.set(), release.wait(30))))
    reader.start()
    assert inside.wait(30)
    for s in stores:
        s.gate.wait_s = 0.05
    seqs = [s.control.seq() for s in stores]
    with pytest.raises(ReadersStalled):
        apply(rs, 2)
    assert [s.control.seq() for s in stores] == seqs and not journal_path(rs.journal_dir).exists()
    assert_ranks_hold(rs, world, 1)
    release.set()
    reader.join(30)
    apply(rs, 2)
    assert_ranks_hold(rs, world, 2)
    view.close()
    rs.close()

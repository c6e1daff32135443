"""Sharded trainers across processes: two gloo ranks publish together (DistPublisher).

Each test spawns two real trainer processes (torch.distributed, gloo, a FileStore rendezvous);
rank 0 holds the Publisher.  The result must be byte for byte the board a one-process Publisher
leaves from the same weights, with the same key and clock: every file (chunks, manifests, head),
and each version's manifest id as the ranks saw it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from patchswarm.daemon import fp8
from patchswarm.daemon.board import Board
from patchswarm.daemon.publish_dist import DistPublisher, DistPublishError
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.keys import SigningKey
from tests.support.boards import board_files, board_patches

# Starting two processes that import torch is most of the time (over 20 s on a loaded 2-core host).
pytestmark = pytest.mark.slow

RUN = "dist"
WORLD = 2


# ---------------------------------------------------------------- what the parent computes


def states(versions: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """FP32 weights per version: a dense first version, then sparse RL-like changes, and a dense change
    of one tensor in version 3.  Rows of 37, 21 and 1 split unevenly over two ranks (1 row: rank 1 has none)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "a.embed.weight": (256, 64),
        "b.proj.weight": (37, 64),
        "c.proj.weight": (21, 64),
        "c.proj.bias": (21,),
        "d.norm.weight": (64,),
        "e.tiny.weight": (1, 5),
    }
    cur = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    out = [{n: t.clone() for n, t in cur.items()}]
    for v in range(1, versions):
        for _n, t in cur.items():
            flat = t.view(-1)
            hit = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[hit] += torch.randn(hit.numel(), generator=g) * 0.1
        if v == 2:
            cur["c.proj.weight"] *= 1.5  # dense, and past the fp8 drift threshold
        out.append({n: t.clone() for n, t in cur.items()})
    return out


def split(state: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    names = sorted(state)
    return {n: state[n] for i, n in enumerate(names) if i % WORLD == rank}


SCENARIOS: dict[str, tuple[int, int, dict[str, Any]]] = {  # name -> (versions, seed, served format)
    "partitioned": (3, 0, {"name": "bf16"}),
    "dtensor": (4, 1, {"name": "bf16"}),
    "fsdp": (3, 0, {"name": "bf16"}),
    "fp8": (4, 2, {"name": "fp8_e4m3"}),
    "fp8_block": (4, 2, {"name": "fp8_e4m3", "block": 8}),
    "failing": (3, 3, {"name": "bf16"}),
    "resumed": (3, 4, {"name": "bf16"}),  # version 1 by a one-process Publisher, then two ranks go on
    # The same with fp8: the ranks follow version 1's scales from the board (every weight grows 2% a
    # version after it: within the drift band, so kept scales and fresh ones differ).
    "resumed_fp8": (3, 5, {"name": "fp8_e4m3"}),
    "resumed_fp8_block": (3, 5, {"name": "fp8_e4m3", "block": 8}),
    # Rank 1 fails in versions 2 and 3: every rank then follows the scales of the last version written
    # (a patch: the publishing rank keeps the scales' bytes of every version).
    "failing_fp8": (4, 6, {"name": "fp8_e4m3", "block": 8}),
    # Version 4, an anchor, recomputes every scale (every weight grows 2% a version: they all move).
    "fp8_refresh": (5, 7, {"name": "fp8_e4m3", "block": 8, "refresh_at_anchor": True}),
    # Payload format 2 (issue 37): small dense updates, where base contexts pay; partitioned ranks code
    # their own deltas for the publishing rank's format, the publishing rank those of the DTensor slices.
    "partitioned_ctx": (3, 8, {"name": "bf16", "payload_format": 2}),
    "dtensor_ctx": (3, 9, {"name": "bf16", "payload_format": 2}),
}


def weights_of(scenario: str) -> list[dict[str, torch.Tensor]]:
    versions, seed, _ = SCENARIOS[scenario]
    out = states(versions, seed)
    if scenario.startswith("resumed_fp8") or scenario in ("failing_fp8", "fp8_refresh"):
        out = [{n: t * 1.02**v for n, t in w.items()} for v, w in enumerate(out)]
    if scenario.endswith("_ctx"):
        g = torch.Generator().manual_seed(seed)
        out = [out[0]]
        for _ in range(1, versions):
            out.append({n: t + torch.randn(t.shape, generator=g) * 1e-3 for n, t in out[-1].items()})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of two trainer processes over every scenario (starting processes is the slow part)."""
    tmp = tmp_path_factory.mktemp("dist")
    SigningKey.generate().save(tmp / "key")
    torch.save({"t0": time.time()}, tmp / "job.pt")
    try:
        mp.spawn(_rank_main, args=(str(tmp),), nprocs=WORLD, join=True)  # type: ignore[attr-defined,no-untyped-call]
    except mp.ProcessExitedException as e:  # type: ignore[attr-defined]
        # A rank killed by a signal leaves no Python traceback; its fault handler's stacks say where.
        stacks = {r: _tail(tmp / f"rank{r}.fault") for r in range(WORLD)}
        pytest.fail(f"{e}; each rank's fault handler output: {stacks}")
    return tmp


def _tail(path: Path, most: int = 6000) -> str:
    return path.read_text(errors="replace")[-most:] if path.exists() else "(none)"


def results(tmp: Path, scenario: str) -> list[Any]:
    got = [json.loads((tmp / scenario / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, g in enumerate(got):
        assert g.get("crash") is None, f"rank {r}: {g['crash']}"
    return got


def one_process(tmp: Path, scenario: str, weights: list[dict[str, torch.Tensor]]) -> tuple[Board, list[str]]:
    t0 = torch.load(tmp / "job.pt")["t0"]
    pub = _publisher(tmp / scenario / "plain", SigningKey.load(tmp / "key"), t0, SCENARIOS[scenario][2])
    ids = []
    for w in weights:
        info = pub.publish(w)
        assert isinstance(info, PublishInfo)
        ids.append(info.manifest_id.hex())
    return pub.board, ids


def file_bytes(board: Board) -> dict[str, bytes]:
    return {n: board.path(n).read_bytes() for n in board_files(board)}


def _publisher(root: Path, key: SigningKey, t0: float, fmt: Mapping[str, Any]) -> Publisher:
    # fp8 over every matrix: these names are not a checkpoint's (its selection would take none)
    served = ServedFormat(
        fmt["name"],
        block=fmt.get("block"),
        quantize=fp8.ALL_MATRICES,
        refresh_at_anchor=fmt.get("refresh_at_anchor", False),
    )
    return Publisher(
        root,
        key,
        run_id=RUN,
        anchor_every=4,
        served_format=served,
        payload_format=fmt.get("payload_format", 1),
        clock=lambda: t0,
        refresh=False,
    )


# ---------------------------------------------------------------- what each rank runs


def _rank_main(rank: int, root: str) -> None:
    tmp = Path(root)
    fault = (tmp / f"rank{rank}.fault").open("w")
    faulthandler.enable(fault, all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        t0 = torch.load(tmp / "job.pt")["t0"]
        for scenario, (_, _, fmt) in SCENARIOS.items():
            where = tmp / scenario
            where.mkdir(exist_ok=True)
            out: dict[str, Any] = {"ids": [], "errors": [], "gathered": [], "served": [], "anchor": []}
            weights = weights_of(scenario) if scenario != "fsdp" else []
            try:
                if scenario.startswith("resumed"):
                    if rank == 0:
                        first = _publisher(where / "board", SigningKey.load(tmp / "key"), t0, fmt)
                        out["ids"].append(first.publish(weights[0]).manifest_id.hex())  # type: ignore[union-attr]
                        first.close()
                    weights = weights[1:]
                pub = _publisher(where / "board", SigningKey.load(tmp / "key"), t0, fmt) if rank == 0 else None
                dp = DistPublisher(pub)
                if scenario == "fsdp":
                    _fsdp(dp, out, where, rank)
                for v, w in enumerate(weights, start=1):
                    if (scenario == "failing" and v <= 2) or (scenario == "failing_fp8" and 2 <= v <= 3):
                        _failures(dp, out, where, rank, w)
                    info = dp.publish(_part(scenario, w, rank))
                    out["ids"].append(info.manifest_id.hex())
                    out["gathered"].append(dp.last_gathered_bytes)
                    out["served"].append(info.served_bytes)
                    out["anchor"].append(info.anchor_bytes)
            except Exception as e:  # reported by the test that reads this scenario
                out["crash"] = repr(e)
            (where / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    # Every result is in its file.  Leave without the interpreter's teardown of torch's and gloo's
    # threads: that teardown is not what these tests check, and it once aborted a rank on a CI host.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _part(scenario: str, w: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    if scenario in ("partitioned", "partitioned_ctx", "failing", "failing_fp8"):
        return split(w, rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    out: dict[str, torch.Tensor] = {}
    for n, t in w.items():
        if scenario == "resumed":
            out[n] = distribute_tensor(t, mesh, [Shard(0)])
        elif n == "e.tiny.weight" and scenario == "fp8_block":
            dt = distribute_tensor(t, mesh, [Shard(0)])  # collective: every rank makes it
            if rank == 0:  # rank 1 holds none of its one row and leaves it out: the ranks' lists differ
                out[n] = dt
        elif n == "d.norm.weight":
            out[n] = distribute_tensor(t, mesh, [Replicate()])
        elif n == "a.embed.weight" and rank == 1:
            out[n] = t  # a whole tensor on one rank, next to the DTensors
        elif n != "a.embed.weight":
            out[n] = distribute_tensor(t, mesh, [Shard(0)])
    return out


def _failures(dp: DistPublisher, out: dict[str, Any], tmp: Path, rank: int, w: Mapping[str, torch.Tensor]) -> None:
    """Rank 1 fails: before the version is planned (a bad state dict, a DTensor sharded on dim 1), and
    while working on its part (a dtype the served formats do not have).  Every rank raises; the board
    does not move."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    board = Board(tmp / "board")
    before = file_bytes(board) if rank == 0 else None
    columns = distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (WORLD,)), [Shard(1)])  # every rank
    bad: list[dict[str, Any]] = [
        {"x": "not a tensor"},
        {"x": torch.zeros(3, dtype=torch.complex64)},
        {"cols": columns},
    ]
    for b in bad:
        try:
            dp.publish(b if rank == 1 else split(w, rank))
        except DistPublishError as e:
            out["errors"].append(str(e))
        if rank == 0:
            out.setdefault("unchanged", []).append(file_bytes(board) == before)


def _fsdp(dp: DistPublisher, out: dict[str, Any], tmp: Path, rank: int) -> None:
    """FSDP2 (fully_shard, CPU, gloo): a few AdamW steps; the state dict's DTensors are published as they
    are.  The full weights (gathered here only as the test's oracle) go to a file for the parent."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 37), torch.nn.GELU(), torch.nn.Linear(37, 21))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    oracle = []
    for _ in range(3):
        loss = model(torch.randn(8, 24, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = model.state_dict()
        oracle.append({k: v.full_tensor().clone() for k, v in state.items()})
        info = dp.publish(state)
        out["ids"].append(info.manifest_id.hex())
    if rank == 0:
        torch.save(oracle, tmp / "oracle.pt")


# ---------------------------------------------------------------- tests


def check_same_board(tmp: Path, scenario: str, weights: list[dict[str, torch.Tensor]] | None = None) -> list[Any]:
    got = results(tmp, scenario)
    plain, ids = one_process(tmp, scenario, weights_of(scenario) if weights is None else weights)
    skip = 1 if scenario.startswith("resumed") else 0  # rank 1 was not there for version 1
    assert got[0]["ids"] == ids and got[1]["ids"] == ids[skip:]  # every rank got every version's PublishInfo
    dist_files = file_bytes(Board(tmp / scenario / "board"))
    assert dist_files == file_bytes(plain) and len(dist_files) > 3
    return got


def test_two_tensor_partitioned_ranks_publish_the_one_process_board(ranks: Path) -> None:
    got = check_same_board(ranks, "partitioned")
    # Version 2 is a sparse patch: what travelled is the ranks' deltas, not their tensors.
    assert got[0]["gathered"][1] < got[0]["served"][1] / 2


def test_dtensor_shards_uneven_and_replicated_publish_the_one_process_board(ranks: Path) -> None:
    got = check_same_board(ranks, "dtensor")
    assert got[0]["gathered"][1] < got[0]["served"][1] / 2  # sparse changes: positions and values only


def test_fsdp2_state_dicts_publish_the_one_process_board(ranks: Path) -> None:
    check_same_board(ranks, "fsdp", torch.load(ranks / "fsdp" / "oracle.pt"))


def test_fp8_scales_over_dtensor_slices_match_one_process(ranks: Path) -> None:
    check_same_board(ranks, "fp8")  # per-tensor scales
    check_same_board(ranks, "fp8_block")  # 8x8 blocks: slices of 37 and 21 rows cut through blocks
    got = check_same_board(ranks, "fp8_refresh")  # every scale recomputed at the anchor (version 4)
    assert [a is not None for a in got[0]["anchor"]] == [True, False, False, True, False]


def test_a_failing_rank_fails_every_rank_and_writes_nothing(ranks: Path) -> None:
    got = results(ranks, "failing")
    assert got[0]["unchanged"] == [True] * 6
    for r in range(WORLD):
        errors = got[r]["errors"]
        assert len(errors) == 6
        for v, (first, second, third) in enumerate(zip(errors[::3], errors[1::3], errors[2::3], strict=True), start=1):
            assert "rank 1: ValueError: x: not a tensor" in first
            assert f"version {v} not published: rank 1:" in second
            assert "rank 1: ValueError: cols: placement S(1) is not supported (Shard(0) or Replicate)" in third
    # The failed tries gave their version number back: the board is the one-process board.
    check_same_board(ranks, "failing")


def test_ranks_go_on_from_a_run_on_the_board_with_a_patch(ranks: Path) -> None:
    """A resumed Publisher rebuilt version 1 from the board: the ranks' first version patches it
    (the publishing rank diffs the gathered rows against it), no new anchor."""
    got = check_same_board(ranks, "resumed")
    assert got[0]["anchor"] == [None, None]


def test_ranks_go_on_from_an_fp8_run_on_the_board_with_its_scales(ranks: Path) -> None:
    """fp8 (per tensor, 8x8 blocks): the ranks' first version follows the scales of the version the
    resumed Publisher rebuilt from the board, as one process does: the same bytes."""
    for scenario in ("resumed_fp8", "resumed_fp8_block"):
        got = check_same_board(ranks, scenario)
        assert got[0]["anchor"] == [None, None], scenario


def test_ranks_follow_fp8_scales_from_the_chain_after_a_failed_version(ranks: Path) -> None:
    got = results(ranks, "failing_fp8")
    assert got[0]["unchanged"] == [True] * 6 and len(got[1]["errors"]) == 6
    check_same_board(ranks, "failing_fp8")


def test_payload_format_2_is_the_publishing_ranks_choice_on_every_rank(ranks: Path) -> None:
    for scenario in ("partitioned_ctx", "dtensor_ctx"):
        check_same_board(ranks, scenario)  # the one-process Publisher with payload_format=2 wrote the same files
        patches = board_patches(Board(ranks / scenario / "board"), RUN)
        assert sorted(patches) == [2, 3]
        ctx = {i for fmt, encs in patches.values() if fmt == 2 for i, e in enumerate(encs) if e == "SPARSE_CTX"}
        # Contexts pay on tensors of both ranks (names in order, split alternately): each coded them itself.
        assert {i % WORLD for i in ctx} == {0, 1}, (scenario, patches)

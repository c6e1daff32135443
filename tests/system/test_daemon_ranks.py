"""One daemon feeding N rank stores (store.ranks, store.plan = auto): real daemon processes, a tiny Llama
published version after version, every rank's bytes checked against vLLM's tensor-parallel slices of the
version computed in the test (chunk / cat); bad plans and a stale rank store.  The kill -9 runs between
rank activations are in tests/system/test_daemon_crash.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from patchswarm.daemon.engine_client import DaemonClient
from patchswarm.daemon.store_format import StoreError, StoreLayout
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import raw_bytes
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.rank_plans import SPECS, llama_rank
from tests.support.rank_swarm import check_rank_stores, llama_swarm, rank_names
from tests.support.store_worker import remove_segments


def rank_daemon(sw, tmp: Path, tp: int, plan: str = "auto", name: str = "ranks") -> Daemon:  # type: ignore[no-untyped-def]
    d = make_daemon(sw, name, tmp)
    d.env.update(PATCHSWARM_STORE_RANKS=str(tp), PATCHSWARM_STORE_PLAN=plan)
    return d


async def get(d: Daemon, path: str) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=d.socket)) as s,
        s.get(f"http://d{path}", timeout=aiohttp.ClientTimeout(total=30)) as r,
    ):
        return r.status, await r.json()


@pytest.mark.asyncio
@pytest.mark.parametrize("tp", [2, 4])
async def test_every_rank_store_holds_its_slice_after_every_version(tmp_path: Path, tp: int) -> None:
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, tp)
    d.start()
    try:
        for v in (1, 2, 3):
            if v > 1:
                sw.publish(scale=1e-3)
            st = await d.wait_version(v)
            assert check_rank_stores(d.store, tp, sw.served, v) == v
            ranks = st["ranks"]
            assert [(r["rank"], r["store"], r["version"], r["state"]) for r in ranks] == [
                (k, n, v, "ready") for k, n in enumerate(rank_names(d.store, tp))
            ]
            for k, n in enumerate(rank_names(d.store, tp)):  # per-rank roots, computed where the weights live
                s = WeightStore.open(n)
                assert ranks[k]["root"] == s.root().hex()
                s.close()
        code, body = await get(d, "/v1/layout")
        assert code == 400 and "rank" in str(body["message"])
        code, body = await get(d, f"/v1/layout?rank={tp}")
        assert code == 400
        code, body = await get(d, "/v1/layout?rank=1")
        assert code == 200 and body["rank"] == 1 and body["attach"]["name"] == f"{d.store}.r1"  # type: ignore[index]
        assert await d.stop() == 0
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


async def wait_reason(d: Daemon, prefix: str, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await d.status()
        if st is not None and str(st.get("reason") or "").startswith(prefix):
            return st
        assert d.alive, d.log.read_text()[-2000:]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no status reason {prefix!r}: {await d.status()}; {d.log.read_text()[-2000:]}")


@pytest.mark.asyncio
async def test_a_plan_that_does_not_fit_is_refused_before_any_store_is_written(tmp_path: Path) -> None:
    # auto needs the model's config.json in the manifests: this run's manifests do not carry it.
    sw = llama_swarm(tmp_path, with_config=False)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, 2)
    d.start()
    try:
        st = await wait_reason(d, "store.plan:")
        assert st["state"] == "error" and st["version"] is None
        assert "config.json" in str(st["reason"])
        assert not list(Path("/dev/shm").glob(f"{d.store}.r*")), "a refused plan created a rank store"
        assert await d.stop() == 0
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.asyncio
async def test_a_plan_for_another_family_is_refused(tmp_path: Path) -> None:
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, 2, plan="qwen3_moe")  # no experts in a Llama: the plan cannot map it
    d.start()
    try:
        await wait_reason(d, "store.plan:")
        assert not list(Path("/dev/shm").glob(f"{d.store}.r*"))
        assert await d.stop() == 0
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.asyncio
async def test_ranks_without_a_plan_stop_the_daemon_with_one_line(tmp_path: Path) -> None:
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, 2, plan="none", name="noplan")
    d.start()
    try:
        assert d.proc is not None
        for _ in range(1200):  # (polled: the seed keeps answering meanwhile)
            if d.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert d.proc.returncode not in (None, 0), d.log.read_text()[-2000:]
        lines = [ln for ln in d.log.read_text().splitlines() if "store.plan" in ln]
        assert lines and "store.ranks = 2 needs a layout plan" in lines[-1]
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.asyncio
async def test_a_rank_store_left_by_another_world_size_is_recreated(tmp_path: Path) -> None:
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, 2)
    stale = WeightStore.create(f"{d.store}.r1", StoreLayout.from_specs(SPECS))  # another model, another size
    stale.close()
    d.start()
    try:
        await d.wait_version(1)
        check_rank_stores(d.store, 2, sw.served, 1)
        text = d.log.read_text()
        assert f"{d.store}.r1 (rank 1) was laid out for another plan or world size" in text
        assert await d.stop() == 0
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


def view_matches(view, model, tp: int, rank: int) -> bool:  # type: ignore[no-untyped-def]
    typed = {s.name: model.typed(i) for i, s in enumerate(model.specs)}
    want = llama_rank(typed, tp, rank)
    return sorted(want) == [s.name for s in view.layout.specs] and all(
        torch.equal(view.data[s.offset : s.offset + s.nbytes], raw_bytes(want[s.name])) for s in view.layout.slots
    )


@pytest.mark.asyncio
async def test_engine_buffers_register_per_rank_and_the_version_waits_for_every_rank(tmp_path: Path) -> None:
    """store.kind engine-shm, two ranks: each engine rank allocates and registers its own buffer; a rank
    is loaded as soon as it registers, the host's version appears only once both hold it."""
    tp = 2
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = rank_daemon(sw, tmp_path, tp)
    d.env["PATCHSWARM_STORE_KIND"] = "engine-shm"
    d.start()
    views = []
    try:
        client = DaemonClient(d.socket)
        with pytest.raises(StoreError, match="rank is needed"):
            await asyncio.to_thread(client.layout, 30.0)
        views.append(await asyncio.to_thread(client.open_store, "cpu", "tp-rank0", 60.0, 0))
        for _ in range(100):  # rank 0 loads; the host has no version while rank 1 has no buffer
            st = await d.status()
            if st is not None and st["ranks"][0]["state"] == "ready":
                break
            await asyncio.sleep(0.1)
        assert st is not None and st["version"] is None and st["ranks"][1]["state"] == "waiting_for_buffer", st
        assert view_matches(views[0], sw.served[1], tp, 0)
        views.append(await asyncio.to_thread(client.open_store, "cpu", "tp-rank1", 60.0, 1))
        await d.wait_version(1)
        for v in (2, 3):
            sw.publish(scale=1e-3)
            await d.wait_version(v)
            for k, view in enumerate(views):
                assert view.read_version() == (v, bytes.fromhex((await d.status())["ranks"][k]["root"]))  # type: ignore[index]
                assert view_matches(view, sw.served[v], tp, k)
        assert await d.stop() == 0
    finally:
        for view in views:
            view.close()
        d.cleanup()
        remove_segments(d.store)
        await sw.close()


@pytest.mark.asyncio
async def test_a_bad_plan_file_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    sw = llama_swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    plan = tmp_path / "plan.json"
    plan.write_text('{"format": "patchswarm-layout-plan", "version": 7, "rules": []}')
    d = rank_daemon(sw, tmp_path, 2, plan=str(plan), name="badfile")
    d.start()
    try:
        assert d.proc is not None
        for _ in range(1200):
            if d.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert d.proc.returncode not in (None, 0), d.log.read_text()[-2000:]
        lines = [ln for ln in d.log.read_text().splitlines() if "store.plan" in ln]
        assert lines and f"{plan}: plan file: version 7" in lines[-1], d.log.read_text()[-2000:]
        assert not list(Path("/dev/shm").glob(f"{d.store}.r*"))
    finally:
        d.cleanup()
        remove_segments(d.store)
        await sw.close()

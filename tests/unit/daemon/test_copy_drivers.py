"""The vLLM and SGLang drivers' requests and answer handling, as units (no engine runs on this CPU host).

Shapes are those the engines' routes read (vLLM 0.34: vllm/entrypoints/serve/dev/rpc/api_router.py,
vllm/entrypoints/serve/dev/cache/api_router.py, vllm/entrypoints/rl/online/api_router.py; SGLang 0.5.23:
sglang/srt/entrypoints/http_server.py, sglang/srt/managers/io_struct.py UpdateWeightsFromTensorReqInput).
Where vLLM or SGLang import (a scratch venv with their wheels, see docs/engines.md), their own classes
check the extension's names and the payload's deserialization.
"""

from __future__ import annotations

import json

import pytest

from patchswarm.daemon.copy_drivers import (
    LOADER,
    check_rank_results,
    make_sglang_driver,
    make_vllm_driver,
    parse_version,
    sglang_update_request,
    vllm_requests,
)
from patchswarm.daemon.engine_driver import Activation, EngineError, Region
from patchswarm.daemon.param_sync import parse_apply
from patchswarm.daemon.payloads import deserialize_ipc
from patchswarm.daemon.vllm_worker import PatchswarmWorkerExtension

ACT = Activation(8, 7, False, {0: (Region("a.weight", 0, 16),), 1: (Region("b.weight", 32, 64),)})


def test_vllm_commit_requests() -> None:
    apply, reset, version = vllm_requests(ACT, 2, 90.0, full=False)
    assert (apply.method, apply.path) == ("POST", "/collective_rpc")
    assert apply.json is not None and apply.json["method"] == "patchswarm_apply" and apply.json["timeout"] == 90.0
    (arg,) = apply.json["args"]
    assert isinstance(arg, str)  # the dev route passes strings only
    assert parse_apply(arg, 0) == (8, [Region("a.weight", 0, 16)])
    assert parse_apply(arg, 1) == (8, [Region("b.weight", 32, 64)])
    assert (reset.path, reset.params) == ("/reset_prefix_cache", {"reset_running_requests": "true"})
    assert (version.path, version.json) == ("/update_weight_version", {"new_version": "8"})
    whole, *_ = vllm_requests(ACT, 2, 90.0, full=True)
    assert whole.json is not None and parse_apply(whole.json["args"][0], 1) == (8, None)
    no_flush = Activation(8, 7, False, ACT.regions, flush_cache=False)
    assert [r.path for r in vllm_requests(no_flush, 2, 1.0, full=False)] == [
        "/collective_rpc",
        "/update_weight_version",
    ]


def ok(rank: int, version: int = 8) -> dict[str, object]:
    return {"ok": True, "rank": rank, "version": version, "regions": 1, "bytes": 16, "loaded": []}


def test_every_rank_must_report_the_version() -> None:
    assert check_rank_results({"results": [ok(0), ok(1)]}, 2, 8) is False
    cases = [
        ({"results": [ok(0)]}, "expected 2 worker results", None),
        ({"results": [ok(0), ok(0)]}, "ranks \\[0\\]", True),
        ({"results": [ok(0), ok(1, 7)]}, "not version 8", None),
        (
            {"results": [ok(0), {"ok": False, "rank": 1, "error": "rank 1: nope", "copied": False}]},
            "rank 1: nope",
            True,
        ),
        ({"results": [{"ok": False, "rank": 0, "error": "x", "copied": False}] * 2}, "x", False),
        ({"results": [{"ok": False, "rank": 0, "error": "x", "copied": True}, ok(1)]}, "x", True),
        ("oops", "expected 2", None),
    ]
    for answer, why, copied in cases:
        with pytest.raises(EngineError, match=why) as e:
            check_rank_results(answer, 2, 8)
        assert getattr(e.value, "copied", None) is copied, answer


def test_weight_versions_parse_strictly() -> None:
    assert [parse_version(v) for v in ("8", 8, "08", None, "v8", -1, True, "1" * 30, 1.0)] == [
        8, 8, 8, None, None, None, None, None, None,
    ]  # fmt: skip


def test_sglang_update_request_matches_update_weights_from_tensor() -> None:
    spec = json.dumps({"socket": "/run/patchswarm/api.sock", "ranks": 2})
    req = sglang_update_request(ACT, 2, spec, full=False)
    assert (req.method, req.path) == ("POST", "/update_weights_from_tensor")
    body = req.json
    assert body is not None
    assert set(body) == {
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
    }
    assert body["load_format"] == LOADER and body["weight_version"] == "8" and body["flush_cache"] is True
    assert len(body["serialized_named_tensors"]) == 2  # one per TP rank; rank r reads entry r
    for r, entry in enumerate(body["serialized_named_tensors"]):
        ((name, tensor),) = deserialize_ipc(entry)
        obj = json.loads(name)
        assert obj["rank"] == r and obj["attach"] == spec and tensor.numel() == 0
        assert parse_apply(obj["apply"], r)[0] == 8


def test_driver_factories_check_their_arguments() -> None:
    assert make_vllm_driver("http://127.0.0.1:8000", 2, "{}").ranks == 2
    assert make_sglang_driver("http://127.0.0.1:30000", 1, "{}", pause_mode="retract").pause_mode == "retract"
    with pytest.raises(ValueError, match="pause mode"):
        make_sglang_driver("http://127.0.0.1:30000", 1, "{}", pause_mode="abort")
    with pytest.raises(ValueError, match="http"):
        make_vllm_driver("127.0.0.1:8000", 1, "{}")


# ---------------------------------------------------------------- against the engines' own classes, where they import


def test_the_extension_passes_vllms_conflict_check() -> None:
    """vLLM refuses an extension attribute the worker class already has (WorkerWrapperBase.init_worker)."""
    gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")
    worker_cls = gpu_worker.Worker
    names = [a for a in dir(PatchswarmWorkerExtension) if not a.startswith("__")]
    assert names and all(a.startswith("patchswarm_") for a in names)
    assert not [a for a in names if hasattr(worker_cls, a)]


def test_sglangs_serializer_reads_the_payload() -> None:
    common = pytest.importorskip("sglang.srt.utils.common")
    req = sglang_update_request(ACT, 1, "{}", full=True)
    assert req.json is not None
    import base64

    raw = base64.b64decode(req.json["serialized_named_tensors"][0])
    ((name, tensor),) = common.MultiprocessingSerializer.deserialize(raw)
    assert json.loads(name)["rank"] == 0 and tensor.numel() == 0


# ------------------------------------------------------------ the HTTP client's error lines (a plain aiohttp server)


@pytest.mark.asyncio
async def test_http_errors_become_one_engine_error_line() -> None:
    from aiohttp import web

    from patchswarm.daemon.copy_drivers import MAX_ANSWER_BYTES, Timeouts, _Http
    from patchswarm.daemon.payloads import EngineRequest

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom\n" * 200)

    async def huge(request: web.Request) -> web.Response:
        return web.Response(text="x" * (MAX_ANSWER_BYTES + 10))

    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "12", "got": await request.json(), "q": dict(request.query)})

    app = web.Application()
    app.router.add_post("/fail", fail)
    app.router.add_get("/huge", huge)
    app.router.add_post("/fine", fine)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    http = _Http(f"http://127.0.0.1:{port}", Timeouts(5.0, 5.0))
    try:
        with pytest.raises(EngineError, match=r"^POST /fail: HTTP 500: boom") as e:
            await http.call(EngineRequest("POST", "/fail", {}))
        assert len(str(e.value)) < 400
        with pytest.raises(EngineError, match="over"):
            await http.call(EngineRequest("GET", "/huge"))
        got = await http.call(EngineRequest("POST", "/fine", {"a": 1}, params={"mode": "keep"}))
        assert got == {"weight_version": "12", "got": {"a": 1}, "q": {"mode": "keep"}}
    finally:
        await http.close()
        await runner.cleanup()
    closed = _Http(f"http://127.0.0.1:{port}", Timeouts(2.0, 2.0))
    try:
        with pytest.raises(EngineError, match=r"^GET /weight_info: ClientConnectorError"):
            await closed.call(EngineRequest("GET", "/weight_info"))
    finally:
        await closed.close()


def test_attach_answers_are_checked() -> None:
    from patchswarm.daemon.copy_drivers import check_attach_results

    good = {"results": [{"rank": 1, "loader_count": 0}, {"rank": 0, "loader_count": 0}]}
    check_attach_results(good, 2)
    check_attach_results({"results": [{"rank": 0, "loader_count": 3, "loader": ["lm_head.weight"]}]}, 1)
    for answer, why in (
        ({"results": [{"rank": 0}]}, "expected 2"),
        ({"results": [{"rank": 0}, {"rank": 0}]}, "report ranks"),
        ({"results": [{"rank": 0}, {"rank": 1, "loader_count": 2, "loader": ["a.weight"]}]}, "rank 1: 2 .*a.weight"),
    ):
        with pytest.raises(EngineError, match=why):
            check_attach_results(answer, 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["end_weight_update fails", "stale weight_version"])
async def test_an_sglang_update_that_copied_but_did_not_confirm_leaves_the_driver_torn(fault: str) -> None:
    """SGLang took the new weights (``success``) but the session's end or the version read back failed:
    its parameters are the new version's under the old label, so the driver must not say it still
    serves the old one (``torn``: the daemon keeps the sidecar closed, the next commit copies whole)."""
    from aiohttp import web

    updates: list[dict[str, object]] = []

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def end(request: web.Request) -> web.Response:
        return web.Response(status=500, text="end failed") if fault.startswith("end") else await ok(request)

    async def update(request: web.Request) -> web.Response:
        updates.append(await request.json())
        return web.json_response({"success": True, "message": "ok"})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "7"})

    app = web.Application()
    app.router.add_post("/begin_weight_update", ok)
    app.router.add_post("/end_weight_update", end)
    app.router.add_post("/update_weights_from_tensor", update)
    app.router.add_get("/model_info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    driver = make_sglang_driver(f"http://127.0.0.1:{port}", 2, json.dumps({"socket": "/x", "ranks": 2}), apply_s=5)
    try:
        with pytest.raises(EngineError):
            await driver.commit(ACT)
        assert len(updates) == 1 and driver.torn
        with pytest.raises(EngineError):
            await driver.commit(ACT)  # (still not confirmed) but this time every entry is copied whole
        assert len(updates) == 2

        def regions(body: dict[str, object]) -> object:
            entries = body["serialized_named_tensors"]
            assert isinstance(entries, list)
            ((name, _),) = deserialize_ipc(entries[1])
            return parse_apply(json.loads(name)["apply"], 1)[1]

        assert regions(updates[0]) == [Region("b.weight", 32, 64)] and regions(updates[1]) is None
    finally:
        await driver.close()
        await runner.cleanup()

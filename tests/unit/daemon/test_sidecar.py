"""The version gate and the sidecar proxy, over real HTTP on loopback against the reference engine.

The engine reports the source version it read before and after every token, so each test checks
attribution against what actually ran: every version a request used lies in the sidecar's
[start, end], and start == end for exact pins and for quiesce commits.  Requests are held
mid-generation with the engine's step hook, never with sleeps.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from patchswarm.daemon.ref_sources import StaticSource
from patchswarm.daemon.refengine import RefEngine, start_engine
from patchswarm.daemon.sidecar import (
    HEADER_END,
    HEADER_EXACT,
    HEADER_MIN,
    HEADER_START,
    STATUS_PATH,
    ActivationError,
    CommitMode,
    ConstraintError,
    NotReady,
    Ticket,
    VersionConstraint,
    VersionGate,
    constraint_from_headers,
    constraint_from_json,
    serve_app,
    split_body_constraint,
    start_sidecar,
)
from tests.support.tinylm import greedy_reference, random_export

HOLD = 2  # prompts starting with this token are held by the step hook after their first token
PIN_HOLD = 3
FREE = 4
SAFETY_S = 60.0  # a hang guard, never a timing assertion


def guarded(coro: Awaitable[Any]) -> Awaitable[Any]:
    return asyncio.wait_for(coro, SAFETY_S)


# ---------------------------------------------------------------- vocabulary and parsing


def test_constraint_rules() -> None:
    assert VersionConstraint().unconstrained and VersionConstraint().satisfied_by(0)
    c = VersionConstraint(min_version=3)
    assert not c.pinned and c.satisfied_by(3) and c.satisfied_by(9) and not c.satisfied_by(2)
    assert not c.unreachable_after(100)
    e = VersionConstraint(min_version=2, exact_version=4)
    assert e.pinned and e.satisfied_by(4) and not e.satisfied_by(5)
    assert e.unreachable_after(5) and not e.unreachable_after(4)
    with pytest.raises(ConstraintError, match="no version satisfies"):
        VersionConstraint(min_version=5, exact_version=4)
    with pytest.raises(ConstraintError, match="non-negative"):
        VersionConstraint(min_version=-1)
    with pytest.raises(ConstraintError, match="non-negative"):
        VersionConstraint(exact_version=True)
    assert VersionConstraint(min_version=1).merged(VersionConstraint(exact_version=2)) == VersionConstraint(1, 2)
    assert VersionConstraint(exact_version=2).merged(VersionConstraint(exact_version=2)).exact_version == 2
    with pytest.raises(ConstraintError, match="different values"):
        VersionConstraint(exact_version=2).merged(VersionConstraint(exact_version=3))


def test_constraint_parsing() -> None:
    assert constraint_from_headers({HEADER_MIN: "3", HEADER_EXACT: " 4 "}) == VersionConstraint(3, 4)
    assert constraint_from_headers({"x-weight-version-min": "7"}) == VersionConstraint(min_version=7)
    assert constraint_from_headers({}) == VersionConstraint()
    for bad in ("abc", "-1", "1.5", "", "0x10", "1" * 19):
        with pytest.raises(ConstraintError):
            constraint_from_headers({HEADER_EXACT: bad})
    assert constraint_from_json(None) == VersionConstraint()
    assert constraint_from_json({"min_version": "2", "exact_version": None}) == VersionConstraint(min_version=2)
    for bad_json in ("3", [3], {"min": 1}, {"exact_version": 1.0}, {"exact_version": False}, {"min_version": -2}):
        with pytest.raises(ConstraintError):
            constraint_from_json(bad_json)


def test_body_constraint_is_taken_out_of_json_bodies_only() -> None:
    body = json.dumps({"prompt": [1], "weight_version": {"exact_version": 5}}).encode()
    rest, c = split_body_constraint(body, "application/json")
    assert c == VersionConstraint(exact_version=5) and json.loads(rest) == {"prompt": [1]}
    assert split_body_constraint(body, "")[1] == VersionConstraint(exact_version=5)  # no Content-Type: sniffed
    for untouched, ctype in ((body, "text/plain"), (b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                             (b'{"a": 1}', "application/json"), (b"", "application/json")):  # fmt: skip
        assert split_body_constraint(untouched, ctype) == (untouched, VersionConstraint())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt":"hi","weight_version":{"exact_version":NaN}}', "got nan"),
        (b'{"prompt":"hi","weight_version":{"min_version":1e400}}', "got inf"),
        (b'{"temperature":NaN,"weight_version":{"exact_version":5}}', "strict JSON"),
        (b'{"weight_version":{"min_version":2},"x":[Infinity]}', "strict JSON"),
        (b'{"weight_version":{"min_version":2},"x":-1e999}', "strict JSON"),
        # the last duplicate used to win: the client's pin was dropped, served from any version
        (b'{"weight_version":{"exact_version":5},"weight_version":null}', "no key given twice"),
        (b'{"prompt":"a","prompt":"b","weight_version":{"exact_version":5}}', "no key given twice"),
        (b'{"weight_version":{"exact_version":5},"x":' + b"[" * 100 + b"]" * 100 + b"}", "64 levels"),
        # past Python's recursion limit even the lenient parse fails: the pin was forwarded and dropped
        (b'{"weight_version":{"exact_version":5},"x":' + b"[" * 5000 + b"]" * 5000 + b"}", "64 levels"),
    ],
)
def test_a_constraint_in_a_body_that_is_not_strict_json_is_refused_not_dropped(body: bytes, message: str) -> None:
    """A body the sidecar cannot write back as strict JSON (a bare NaN or Infinity, a number no double
    holds) is passed on untouched, but one that names weight_version is refused: passing it would drop
    the client's constraint silently (served from any version) and hand the engine the key."""
    with pytest.raises(ConstraintError, match=message):
        split_body_constraint(body, "application/json")
    deep_array = b"[" * 5000 + b"]" * 5000  # (an array cannot carry weight_version)
    for untouched in (b'{"temperature":NaN}', b'{"x":1e999}', b'{"a":1,"a":2}', deep_array):  # forwarded as is
        assert split_body_constraint(untouched, "application/json") == (untouched, VersionConstraint())


# ---------------------------------------------------------------- the gate


@pytest.mark.asyncio
async def test_gate_admits_refuses_and_attributes() -> None:
    gate = VersionGate(applied=2, target=1, retry_after_s=3)
    assert (gate.applied, gate.target) == (2, 2)  # the target is never behind
    t = await gate.admit(VersionConstraint(min_version=2))
    assert isinstance(t, Ticket) and t.start_version == 2 and not t.pinned
    assert gate.in_flight == 1 and gate.pinned_in_flight == 0
    gate.set_target(5)
    gate.set_target(4)
    assert gate.target == 5
    r = await gate.admit(VersionConstraint(exact_version=3))
    assert r == NotReady("not_ready", 2, 5, None, 3) and r.retryable and r.status == 409
    r = await gate.admit(VersionConstraint(exact_version=1))
    assert isinstance(r, NotReady) and r.reason == "unavailable" and not r.retryable
    p = await gate.admit(VersionConstraint(exact_version=2))
    assert isinstance(p, Ticket) and p.pinned and gate.pinned_in_flight == 1
    assert gate.release(t) == 2 and gate.release(p) == 2
    assert gate.in_flight == 0 and gate.snapshot()["pinned_in_flight"] == 0
    with pytest.raises(ValueError, match="not in flight"):
        gate.release(t)


@pytest.mark.asyncio
async def test_activation_api_misuse() -> None:
    gate = VersionGate(applied=3)
    with pytest.raises(ValueError, match="commit mode"):
        await gate.begin_activation("drain", 4)  # type: ignore[arg-type]
    with pytest.raises(ActivationError, match="does not move past"):
        await gate.begin_activation("quiesce", 3)
    with pytest.raises(ActivationError, match="no activation"):
        gate.end_activation(4)
    await gate.begin_activation("quiesce", 4)
    assert gate.target == 4 and gate.mode == "quiesce"
    with pytest.raises(ActivationError, match="already in progress"):
        await gate.begin_activation("in_place", 5)
    with pytest.raises(ActivationError, match="cannot end"):
        gate.end_activation(5)
    gate.end_activation(3)  # abort: nothing was written
    assert (gate.applied, gate.activating, gate.target) == (3, None, 4)


@pytest.mark.asyncio
async def test_activation_context_commits_or_aborts() -> None:
    gate = VersionGate(applied=1)
    async with gate.activation("in_place", 2):
        assert gate.activating == 2
    assert gate.applied == 2 and gate.activating is None
    with pytest.raises(RuntimeError, match="write failed"):
        async with gate.activation("quiesce", 3):
            raise RuntimeError("write failed")
    assert gate.applied == 2 and gate.activating is None


@pytest.mark.asyncio
async def test_drain_wait_reopens_admission_on_timeout_and_cancel() -> None:
    gate = VersionGate(applied=1)
    t = await gate.admit()
    assert isinstance(t, Ticket)
    with pytest.raises(TimeoutError):
        await gate.begin_activation("quiesce", 2, timeout_s=0)
    assert gate.activating is None
    task = asyncio.create_task(gate.begin_activation("quiesce", 2))
    await guarded(gate.wait_until(lambda g: g.activating == 2))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.activating is None
    assert isinstance(await gate.admit(), Ticket)


@pytest.mark.asyncio
async def test_quiesce_waits_for_everyone_in_place_only_for_pins() -> None:
    for mode, expect_drained_after_pins in (("quiesce", False), ("in_place", True)):
        gate = VersionGate(applied=1)
        free, pinned = await gate.admit(), await gate.admit(VersionConstraint(exact_version=1))
        assert isinstance(free, Ticket) and isinstance(pinned, Ticket)
        task = asyncio.create_task(gate.begin_activation(mode, 2))  # type: ignore[arg-type]
        await guarded(gate.wait_until(lambda g: g.activating == 2))
        assert not task.done()
        gate.release(pinned)
        await asyncio.sleep(0)  # let the activation task observe the release
        assert task.done() is expect_drained_after_pins
        gate.release(free)
        await guarded(task)
        gate.end_activation(2)


@pytest.mark.asyncio
async def test_admission_waits_during_activation() -> None:
    gate = VersionGate(applied=1)
    await gate.begin_activation("quiesce", 2)
    waiters = {
        "free": asyncio.create_task(gate.admit()),
        "min2": asyncio.create_task(gate.admit(VersionConstraint(min_version=2))),
        "pin2": asyncio.create_task(gate.admit(VersionConstraint(exact_version=2))),
        "pin1": asyncio.create_task(gate.admit(VersionConstraint(exact_version=1))),
    }
    # Waiting cannot help these: refused at once.
    assert (await gate.admit(VersionConstraint(exact_version=3))).reason == "not_ready"  # type: ignore[union-attr]
    assert (await gate.admit(VersionConstraint(min_version=3))).reason == "not_ready"  # type: ignore[union-attr]
    await guarded(gate.wait_until(lambda g: g.waiting == 4))
    assert not any(t.done() for t in waiters.values())
    gate.end_activation(2)
    got = {k: await guarded(t) for k, t in waiters.items()}
    assert all(isinstance(got[k], Ticket) and got[k].start_version == 2 for k in ("free", "min2", "pin2"))
    assert isinstance(got["pin1"], NotReady) and got["pin1"].reason == "unavailable"
    assert gate.waiting == 0 and gate.in_flight == 3


@pytest.mark.asyncio
async def test_a_held_activation_moves_to_a_newer_version_without_reopening() -> None:
    gate = VersionGate(applied=1)
    with pytest.raises(ActivationError, match="no activation"):
        gate.retarget(3)
    await gate.begin_activation("quiesce", 2)
    pin2 = asyncio.create_task(gate.admit(VersionConstraint(exact_version=2)))
    free = asyncio.create_task(gate.admit())
    await guarded(gate.wait_until(lambda g: g.waiting == 2))
    with pytest.raises(ActivationError, match="does not move past"):
        gate.retarget(1)
    gate.retarget(3)  # (a commit of 2 was never acknowledged; 3 came meanwhile)
    assert (gate.applied, gate.activating, gate.target) == (1, 3, 3)
    r = await guarded(pin2)  # waiting for 2 cannot help any more
    assert isinstance(r, NotReady) and r.reason == "not_ready" and r.activating == 3
    assert not free.done()  # admission stays closed
    gate.end_activation(3)
    t = await guarded(free)
    assert isinstance(t, Ticket) and t.start_version == 3


@pytest.mark.asyncio
async def test_admission_wait_is_bounded_and_abort_keeps_version() -> None:
    gate = VersionGate(applied=1, admission_timeout_s=0, retry_after_s=2)
    await gate.begin_activation("in_place", 2)
    r = await gate.admit()
    assert r == NotReady("activating", 1, 2, 2, 2) and r.status == 503 and r.retryable
    gate.admission_timeout_s = SAFETY_S
    waiter = asyncio.create_task(gate.admit(VersionConstraint(min_version=2)))
    await guarded(gate.wait_until(lambda g: g.waiting == 1))
    gate.end_activation(1)  # aborted
    r = await guarded(waiter)
    assert isinstance(r, NotReady) and r.reason == "not_ready" and r.target == 2


# ---------------------------------------------------------------- the rig: engine + sidecar over loopback


@dataclass
class Rig:
    gate: VersionGate
    source: StaticSource
    engine: RefEngine
    engine_url: str
    url: str
    http: aiohttp.ClientSession
    weights: dict[int, dict[str, torch.Tensor]]

    async def activate(self, mode: CommitMode, version: int) -> None:
        """The activation protocol: close admission and drain, pause (in place), write, reopen, resume."""
        await self.gate.begin_activation(mode, version)
        if mode == "in_place":
            await self.engine.pause()
        self.source.update(self.weights[version], version)
        self.gate.end_activation(version)
        self.engine.resume()


Hook = Callable[[tuple[int, ...], int], Awaitable[None]]


@asynccontextmanager
async def rig(
    applied: int = 1, hook: Hook | None = None, gate: VersionGate | None = None, **sidecar_options: Any
) -> AsyncIterator[Rig]:
    weights = {v: random_export(v) for v in (1, 2, 3)}
    source = StaticSource({k: t.clone() for k, t in weights[applied].items()}, applied)
    engine = RefEngine(source, step_hook=hook)
    engine_server = await start_engine(engine)
    gate = gate or VersionGate(applied)
    sidecar = await start_sidecar(engine_server.url, gate, **sidecar_options)
    try:
        async with aiohttp.ClientSession() as http:
            yield Rig(gate, source, engine, engine_server.url, sidecar.url, http, weights)
    finally:
        await sidecar.close()
        await engine_server.close()


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    body: Any = None
    events: list[tuple[str, Any]] = field(default_factory=list)  # (event name, data)
    constraint: VersionConstraint = field(default_factory=VersionConstraint)

    @property
    def start(self) -> int:
        return int(self.headers[HEADER_START])

    @property
    def end(self) -> int:
        if self.events:
            name, data = self.events[-1]
            assert name == "weight_version", self.events[-1]
            assert data["weight_version"]["start"] == self.start
            return int(data["weight_version"]["end"])
        assert self.body["weight_version"] == {"start": self.start, "end": int(self.headers[HEADER_END])}
        return int(self.headers[HEADER_END])

    @property
    def used(self) -> list[tuple[int, int]]:
        """(before, after) of every token, as the engine reported them."""
        if self.events:
            return [(d["version"]["before"], d["version"]["after"]) for d in token_events(self.events)]
        return [(b, a) for b, a in self.body["token_versions"]]

    @property
    def tokens(self) -> list[int]:
        if self.events:
            return [d["token"] for d in token_events(self.events)]
        return list(self.body["tokens"])


def token_events(events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [d for n, d in events if n == "message" and d != "[DONE]"]


async def read_sse(resp: aiohttp.ClientResponse) -> list[tuple[str, Any]]:
    events = []
    while block := await resp.content.readuntil(b"\n\n"):
        events.append(parse_sse_block(block))
    return events


def parse_sse_block(block: bytes) -> tuple[str, Any]:
    name, data = "message", ""
    for line in block.decode().splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
    return name, (data if data == "[DONE]" else json.loads(data))


async def generate(
    r: Rig,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    min_version: int | None = None,
    exact: int | None = None,
    stream: bool = False,
    via_headers: bool = False,
) -> Result:
    constraint = VersionConstraint(min_version, exact)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    headers: dict[str, str] = {}
    if via_headers:
        if min_version is not None:
            headers[HEADER_MIN] = str(min_version)
        if exact is not None:
            headers[HEADER_EXACT] = str(exact)
    elif not constraint.unconstrained:
        body["weight_version"] = {"min_version": min_version, "exact_version": exact}
    async with r.http.post(f"{r.url}/generate", json=body, headers=headers) as resp:
        hdrs = dict(resp.headers)
        if resp.content_type == "text/event-stream":
            return Result(resp.status, hdrs, events=await read_sse(resp), constraint=constraint)
        return Result(resp.status, hdrs, body=await resp.json(), constraint=constraint)


def assert_attributed(res: Result, *, single_version: bool) -> None:
    """Everything the engine used lies in [start, end]; a single version when the mode promises one."""
    assert res.status == 200, (res.status, res.body)
    start, end = res.start, res.end
    assert start <= end
    used = {v for pair in res.used for v in pair}
    assert used <= set(range(start, end + 1)), (start, end, res.used)
    if single_version:
        assert start == end and used <= {start}
    c = res.constraint
    assert c.satisfied_by(start)
    if c.pinned:
        assert start == end == c.exact_version and used <= {start}


# ---------------------------------------------------------------- HTTP behaviour


@pytest.mark.asyncio
async def test_pinned_request_409_until_applied_then_served() -> None:
    async with rig(applied=1) as r:
        r.gate.set_target(2)
        for via_headers in (False, True):
            res = await generate(r, [FREE, 5, 1], exact=2, via_headers=via_headers)
            assert res.status == 409
            assert res.headers["Retry-After"] == "1"
            assert res.body == {
                "error": "WeightVersionNotReady",
                "applied_version": 1,
                "target_version": 2,
                "retryable": True,
                "requested": {"min_version": None, "exact_version": 2},
            }
        await r.activate("quiesce", 2)
        for via_headers in (False, True):
            res = await generate(r, [FREE, 5, 1], 5, exact=2, via_headers=via_headers)
            assert_attributed(res, single_version=True)
            assert (res.headers[HEADER_START], res.headers[HEADER_END]) == ("2", "2")
            assert res.body["weight_version"] == {"start": 2, "end": 2}
            assert res.used == [(2, 2)] * 5
            assert res.tokens == greedy_reference(r.weights[2], [FREE, 5, 1], 5)


@pytest.mark.asyncio
async def test_min_version_and_superseded_pins() -> None:
    async with rig(applied=2) as r:
        for m in (0, 1, 2):
            assert_attributed(await generate(r, [FREE, 6, 1], min_version=m), single_version=True)
        res = await generate(r, [FREE, 6, 1], min_version=3, via_headers=True)
        assert res.status == 409 and res.body["error"] == "WeightVersionNotReady" and res.body["retryable"] is True
        res = await generate(r, [FREE, 6, 1], exact=1)
        assert res.status == 409 and "Retry-After" not in res.headers
        assert res.body["error"] == "WeightVersionUnavailable" and res.body["retryable"] is False
        assert_attributed(await generate(r, [FREE, 6, 1], min_version=1, exact=2), single_version=True)
        assert r.gate.in_flight == 0


@pytest.mark.asyncio
async def test_streaming_passes_through_incrementally() -> None:
    held, go_on = asyncio.Event(), asyncio.Event()

    async def hook(prompt: tuple[int, ...], index: int) -> None:
        if prompt[0] == HOLD and index == 1:
            held.set()
            await go_on.wait()

    async with rig(applied=1, hook=hook) as r:
        body = {"prompt": [HOLD, 7, 1], "max_tokens": 4, "stream": True}
        async with r.http.post(f"{r.url}/generate", json=body) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert resp.headers[HEADER_START] == "1" and HEADER_END not in resp.headers
            first = parse_sse_block(await guarded(resp.content.readuntil(b"\n\n")))
            # The first token reached the client while the engine was held before the second.
            assert first[0] == "message" and first[1]["index"] == 0
            assert held.is_set() and not go_on.is_set() and r.gate.in_flight == 1
            go_on.set()
            rest = await read_sse(resp)
        assert [d["index"] for d in token_events(rest)] == [1, 2, 3]
        assert rest[-2] == ("message", "[DONE]")
        assert rest[-1] == ("weight_version", {"weight_version": {"start": 1, "end": 1}})
        assert r.gate.in_flight == 0
        res = await generate(r, [FREE, 7, 1], stream=True, exact=1)  # a pin knows its end up front
        assert res.headers[HEADER_END] == "1"
        assert_attributed(res, single_version=True)
        free = await generate(r, [FREE, 7, 1], 3, stream=True)
        assert free.tokens == greedy_reference(r.weights[1], [FREE, 7, 1], 3)


@pytest.mark.asyncio
async def test_quiesce_activation_drains_and_holds_newcomers() -> None:
    hold = asyncio.Event()

    async def hook(prompt: tuple[int, ...], index: int) -> None:
        if prompt[0] == HOLD and index >= 1:
            await hold.wait()

    async with rig(applied=1, hook=hook) as r:
        early = [
            asyncio.create_task(generate(r, [HOLD, 5, 1], 4, stream=True)),
            asyncio.create_task(generate(r, [HOLD, 6, 1], 4)),
            asyncio.create_task(generate(r, [HOLD, 7, 1], 4, exact=1, stream=True)),
            asyncio.create_task(generate(r, [HOLD, 8, 1], 4, exact=1, via_headers=True)),
            asyncio.create_task(generate(r, [HOLD, 9, 1], 4, min_version=1)),
        ]
        await guarded(r.gate.wait_until(lambda g: g.in_flight == len(early)))
        activation = asyncio.create_task(r.gate.begin_activation("quiesce", 2))
        await guarded(r.gate.wait_until(lambda g: g.activating == 2))
        late = [
            asyncio.create_task(generate(r, [FREE, 5, 1], 3, stream=True)),
            asyncio.create_task(generate(r, [FREE, 6, 1], 3, exact=2)),
            asyncio.create_task(generate(r, [FREE, 7, 1], 3, min_version=2, via_headers=True)),
            asyncio.create_task(generate(r, [FREE, 8, 1], 3, exact=1)),
        ]
        await guarded(r.gate.wait_until(lambda g: g.waiting == len(late)))
        assert not activation.done() and r.gate.in_flight == len(early)
        async with r.http.get(f"{r.url}/health") as resp:  # reads are not gated
            assert resp.status == 200 and HEADER_START not in resp.headers
        async with r.http.get(f"{r.url}{STATUS_PATH}") as resp:
            status = await resp.json()
        assert status["activating_version"] == 2 and status["commit_mode"] == "quiesce" and status["waiting"] == 4
        hold.set()
        await guarded(activation)  # everything in flight drained
        assert r.gate.in_flight == 0 and r.gate.waiting == len(late)  # newcomers still at the gate
        r.source.update(r.weights[2], 2)
        r.gate.end_activation(2)
        early_results = [await guarded(t) for t in early]
        late_results = [await guarded(t) for t in late]
    for res in early_results:
        assert_attributed(res, single_version=True)
        assert res.start == 1 and res.used and set(res.used) == {(1, 1)}
    for res in late_results[:3]:
        assert_attributed(res, single_version=True)
        assert res.start == 2 and set(res.used) == {(2, 2)}
    assert late_results[3].status == 409 and late_results[3].body["error"] == "WeightVersionUnavailable"


@pytest.mark.asyncio
async def test_in_place_activation_drains_pins_only_and_reports_spans() -> None:
    hold, hold_pins = asyncio.Event(), asyncio.Event()

    async def hook(prompt: tuple[int, ...], index: int) -> None:
        if index >= 1 and prompt[0] == HOLD:
            await hold.wait()
        if index >= 1 and prompt[0] == PIN_HOLD:
            await hold_pins.wait()

    async with rig(applied=1, hook=hook) as r:
        spanning = [
            asyncio.create_task(generate(r, [HOLD, 5, 1], 5, stream=True)),
            asyncio.create_task(generate(r, [HOLD, 6, 1], 5)),
            asyncio.create_task(generate(r, [HOLD, 7, 1], 5, min_version=1, stream=True)),
        ]
        pinned = [
            asyncio.create_task(generate(r, [PIN_HOLD, 5, 1], 4, exact=1, stream=True)),
            asyncio.create_task(generate(r, [PIN_HOLD, 6, 1], 4, exact=1, via_headers=True)),
        ]
        await guarded(r.gate.wait_until(lambda g: g.in_flight == 5 and g.pinned_in_flight == 2))
        activation = asyncio.create_task(r.gate.begin_activation("in_place", 2))
        await guarded(r.gate.wait_until(lambda g: g.activating == 2))
        late = [
            asyncio.create_task(generate(r, [FREE, 5, 1], 3, stream=True)),
            asyncio.create_task(generate(r, [FREE, 6, 1], 3, exact=2)),
            asyncio.create_task(generate(r, [FREE, 7, 1], 3, exact=1)),
        ]
        await guarded(r.gate.wait_until(lambda g: g.waiting == len(late)))
        assert not activation.done()
        hold_pins.set()
        await guarded(activation)  # pins drained; unpinned requests are still mid-generation
        assert r.gate.in_flight == len(spanning) and r.gate.pinned_in_flight == 0
        await r.engine.pause()
        r.source.update(r.weights[2], 2)
        r.gate.end_activation(2)
        r.engine.resume()
        hold.set()
        spans = [await guarded(t) for t in spanning]
        pins = [await guarded(t) for t in pinned]
        lates = [await guarded(t) for t in late]
    for res in spans:
        assert_attributed(res, single_version=False)
        assert (res.start, res.end) == (1, 2)
        assert res.used == [(1, 1)] + [(2, 2)] * 4  # the switch happened between tokens, as reported
    for res in pins:
        assert_attributed(res, single_version=True)
        assert res.start == 1 and set(res.used) == {(1, 1)}
    for res in lates[:2]:
        assert_attributed(res, single_version=True)
        assert res.start == 2 and set(res.used) == {(2, 2)}
    assert lates[2].status == 409 and lates[2].body["retryable"] is False


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["quiesce", "in_place"])
async def test_attribution_holds_under_concurrent_load(mode: CommitMode) -> None:
    rng = random.Random(f"sidecar-{mode}")
    n_clients, per_client = 10, 4
    done = 0
    progress = {k: asyncio.Event() for k in (5, 20)}
    async with rig(applied=1) as r:

        async def client(i: int) -> list[Result]:
            nonlocal done
            out = []
            for j in range(per_client):
                kind = rng.choice(["free", "min", "exact"])
                v = rng.choice([1, 2, 3])
                kw: dict[str, Any] = {"min_version": v} if kind == "min" else {"exact": v} if kind == "exact" else {}
                prompt = [FREE, 5 + (i + j) % 20, 1]
                out.append(await generate(r, prompt, rng.randint(1, 6), stream=rng.random() < 0.5, **kw))
                done += 1
                for k, ev in progress.items():
                    if done >= k:
                        ev.set()
            return out

        async def driver() -> None:
            await progress[5].wait()
            await r.activate(mode, 2)
            await progress[20].wait()
            await r.activate(mode, 3)

        gathered = await guarded(asyncio.gather(driver(), *(client(i) for i in range(n_clients))))
    results = [res for batch in gathered[1:] for res in batch]
    assert r.gate.applied == 3 and r.gate.in_flight == 0
    assert len(results) == n_clients * per_client and any(res.status == 200 for res in results)
    for res in results:
        if res.status == 200:
            assert_attributed(res, single_version=mode == "quiesce")
        else:
            assert res.status == 409 and res.body["error"] in ("WeightVersionNotReady", "WeightVersionUnavailable")
            assert not res.constraint.satisfied_by(res.body["applied_version"])


@pytest.mark.asyncio
async def test_malformed_constraints_get_400() -> None:
    async with rig(applied=1) as r:
        url = f"{r.url}/generate"
        base = {"prompt": [FREE, 1], "max_tokens": 1}
        header_cases = [{HEADER_EXACT: "abc"}, {HEADER_MIN: "-1"}, {HEADER_EXACT: "1.5"}, {HEADER_MIN: ""}]
        body_cases: list[Any] = [
            "2",
            {"exact_version": True},
            {"exact_version": 1.0},
            {"min_version": -1},
            {"min": 1},
            {"min_version": 3, "exact_version": 2},
        ]
        for headers in header_cases:
            async with r.http.post(url, json=base, headers=headers) as resp:
                assert resp.status == 400, headers
                assert (await resp.json())["error"] == "InvalidWeightVersion"
        for wv in body_cases:
            async with r.http.post(url, json=base | {"weight_version": wv}) as resp:
                assert resp.status == 400, wv
                body = await resp.json()
                assert body["error"] == "InvalidWeightVersion" and body["detail"]
        conflicting = base | {"weight_version": {"exact_version": 3}}
        async with r.http.post(url, json=conflicting, headers={HEADER_EXACT: "2"}) as resp:
            assert resp.status == 400 and "different values" in (await resp.json())["detail"]
        async with r.http.post(url, json=base, headers=[(HEADER_MIN, "1"), (HEADER_MIN, "2")]) as resp:
            assert resp.status == 400
        # compressed, a pin in the body is unseen here (and dropped by an engine that inflates it)
        pinned = gzip.compress(json.dumps(base | {"weight_version": {"exact_version": 9}}).encode())
        compressed = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        async with r.http.post(url, data=pinned, headers=compressed) as resp:
            assert resp.status == 400 and "uncompressed" in (await resp.json())["detail"]
        # an empty Content-Type: read as JSON by FastAPI (vLLM), so sniffed here, not passed on with the pin
        raw = json.dumps(base | {"weight_version": {"exact_version": "x"}}).encode()
        async with r.http.post(url, data=raw, headers={"Content-Type": ""}, skip_auto_headers=["Content-Type"]) as resp:
            assert resp.status == 400 and (await resp.json())["error"] == "InvalidWeightVersion"
        assert r.gate.in_flight == 0


@pytest.mark.asyncio
async def test_the_engines_control_routes_are_not_served_to_clients() -> None:
    # (forwarded before: any rollout client could pause the engine for everyone, or commit a version)
    async with rig(applied=1) as r:
        for path in ("/pause_generation", "//pause_generation/", "/x/../pause_generation", "/%70ause_generation",
                     "/patchswarm/v1/commit", "/update_weights_from_disk", "/collective_rpc"):  # fmt: skip
            async with r.http.post(r.url + path, json={"mode": "in_place", "version": 1}) as resp:
                assert resp.status == 403, path
                assert (await resp.json())["error"] == "EngineControlRoute"
        assert r.gate.in_flight == 0
        async with r.http.get(r.url + "/health") as resp:
            assert (await resp.json())["paused"] is False
        async with r.http.post(f"{r.url}/generate", json={"prompt": [FREE, 1], "max_tokens": 1}) as resp:
            assert resp.status == 200


@pytest.mark.asyncio
async def test_engine_errors_pass_through_with_versions() -> None:
    async with rig(applied=1) as r:
        async with r.http.post(f"{r.url}/generate", json={"prompt": [], "max_tokens": 1}) as resp:
            assert resp.status == 400
            assert (resp.headers[HEADER_START], resp.headers[HEADER_END]) == ("1", "1")
            body = await resp.json()
        assert body["error"] == "BadRequest" and body["weight_version"] == {"start": 1, "end": 1}
        async with r.http.post(f"{r.url}/generate", data=b"plain", headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 400 and resp.headers[HEADER_START] == "1"


@pytest.mark.asyncio
async def test_admission_timeout_is_503() -> None:
    async with rig(applied=1, gate=VersionGate(1, admission_timeout_s=0, retry_after_s=2)) as r:
        await r.gate.begin_activation("quiesce", 2)
        res = await generate(r, [FREE, 1], 1)
        assert res.status == 503 and res.headers["Retry-After"] == "2"
        assert res.body["error"] == "WeightActivationInProgress" and res.body["activating_version"] == 2
        r.gate.end_activation(1)
        assert_attributed(await generate(r, [FREE, 1], 1), single_version=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_dead_upstream_is_502_and_releases_the_ticket() -> None:
    gate = VersionGate(applied=4)
    sidecar = await start_sidecar(f"http://127.0.0.1:{closed_port()}", gate, connect_timeout_s=5)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{sidecar.url}/generate", json={"prompt": [1], "max_tokens": 1}) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"] == "UpstreamUnavailable"
            async with http.get(f"{sidecar.url}/health") as resp:
                assert resp.status == 502
        assert gate.in_flight == 0
    finally:
        await sidecar.close()
    with pytest.raises(ValueError, match="http"):
        await start_sidecar("localhost:1", gate)


@pytest.mark.asyncio
async def test_request_body_is_bounded() -> None:
    async with rig(applied=1, max_body_bytes=1024) as r:
        big = {"prompt": [FREE] * 600, "max_tokens": 1}
        async with r.http.post(f"{r.url}/generate", json=big) as resp:
            assert resp.status == 413 and (await resp.json())["error"] == "RequestTooLarge"
        assert r.gate.in_flight == 0


@pytest.mark.asyncio
async def test_large_responses_stream_without_end_header() -> None:
    async with rig(applied=1, max_buffered_response_bytes=16) as r:
        res = await generate(r, [FREE, 3, 1], 3)
        assert res.status == 200 and res.headers[HEADER_START] == "1" and HEADER_END not in res.headers
        assert "weight_version" not in res.body and len(res.body["tokens"]) == 3
        assert r.gate.in_flight == 0


@pytest.mark.asyncio
async def test_engine_json_the_sidecar_cannot_write_back_strictly_passes_untouched() -> None:
    """A bare NaN or a number past a double's range in an engine's answer: the sidecar never re-encodes
    it (its versions go in the headers only); strict JSON gets its weight_version as always."""
    nan, big, ok = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
    raw = {nan: b'{"x": NaN}', big: b'{"x": 1e999}', ok: b'{"x": 1.5}'}

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=raw[request.path], content_type="application/json")

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    engine = await serve_app(app, "127.0.0.1", 0)
    sidecar = await start_sidecar(engine.url, VersionGate(applied=3))
    try:
        async with aiohttp.ClientSession() as http:
            for path in (nan, big):
                async with http.post(sidecar.url + path, json={}) as resp:
                    assert resp.status == 200 and (resp.headers[HEADER_START], resp.headers[HEADER_END]) == ("3", "3")
                    assert await resp.read() == raw[path]
            async with http.post(sidecar.url + ok, json={}) as resp:
                assert json.loads(await resp.read()) == {"x": 1.5, "weight_version": {"start": 3, "end": 3}}
    finally:
        await sidecar.close()
        await engine.close()

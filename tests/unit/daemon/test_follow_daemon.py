"""The engines' loop beside their server (daemon/engine_client.py ``follow_daemon``: one for the
transformers engine and the reference engine): acknowledgements, re-registration, a daemon that fails."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from patchswarm.daemon.engine_client import follow_daemon
from patchswarm.daemon.store_format import StoreError


class FakeView:
    def __init__(self, handle: dict[str, Any] | None) -> None:
        self.handle = handle
        self.version: int | None = None

    def read_version(self) -> tuple[int, bytes] | None:
        return None if self.version is None else (self.version, b"r" * 32)


class FakeDaemon:
    """Answers as a daemon would, but fails every other layout call (down, restarting, nonsense)."""

    def __init__(self, buffer_id: int) -> None:
        self.acks: list[tuple[str, int]] = []
        self.registered: list[str] = []
        self.layouts = 0
        self.buffer_id = buffer_id
        self.lock = threading.Lock()

    def ack(self, engine: str, version: int) -> None:
        with self.lock:
            self.acks.append((engine, version))

    def layout(self) -> dict[str, Any]:
        with self.lock:
            self.layouts += 1
            n = self.layouts
        if n % 3 == 1:
            raise StoreError("no store layout from the daemon")
        if n % 3 == 2:
            return {"attach": "not an object"}  # (JSON, but not what the daemon sends)
        return {"attach": {"buffer": {"buffer_id": self.buffer_id}, "state": "empty"}}

    def register(self, view: FakeView, engine: str) -> dict[str, Any]:
        with self.lock:
            self.registered.append(engine)
            self.buffer_id = view.handle["buffer_id"] if view.handle else 0
        return {}


async def _run_until(task: asyncio.Task[None], done: Any) -> None:
    for _ in range(2000):
        if done():
            break
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done()


@pytest.mark.asyncio
async def test_acks_what_is_served_and_registers_a_buffer_the_daemon_lost() -> None:
    view, daemon = FakeView({"buffer_id": 7}), FakeDaemon(buffer_id=6)  # the store shows another buffer
    notes: list[str] = []
    served: list[int | None] = []

    def engine_serves(ready: int | None) -> int | None:
        served.append(ready)
        return None if ready is None else ready - 1  # (the engine's own word: one behind, say)

    task = asyncio.create_task(
        follow_daemon(daemon, view, "e1", served=engine_serves, every_s=0, on_register=notes.append)  # type: ignore[arg-type]
    )
    await _run_until(task, lambda: daemon.layouts >= 6)
    assert daemon.acks == []  # nothing ready: nothing acknowledged
    assert daemon.registered == ["e1"] and notes == ["empty"]  # once: then the store shows this buffer
    view.version = 5
    task = asyncio.create_task(follow_daemon(daemon, view, "e1", served=engine_serves, every_s=0))  # type: ignore[arg-type]
    await _run_until(task, lambda: daemon.acks != [])
    assert daemon.acks[0] == ("e1", 4) and set(daemon.acks) == {("e1", 4)}
    assert None in served and 5 in served


@pytest.mark.asyncio
async def test_a_host_store_view_acks_the_fence_version_and_never_registers() -> None:
    view, daemon = FakeView(None), FakeDaemon(buffer_id=1)
    view.version = 3
    task = asyncio.create_task(follow_daemon(daemon, view, "ref", every_s=0))  # type: ignore[arg-type]
    await _run_until(task, lambda: daemon.acks != [])
    assert daemon.acks[0] == ("ref", 3) and daemon.layouts == 0 and daemon.registered == []

"""The engine's client of the daemon's unix-socket API: find the store, attach or register, follow versions.

Blocking (http.client over AF_UNIX), so an engine needs no event loop to use it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon.engine import EngineView, allocate, attach
from patchswarm.daemon.store_format import StoreError
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

MAX_ANSWER_BYTES = 64 << 20  # a layout of a model with very many tensors stays well below
ACK_AGAIN_S = 5.0  # a restarted daemon has forgotten the acknowledgements


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class DaemonClient:
    """The engine's side of the daemon's unix-socket API (blocking; no event loop needed).

    ``open_store`` is the whole start-up: the layout, then attach (shm store) or allocate on the
    engine's device and register the buffer (engine stores: store.kind cuda / engine-shm).
    """

    def __init__(self, socket_path: str | Path, timeout: float = 30.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> tuple[int, Any]:
        conn = _UnixHTTPConnection(self.socket_path, self.timeout if timeout is None else timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read(MAX_ANSWER_BYTES + 1)
        finally:
            conn.close()
        try:  # (whatever listens on the socket path answers: read it as any outside JSON)
            return resp.status, load_json(raw, max_bytes=MAX_ANSWER_BYTES) if raw else None
        except UntrustedJSONError as e:
            raise StoreError(f"the daemon at {self.socket_path} answered {method} {path} with no JSON: {e}") from None

    def layout(self, wait_s: float = 0.0, poll_s: float = 0.2, rank: int | None = None) -> dict[str, Any]:
        """GET /v1/layout (of rank store ``rank``: a daemon with store.ranks > 1); retries while the
        daemon is down or has no layout yet, for up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        path = "/v1/layout" if rank is None else f"/v1/layout?rank={int(rank)}"
        while True:
            try:
                code, body = self.request("GET", path)
                if code == 400:
                    raise StoreError(f"the daemon refused the layout request: {body.get('message')}")
                if code == 200:
                    return dict(body)
                why = f"{code} {body}"
            except OSError as e:
                why = f"daemon not reachable at {self.socket_path}: {e}"
            if time.monotonic() >= deadline:
                raise StoreError(f"no store layout from the daemon: {why}")
            time.sleep(poll_s)

    def register(self, view: EngineView, engine: str, rank: int | None = None) -> dict[str, Any]:
        """POST /v1/store with the engine's buffer (for rank store ``rank``); a 4xx answer becomes a StoreError."""
        if view.handle is None:
            raise StoreError("only an engine-allocated view (allocate) has a buffer to register")
        body: dict[str, Any] = {"engine": engine, "layout_hash": view.layout.layout_hash.hex(), "buffer": view.handle}
        if rank is not None:
            body["rank"] = int(rank)
        code, answer = self.request("POST", "/v1/store", body)
        if code >= 400:
            raise StoreError(f"the daemon refused the buffer ({code} {answer.get('error')}): {answer.get('message')}")
        return dict(answer)

    def wait_version(self, version: int, timeout: float = 30.0) -> bool:
        """Long poll until the daemon has applied ``version`` (or newer)."""
        code, body = self.request("GET", f"/v1/wait?version={version}&timeout={timeout}", timeout=timeout + 10)
        return code == 200 and bool(body["reached"])

    def ack(self, engine: str, version: int) -> None:
        self.request("POST", "/v1/ack", {"engine": engine, "version": version})

    def open_store(
        self, device: torch.device | str = "cpu", engine: str = "engine", wait_s: float = 60.0, rank: int | None = None
    ) -> EngineView:
        """Map the daemon's store (rank ``rank``'s, for a tensor-parallel engine's rank): attach to a host
        store, or allocate on ``device`` and register."""
        return self.open_store_answer(device, engine, wait_s, rank)[0]

    def open_store_answer(
        self, device: torch.device | str = "cpu", engine: str = "engine", wait_s: float = 60.0, rank: int | None = None
    ) -> tuple[EngineView, dict[str, Any]]:
        """``open_store`` and the layout answer it mapped (a rank's answer carries its plan routing)."""
        answer = self.layout(wait_s, rank=rank)
        info = answer["attach"]
        if info["kind"] == "shm":
            return attach(info), answer
        view = allocate(info, device)
        try:
            self.register(view, engine, rank)
        except BaseException:
            view.close()
            raise
        return view, answer


async def follow_daemon(
    client: DaemonClient,
    view: EngineView,
    engine: str,
    *,
    served: Callable[[int | None], int | None] = lambda ready: ready,
    every_s: float = 0.2,
    on_register: Callable[[str], None] = lambda state: None,
) -> None:
    """An engine's loop beside its server, until cancelled: acknowledge the version it serves (POST
    /v1/ack, again every ACK_AGAIN_S) and, for an engine-allocated buffer, register it again when the
    daemon's store shows none or another one (a store re-created, a registration lost; a restarted
    daemon re-imports the buffer by itself, so this is the fallback).  ``served``: given the version the
    fence shows ready (None: none), the version the engine serves (default: that one); ``on_register``:
    told the store's state after a new registration.  A daemon down, restarting or answering nonsense
    is tried again; the engine keeps serving."""
    loop = asyncio.get_running_loop()
    acked, acked_at = None, 0.0
    while True:
        try:
            got = view.read_version()
            now_serving = served(None if got is None else got[0])
            if now_serving is not None and (now_serving != acked or loop.time() - acked_at > ACK_AGAIN_S):
                await asyncio.to_thread(client.ack, engine, now_serving)
                acked, acked_at = now_serving, loop.time()
            if view.handle is not None:
                info = (await asyncio.to_thread(client.layout))["attach"]
                buf = info.get("buffer")
                if buf is None or buf.get("buffer_id") != view.handle["buffer_id"]:
                    await asyncio.to_thread(client.register, view, engine)
                    on_register(str(info.get("state")))
        except (StoreError, OSError, KeyError, ValueError, TypeError, AttributeError):
            pass  # (AttributeError: an answer that is JSON but not an object)
        await asyncio.sleep(every_s)

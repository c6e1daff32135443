"""The engine drivers the rollout daemon runs (the contract is daemon/engine_driver.py): ``none``
and ``zero-copy``, and ``make_driver`` choosing one from the config's ``engine`` section (``vllm``
and ``sglang``, engines that copy regions from the store, live in daemon/copy_drivers.py).

- ``none``: no engine under control; the version served is the store's (the daemon's behaviour
  before drivers).  With ``sidecar.commit_mode`` in_place it still pauses the engine through
  SGLang's routes (``/pause_generation``, ``/continue_generation``), as before.
- ``zero-copy``: an engine that computes straight from the store (daemon/refengine.py, the
  transformers engine): the same pause routes, plus ``POST /patchswarm/v1/commit`` and
  ``GET /patchswarm/v1/version``.

Every call is bounded (``engine.commit_timeout`` for a commit, ``ENGINE_CALL_TIMEOUT_S`` for the
others) and a failure is one ``EngineError`` line naming the URL and what the engine answered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from patchswarm.daemon.engine_driver import Activation, EngineDriver, EngineError
from patchswarm.daemon.engine_http import parse_answer, read_answer
from patchswarm.daemon.payloads import EngineRequest, sglang_continue_generation, sglang_pause_generation
from patchswarm.daemon.user_error import UserError
from patchswarm.swarm.client_errors import describe

log = logging.getLogger("patchswarm.daemon")

# A pause waits for the engine's step in progress; beyond this the engine is taken as unresponsive.
ENGINE_CALL_TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 64 << 10  # a control answer is a small JSON object
KINDS = ("none", "zero-copy", "vllm", "sglang")


class _Http:
    """One engine's control routes over one aiohttp session (opened on first use, in the daemon's loop)."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url.rstrip("/"), what
        self._session: aiohttp.ClientSession | None = None

    async def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = ENGINE_CALL_TIMEOUT_S
    ) -> tuple[int, Any]:
        """(status, JSON answer or None); EngineError when the engine cannot be reached or hangs."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.request(
                method, self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                raw, over = await read_answer(resp, MAX_ANSWER_BYTES)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"{self.what} {path} at {self.url}: {describe(e) or type(e).__name__}") from e
        if over:
            raise EngineError(f"{self.what} {path} at {self.url} answered over {MAX_ANSWER_BYTES} bytes")
        return status, parse_answer(raw, MAX_ANSWER_BYTES)

    async def expect_ok(self, method: str, path: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        status, answer = await self.call(method, path, body, **kw)
        if status >= 400:
            raise EngineError(f"{self.what} {path} at {self.url} answered {status}: {_said(answer)}")
        return answer

    async def send(self, req: EngineRequest) -> Any:
        return await self.expect_ok(req.method, req.path, req.json)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _said(answer: Any) -> str:
    """What an engine's error answer says, in at most 200 characters."""
    if isinstance(answer, dict):
        text = "; ".join(str(answer[k]) for k in ("error", "message", "detail") if k in answer) or json.dumps(answer)
        text = " ".join(text.split())
    else:
        text = str(answer)
    return text[:200]


class NoEngine:
    """No engine under control: the version served is the store's; in_place pauses as SGLang's routes."""

    name = "none"
    copies = False  # (no engine copies anything: Activation.regions are not built for it)

    def __init__(self, store_version: Callable[[], int | None], url: str) -> None:
        self._store_version = store_version
        self._http = _Http(url, "sidecar.commit_mode 'in_place' needs the engine's")

    async def served_version(self) -> int | None:
        return self._store_version()

    async def pause(self) -> None:
        await self._http.send(sglang_pause_generation("in_place"))

    async def commit(self, activation: Activation) -> int:
        return activation.version

    async def resume(self) -> None:
        await self._http.send(sglang_continue_generation())

    async def close(self) -> None:
        await self._http.close()


COMMIT_PATH = "/patchswarm/v1/commit"
VERSION_PATH = "/patchswarm/v1/version"


class ZeroCopyEngine:
    """An engine reading the store itself: a commit asks it to confirm the fence shows the version."""

    name = "zero-copy"
    copies = False  # (the engine reads the store: Activation.regions are not built for it)

    def __init__(self, url: str, *, commit_timeout_s: float = ENGINE_CALL_TIMEOUT_S) -> None:
        self._http = _Http(url, "engine.url")
        self.commit_timeout_s = commit_timeout_s

    async def served_version(self) -> int | None:
        answer = await self._http.expect_ok("GET", VERSION_PATH)
        v = answer.get("version") if isinstance(answer, dict) else "?"
        if v is not None and (type(v) is not int or v < 0):
            raise EngineError(f"engine.url {VERSION_PATH} answered no version: {_said(answer)}")
        return v

    async def pause(self) -> None:
        await self._http.send(sglang_pause_generation("in_place"))

    async def commit(self, activation: Activation) -> int:
        body = {"version": activation.version, "flush_cache": activation.flush_cache}
        answer = await self._http.expect_ok("POST", COMMIT_PATH, body, timeout_s=self.commit_timeout_s)
        ack = answer.get("version") if isinstance(answer, dict) else None
        if ack != activation.version:
            raise EngineError(f"engine.url {COMMIT_PATH} acknowledged {ack!r}, not version {activation.version}")
        return activation.version

    async def resume(self) -> None:
        await self._http.send(sglang_continue_generation())

    async def close(self) -> None:
        await self._http.close()


def copies_regions(driver: object) -> bool:
    """Whether ``driver``'s engine copies changed bytes into its own parameters, so the daemon builds
    ``Activation.regions`` for it: a driver says ``copies = False`` when its engine reads the store
    (the default, for drivers that say nothing, is to build them)."""
    return bool(getattr(driver, "copies", True))


def make_driver(cfg: Any, store_version: Callable[[], int | None]) -> EngineDriver:
    """The driver the config names (``engine.kind``); ``store_version``: the store's version, for ``none``."""
    kind = cfg["engine.kind"]
    url = cfg["engine.url"] or cfg["sidecar.upstream"]
    if kind == "none":
        return NoEngine(store_version, url)
    if kind == "zero-copy":
        return ZeroCopyEngine(url, commit_timeout_s=cfg["engine.commit_timeout"])
    if kind in ("vllm", "sglang"):
        # Copy engines: each worker maps its rank's store once, through this daemon's API socket
        # (daemon/param_sync.py open_rank_store), and copies the regions of each version.
        from patchswarm.daemon import copy_drivers

        spec = json.dumps({"socket": cfg["api.socket"], "ranks": cfg["store.ranks"], "engine": kind, "wait_s": 60})
        apply_s = cfg["engine.commit_timeout"]
        if kind == "vllm":
            return copy_drivers.make_vllm_driver(url, cfg["store.ranks"], spec, apply_s=apply_s)
        return copy_drivers.make_sglang_driver(
            url, cfg["store.ranks"], spec, apply_s=apply_s, pause_mode=cfg["engine.pause_mode"]
        )
    raise UserError(f"engine.kind: unknown engine {kind!r}")

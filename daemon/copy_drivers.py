"""Engine drivers for vLLM and SGLang (daemon/engine_driver.py's contract) over their HTTP routes.

Both engines copy a version into their own parameters (daemon/param_sync.py, run inside the engine:
vLLM workers through daemon/vllm_worker.py, SGLang schedulers through daemon/sglang_loader.py).
Routes, read in the engines' sources (vLLM 0.34, SGLang 0.5.23):

- vLLM: ``POST /pause?mode=keep`` and ``POST /resume`` (vllm/entrypoints/rl/online/api_router.py);
  ``POST /collective_rpc`` (dev mode, vllm/entrypoints/serve/dev/rpc/api_router.py) calling the worker
  extension; ``POST /reset_prefix_cache?reset_running_requests=...`` -> ``{"success": bool}``
  (vllm/entrypoints/serve/dev/cache/api_router.py; without resetting running requests it fails
  while paused requests hold blocks); ``POST /update_weight_version {"new_version"}`` and
  ``GET /weight_info`` -> ``{"weight_version"}``.
  https://github.com/vllm-project/vllm/tree/main/vllm/entrypoints
- SGLang: ``POST /pause_generation {"mode"}``, ``/continue_generation``, ``/begin_weight_update``,
  ``/update_weights_from_tensor`` (``load_format`` = the custom loader, ``flush_cache``,
  ``weight_version``), ``/end_weight_update``, ``GET /model_info`` -> ``weight_version``
  (sglang/srt/entrypoints/http_server.py, sglang/srt/managers/io_struct.py).
  https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/entrypoints/http_server.py

A failed commit raises EngineError and sets no weight version.  When parameters may have been
partly written (``copied``), the next commit copies every entry whole (the store holds the
version the daemon retries), so the engine never keeps torn weights across a successful commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import torch

from patchswarm.daemon.engine_driver import Activation, EngineError
from patchswarm.daemon.engine_http import MAX_TEXT, one_line, parse_answer, read_answer
from patchswarm.daemon.param_sync import apply_wire
from patchswarm.daemon.payloads import EngineRequest, serialize_ipc
from patchswarm.daemon.sglang_loader import entry_name

LOADER = "patchswarm.daemon.sglang_loader.load_regions"
MAX_ANSWER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Timeouts:
    control_s: float = 30.0  # pause, resume, version, cache
    apply_s: float = 120.0  # the copy on every rank (a full reload of a large model takes longer)


def parse_version(value: object) -> int | None:
    """An engine's weight version as the daemon's version number (None: unset or not ours)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit() and len(value) < 20:
        return int(value)
    return None


class _Http:
    """One aiohttp session to one engine; every non-2xx answer or transport error is one EngineError line."""

    def __init__(self, url: str, timeouts: Timeouts) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must be http(s)://host:port, not {url[:100]!r}")
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self.session: aiohttp.ClientSession | None = None

    async def call(self, req: EngineRequest, timeout_s: float | None = None) -> Any:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        t = aiohttp.ClientTimeout(total=timeout_s or self.timeouts.control_s)
        try:
            async with self.session.request(
                req.method, self.url + req.path, json=req.json, params=req.params or None, timeout=t
            ) as resp:
                raw, over = await read_answer(resp, MAX_ANSWER_BYTES)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"{req.method} {req.path}: {type(e).__name__}: {e}"[:300]) from None
        answer = parse_answer(raw, MAX_ANSWER_BYTES)
        if not 200 <= status < 300:
            text = " ".join(raw[:MAX_TEXT].decode("utf-8", "replace").split())
            raise EngineError(f"{req.method} {req.path}: HTTP {status}: {text}")
        if over:
            raise EngineError(f"{req.method} {req.path}: answer over {MAX_ANSWER_BYTES} bytes")
        return answer

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def _field(answer: Any, key: str) -> Any:
    return answer.get(key) if isinstance(answer, dict) else None


# ---------------------------------------------------------------- vLLM


def _whole(a: Activation, full: bool) -> Activation:
    """``a``, or ``a`` copying every entry (a first load, or after a commit that may have torn them)."""
    return Activation(a.version, a.previous, True, {}, a.flush_cache) if full and not a.full else a


def vllm_requests(activation: Activation, ranks: int, apply_timeout_s: float, *, full: bool) -> list[EngineRequest]:
    """The calls of one vLLM commit after the pause: apply on every worker, cache reset, version."""
    body = {"method": "patchswarm_apply", "args": [apply_wire(_whole(activation, full))], "timeout": apply_timeout_s}
    out = [EngineRequest("POST", "/collective_rpc", body)]
    if activation.flush_cache:
        out.append(EngineRequest("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}))
    out.append(EngineRequest("POST", "/update_weight_version", {"new_version": str(activation.version)}))
    return out


def check_rank_results(answer: Any, ranks: int, version: int) -> bool:
    """Whether every rank applied ``version``; EngineError naming the first rank that did not.
    Returns whether any failed rank may have written parameters (never, when it returns)."""
    results = _field(answer, "results")
    if not isinstance(results, list) or len(results) != ranks:
        raise EngineError(f"collective_rpc: expected {ranks} worker results, got {one_line(answer)}")
    seen: set[int] = set()
    bad = [r for r in results if not isinstance(r, dict) or r.get("ok") is not True]
    if bad:
        first = bad[0]
        why = one_line(first.get("error") if isinstance(first, dict) else first)
        raise _Partial(
            f"a worker did not apply version {version}: {why}",
            any(not isinstance(r, dict) or r.get("copied") is not False for r in bad) or len(bad) < ranks,
        )
    for r in results:
        if type(r.get("version")) is not int or r["version"] != version or type(r.get("rank")) is not int:
            raise EngineError(f"collective_rpc: a worker reports {one_line(r)}, not version {version}")
        seen.add(r["rank"])
    if seen != set(range(ranks)):
        raise _Partial(f"workers reported ranks {sorted(seen)}, not 0..{ranks - 1}", True)
    return False


def check_attach_results(answer: Any, ranks: int) -> None:
    """Every worker attached; at TP > 1 none needs vLLM's loader (its ``load_weights`` takes checkpoint
    tensors and shards them itself, which a rank's runtime entry is not) unless the worker has the plan's
    routing of those entries (``loader_routed``: it rebuilds their canonical tensors): EngineError otherwise."""
    results = _field(answer, "results")
    if not isinstance(results, list) or len(results) != ranks or not all(isinstance(r, dict) for r in results):
        raise EngineError(f"patchswarm_attach: expected {ranks} worker results, got {one_line(answer)}")
    reported = [r.get("rank") for r in results]
    if not all(type(r) is int for r in reported) or sorted(reported) != list(range(ranks)):
        raise EngineError(f"patchswarm_attach: workers report ranks {one_line(reported[:16])}")
    loaded = [r for r in results if r.get("loader_count") and r.get("loader_routed") is not True]
    if loaded and ranks > 1:
        first = loaded[0]
        names = first.get("loader")
        example = names[0] if isinstance(names, list) and names else "?"
        raise EngineError(
            f"rank {first['rank']}: {one_line(first.get('loader_count'), 20)} store entries do not match vLLM's "
            f"parameters (first: {one_line(example, 120)}); vLLM's loader cannot take a shard at TP > 1"
        )


class _Partial(EngineError):
    """A commit that may have written part of the parameters (the next commit reloads every entry)."""

    def __init__(self, message: str, copied: bool) -> None:
        super().__init__(message)
        self.copied = copied


class VllmEngine:
    """Drives vLLM started with the worker extension, dev mode and (``attach``) one store per TP rank."""

    name = "vllm"

    def __init__(self, url: str, ranks: int, attach_spec: str, timeouts: Timeouts | None = None) -> None:
        self.http = _Http(url, timeouts or Timeouts())
        self.ranks = ranks
        self.attach_spec = attach_spec
        self.attached = False
        self.torn = False  # parameters may be part written: the next commit copies everything

    async def served_version(self) -> int | None:
        return parse_version(_field(await self.http.call(EngineRequest("GET", "/weight_info")), "weight_version"))

    async def pause(self) -> None:
        await self.http.call(EngineRequest("POST", "/pause", params={"mode": "keep"}))

    async def resume(self) -> None:
        await self.http.call(EngineRequest("POST", "/resume", {}))

    async def attach(self) -> None:
        """Every worker maps its rank's store (once); EngineError when one cannot."""
        req = EngineRequest("POST", "/collective_rpc", {"method": "patchswarm_attach", "args": [self.attach_spec]})
        check_attach_results(await self.http.call(req, self.http.timeouts.apply_s), self.ranks)
        self.attached = True

    async def commit(self, activation: Activation) -> int:
        if not self.attached:
            await self.attach()
        apply_s = self.http.timeouts.apply_s
        apply, *rest = vllm_requests(activation, self.ranks, apply_s, full=self.torn)
        try:
            answer = await self.http.call(apply, apply_s + 5)
            results = _field(answer, "results")
            if isinstance(results, list) and any(isinstance(r, dict) and r.get("attached") is False for r in results):
                self.attached = False  # a worker without the store (vLLM restarted): attach again next time
            check_rank_results(answer, self.ranks, activation.version)
        except _Partial as e:
            self.torn = self.torn or e.copied
            raise EngineError(f"vLLM stays on version {activation.previous}: {e}") from None
        except EngineError as e:  # transport or HTTP error: the workers' state is unknown
            self.torn = True
            raise EngineError(f"vLLM stays on version {activation.previous}: {e}") from None
        self.torn = False
        try:
            for req in rest:
                answer = await self.http.call(req)
                if req.path == "/reset_prefix_cache" and _field(answer, "success") is not True:
                    raise EngineError(f"vLLM did not reset its prefix cache: {one_line(answer)}")
        except EngineError as e:  # the weights are the new version's, its label is not: copy again on retry
            self.torn = True
            raise EngineError(f"vLLM has not committed version {activation.version}: {e}") from None
        return activation.version

    async def close(self) -> None:
        await self.http.close()


# ---------------------------------------------------------------- SGLang


def sglang_update_request(activation: Activation, ranks: int, attach_spec: str, *, full: bool) -> EngineRequest:
    """``POST /update_weights_from_tensor`` for the custom loader: one entry per TP rank, each a pickled
    ``[(<JSON: attach spec, apply text, rank>, <empty tensor>)]`` (SGLang's MultiprocessingSerializer form)."""
    text = apply_wire(_whole(activation, full))
    entries = [serialize_ipc([(entry_name(attach_spec, text, r), torch.empty(0))]) for r in range(ranks)]
    body = {"serialized_named_tensors": entries, "load_format": LOADER, "flush_cache": activation.flush_cache,
            "abort_all_requests": False, "weight_version": str(activation.version)}  # fmt: skip
    return EngineRequest("POST", "/update_weights_from_tensor", body)


class SglangEngine:
    """Drives SGLang started with ``--custom-weight-loader patchswarm.daemon.sglang_loader.load_regions``."""

    name = "sglang"

    def __init__(
        self,
        url: str,
        ranks: int,
        attach_spec: str,
        timeouts: Timeouts | None = None,
        *,
        pause_mode: Literal["in_place", "retract"] = "in_place",
        session: bool = True,
    ) -> None:
        self.http = _Http(url, timeouts or Timeouts())
        self.ranks, self.attach_spec, self.pause_mode = ranks, attach_spec, pause_mode
        self.session = session  # SGLang >= 0.5.2x wants begin/end_weight_update around an update
        self.torn = False

    async def served_version(self) -> int | None:
        return parse_version(_field(await self.http.call(EngineRequest("GET", "/model_info")), "weight_version"))

    async def pause(self) -> None:
        await self.http.call(EngineRequest("POST", "/pause_generation", {"mode": self.pause_mode}))

    async def resume(self) -> None:
        await self.http.call(EngineRequest("POST", "/continue_generation", {}))

    async def commit(self, activation: Activation) -> int:
        prefix = f"SGLang stays on version {activation.previous}"
        if self.session:
            answer = await self.http.call(EngineRequest("POST", "/begin_weight_update", {}))
            if _field(answer, "success") is False:
                raise EngineError(f"{prefix}: begin_weight_update: {one_line(_field(answer, 'message'))}")
        req = sglang_update_request(activation, self.ranks, self.attach_spec, full=self.torn)
        # From here until the version reads back, the parameters may be part (or all) the new version's
        # under the old label: torn (the daemon keeps its sidecar closed; the next commit copies whole).
        self.torn = True
        try:
            answer = await self.http.call(req, self.http.timeouts.apply_s)
        except EngineError as e:
            raise EngineError(f"{prefix}: {e}") from None
        finally:
            if self.session:
                await self.http.call(EngineRequest("POST", "/end_weight_update", {}))
        if _field(answer, "success") is not True:
            raise EngineError(f"{prefix}: update_weights_from_tensor: {one_line(_field(answer, 'message'))}")
        got = await self.served_version()
        if got != activation.version:
            raise EngineError(f"SGLang reports weight version {got} after the update to {activation.version}")
        self.torn = False
        return activation.version

    async def close(self) -> None:
        await self.http.close()


# ---------------------------------------------------------------- for the integrator (engine.kind)


def make_vllm_driver(
    url: str, ranks: int, attach_spec: str, control_s: float = 30.0, apply_s: float = 120.0
) -> VllmEngine:
    return VllmEngine(url, ranks, attach_spec, Timeouts(control_s, apply_s))


def make_sglang_driver(
    url: str,
    ranks: int,
    attach_spec: str,
    control_s: float = 30.0,
    apply_s: float = 120.0,
    pause_mode: str = "in_place",
) -> SglangEngine:
    if pause_mode not in ("in_place", "retract"):
        raise ValueError("engine pause mode must be in_place or retract")
    mode: Literal["in_place", "retract"] = "in_place" if pause_mode == "in_place" else "retract"
    return SglangEngine(url, ranks, attach_spec, Timeouts(control_s, apply_s), pause_mode=mode)

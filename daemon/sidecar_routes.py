"""Which paths the sidecar forwards to the engine: an allow list, with the engines' control routes denied.

The sidecar fails closed.  It forwards only the inference and metadata routes below (and those the
operator adds with ``sidecar.allow_routes``); every other path is answered 404 by the sidecar without
reaching the engine.  A deny list alone would fail open: SGLang and vLLM add control routes (load
weights, pause, RPC into the workers) in new releases, and each would be served to every rollout
client until someone listed it.  ``CONTROL_ROUTES`` stays as a second guard that wins over the allow
list, also over operator-added routes.

A path is matched after :func:`normalize`, the one normalization both lists use: percent-decoded by
the caller (aiohttp's ``request.path``; the raw path is checked too), empty segments dropped (``//``),
dot segments resolved, no trailing slash.  Exact routes match only themselves; a prefix route
``P`` (written ``P/*`` by the operator) matches every path strictly below it, ``P/...``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass

# The engines' control routes: the daemon drives them on the engine directly (engine.url), and a rollout
# client must not (pause every request, commit a version, or load weights no signature checked: SGLang's
# /update_weights_from_disk, vLLM dev mode's /collective_rpc).
CONTROL_ROUTES = frozenset(
    {
        # the drivers' (daemon/engine_drivers.py, daemon/copy_drivers.py, daemon/payloads.py)
        "/pause", "/resume", "/pause_generation", "/continue_generation", "/patchswarm/v1/commit",
        "/collective_rpc", "/reset_prefix_cache", "/flush_cache", "/begin_weight_update", "/start_weight_update",
        "/end_weight_update", "/finish_weight_update", "/update_weights", "/update_weights_from_tensor",
        "/update_weight_version", "/init_weight_transfer_engine",
        # weights, memory and process state from elsewhere in SGLang and vLLM
        "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_ipc",
        "/init_weights_update_group", "/destroy_weights_update_group", "/release_memory_occupation",
        "/resume_memory_occupation", "/sleep", "/wake_up", "/load_lora_adapter", "/unload_lora_adapter",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile",
        "/set_internal_state", "/configure_logging", "/slow_down", "/abort_request", "/scale_elastic_ep",
        "/reset_mm_cache",
        # SGLang's (python/sglang/srt/entrypoints/http_server.py): weights sent to an address the caller
        # names, cache storage cleared, the collector frozen, expert-distribution recording
        "/send_weights_to_remote_instance", "/init_weights_send_group_for_remote_instance",
        "/clear_hicache_storage_backend", "/freeze_gc", "/start_expert_distribution_record",
        "/stop_expert_distribution_record", "/dump_expert_distribution_record",
    }
)  # fmt: skip
# The words of a control action.  An operator's route naming one is refused at start-up even when no name
# above matches it: the engines add control routes each release (a list of names is always one behind),
# and every one so far names what it does with one of these (each of CONTROL_ROUTES does; a test checks).
# Metadata and inference routes (get_server_info, get_weights_by_name, sessions, files) name none.
CONTROL_WORDS = frozenset(
    {
        "update", "init", "destroy", "send", "release", "resume", "pause", "continue", "sleep", "wake",
        "unload", "flush", "clear", "reset", "freeze", "abort", "slow", "scale", "configure", "profile",
        "record", "rpc", "commit", "lora", "occupation", "internal",
    }
)  # fmt: skip

# What rollout clients need: the OpenAI-compatible inference routes vLLM and SGLang serve
# (vllm/entrypoints/openai/api_server.py, sglang/srt/entrypoints/http_server.py), SGLang's native
# /generate (also the reference engine's, daemon/refengine.py), health and model metadata, and the
# transformers engine's debug forward pass and served version (daemon/openai_api.py; make demo reads
# logits through the sidecar).  Left out on purpose: /metrics (the engines' Prometheus counters, queue
# depths and adapter names are the operator's, not every rollout client's: scrape the engine directly),
# /get_server_info and /server_info (SGLang returns asdict(server_args), its API key among them), SGLang's
# /get_weights_by_name, sessions, files and batches (state on the engine host), and vLLM's /invocations
# and /load.  An operator adds any of them with sidecar.allow_routes.
DEFAULT_ROUTES = frozenset(
    {
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
        "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/pooling", "/classify", "/v1/classify",
        "/encode", "/v1/audio/transcriptions", "/v1/audio/translations", "/tokenize", "/detokenize",
        "/v1/tokenize", "/v1/detokenize", "/generate", "/health", "/health_generate", "/ping", "/version",
        "/get_model_info", "/model_info", "/get_weight_version",
        "/patchswarm/v1/logits", "/patchswarm/v1/version",
    }
)  # fmt: skip
# Routes with legitimate subpaths: SGLang's GET /v1/models/{model:path} (a model id may hold a slash),
# the Responses API's GET /v1/responses/{id} and POST /v1/responses/{id}/cancel (vLLM).
DEFAULT_PREFIXES = frozenset({"/v1/models", "/v1/responses"})

MAX_ROUTE_CHARS = 256
MAX_EXTRA_ROUTES = 64
OPTION = "sidecar.allow_routes"
# An operator's route as the normalization leaves it: segments of URL path characters, no '%' (matching
# is on the decoded path, so an encoded route could never match), an optional '/*' for its subpaths.
_ROUTE = re.compile(r"(/[A-Za-z0-9._~!$&'()+,;=:@-]+)+(/\*)?")


def normalize(path: str) -> str:
    """``path`` as the engines' routers resolve it: empty and dot segments gone, no trailing slash
    (``""`` for the root)."""
    return posixpath.normpath("/" + "/".join(p for p in path.split("/") if p)).rstrip("/")


def control_route(path: str) -> bool:
    """Whether ``path`` (decoded) names one of CONTROL_ROUTES for the engine's router."""
    return normalize(path) in CONTROL_ROUTES


def check_route(route: str) -> str:
    """An operator's route, refused (ValueError, one line) unless it is a normalized path of at most
    MAX_ROUTE_CHARS that is no control route and, as ``P/*``, has none below it."""
    shown = repr(route[:80]) + ("..." if len(route) > 80 else "")
    if len(route) > MAX_ROUTE_CHARS:
        raise ValueError(f"route {shown} is longer than {MAX_ROUTE_CHARS} characters")
    if not route.startswith("/"):
        raise ValueError(f"route {shown} must start with '/'")
    base = route.removesuffix("/*")
    if not _ROUTE.fullmatch(route) or normalize(base) != base:
        raise ValueError(
            f"route {shown} must be a plain path: segments of letters, digits and ._~!$&'()+,;=:@- "
            "(no %, no empty, '.' or '..' segments, no trailing '/'), optionally ending in '/*'"
        )
    below = sorted(c for c in CONTROL_ROUTES if c == base or (route.endswith("/*") and c.startswith(base + "/")))
    if below:
        raise ValueError(f"route {shown} would serve the engine control route {below[0]} (the daemon's alone)")
    words = sorted(set(route_words(base)) & CONTROL_WORDS)
    if words:
        raise ValueError(f"route {shown} names the engine control action {words[0]!r} (the daemon's alone)")
    return route


def route_words(path: str) -> list[str]:
    """The words of ``path``, lowercased: its runs of letters and digits (``/v1/update_lora`` -> v1,
    update, lora)."""
    return re.findall(r"[a-z0-9]+", path.lower())


def check_routes(routes: Iterable[str]) -> tuple[str, ...]:
    """Every route checked (:func:`check_route`), at most MAX_EXTRA_ROUTES, duplicates dropped."""
    out: list[str] = []
    for route in routes:
        if not isinstance(route, str):
            raise ValueError(f"a route must be a string, got {route!r:.80}")
        if len(out) == MAX_EXTRA_ROUTES:
            raise ValueError(f"more than {MAX_EXTRA_ROUTES} routes")
        if check_route(route) not in out:
            out.append(route)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """The routes a sidecar forwards: exact routes and prefixes (paths strictly below them)."""

    exact: frozenset[str]
    prefixes: frozenset[str]

    @classmethod
    def with_routes(cls, extra: Iterable[str] = ()) -> RoutePolicy:
        """The defaults plus the operator's ``extra`` routes (checked: ValueError naming the bad one)."""
        added = check_routes(extra)
        exact = DEFAULT_ROUTES | {r for r in added if not r.endswith("/*")}
        prefixes = DEFAULT_PREFIXES | {r.removesuffix("/*") for r in added if r.endswith("/*")}
        return cls(frozenset(exact), frozenset(prefixes))

    def allows(self, path: str) -> bool:
        """Whether the decoded ``path`` is forwarded: on the list after :func:`normalize`, and no control
        route (the deny list wins)."""
        clean = normalize(path)
        if clean in CONTROL_ROUTES:
            return False
        return clean in self.exact or any(clean.startswith(p + "/") for p in self.prefixes)

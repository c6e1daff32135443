"""The rollout daemon's configuration keys: every key declared once in ``SCHEMA`` with its section,
parser, default and documentation (docs/daemon.md embeds ``reference_markdown``), and the
``PATCHSWARM_*`` environment variables known outside it."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from patchswarm.daemon.config_values import (
    choice,
    count_in,
    parse_board_urls,
    parse_bool,
    parse_device,
    parse_devices,
    parse_duration,
    parse_listen,
    parse_name,
    parse_plan,
    parse_positive_duration,
    parse_rate,
    parse_routes,
    parse_run_id,
    parse_size,
    parse_str,
    parse_url,
    parse_urls,
)
from patchswarm.protocol.node_config import NodeConfig


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    parse: Callable[[Any], Any]
    default: Any
    doc: str
    required: bool = False

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"PATCHSWARM_{self.section}_{self.name}".upper()


_NODE = NodeConfig("", "", b"")  # the swarm's own defaults, which the keys below mirror


_SCHED = _NODE.scheduler


SCHEMA: list[Key] = [
    Key("node", "name", parse_name, None, "Node id in the swarm (default: the host name)."),
    Key("node", "listen", parse_listen, "0.0.0.0:8701", "Address the swarm endpoints listen on (IPv6: [::]:8701)."),
    Key("node", "advertise", parse_url, None, "URL peers use to reach this node (default: from listen)."),
    Key("node", "region", parse_str, "", "Region label; peers in the same region are preferred."),
    Key("node", "zone", parse_str, "", "Zone label; peers in the same zone are preferred first."),
    Key("swarm", "run_id", parse_run_id, None, "The training run whose versions this host follows.", required=True),
    Key("swarm", "bootstrap", parse_urls, [], "Swarm URLs of peers or the seed to join through."),
    Key(
        "swarm",
        "seed_urls",
        parse_board_urls,
        [],
        "Board URLs polled for the head: http(s) (a seed, nginx, a CDN) or s3:// gs:// az://.",
    ),
    Key(
        "swarm",
        "cluster_secret_file",
        parse_str,
        None,
        "File with the cluster secret (>= 16 bytes) that authenticates gossip.",
        required=True,
    ),
    Key("swarm", "upload_rate", parse_rate, 0, "Upload limit in bytes/s ('100MB'); 0 = unlimited."),
    Key("swarm", "download_rate", parse_rate, 0, "Download limit in bytes/s; 0 = unlimited."),
    Key("swarm", "max_uploads", count_in(0, 1024), _NODE.max_uploads, "Concurrent chunk uploads to peers; 0 = none."),
    Key(
        "swarm",
        "upload_queue",
        count_in(0, 1024),
        _NODE.upload_queue,
        "Requests that wait for an upload slot; past them a request is refused (busy) and asks elsewhere.",
    ),
    Key("swarm", "max_inflight", count_in(1, 1024), _SCHED.max_inflight, "Chunk requests in flight to this region."),
    Key(
        "swarm",
        "max_inflight_per_peer",
        count_in(1, 64),
        _SCHED.max_inflight_per_peer,
        "Requests in flight to one peer of this region.",
    ),
    Key(
        "swarm",
        "max_inflight_remote",
        count_in(0, 1024),
        _SCHED.max_inflight_remote,
        "Requests in flight to other regions, besides max_inflight (a flow there runs at most TCP window / RTT); "
        "0 = within max_inflight.",
    ),
    Key(
        "swarm",
        "max_inflight_per_remote_peer",
        count_in(1, 64),
        _SCHED.max_inflight_per_remote_peer,
        "Requests in flight to one peer of another region.",
    ),
    Key(
        "swarm",
        "max_peers",
        count_in(0, 1 << 20),
        _SCHED.max_peers,
        "Peers the download considers at once: those heard from last; 0 = every peer heard from.",
    ),
    Key(
        "swarm",
        "cache_size",
        parse_size,
        0,
        "Bytes of verified chunks kept in memory to serve peers ('256MiB'); 0 = an eighth of the served model, "
        "so host memory stays within 1.3x the model (docs/weightstore.md). A download in progress is kept whole.",
    ),
    Key(
        "swarm",
        "tree_fanout",
        count_in(0, 64),
        _NODE.tree_fanout,
        "Stripe trees of this fan-out (0 = off): each chunk comes from one parent per stripe, as a regular "
        "relay plan; for one region of equal links (docs/bandwidth-study.md). The seed needs the same value.",
    ),
    Key(
        "trust",
        "root",
        parse_str,
        None,
        "Root public key (PEM) the host trusts; nothing else is trusted.",
        required=True,
    ),
    Key("trust", "clock_skew", parse_duration, "5m", "Tolerated clock skew for expiry checks."),
    Key(
        "store",
        "kind",
        choice("shm", "cuda", "engine-shm"),
        "shm",
        "Where the served weights live. shm: host shared memory the daemon allocates. cuda: one GPU buffer the "
        "engine allocates and registers (POST /v1/store) by CUDA IPC handle; it survives a daemon crash. "
        "engine-shm: the same engine-allocated flow with a host shared-memory buffer (CPU engines, tests).",
    ),
    Key(
        "store",
        "device",
        parse_device,
        "",
        "store.kind cuda: the GPU the engine's buffer must be on (cuda:N as the daemon sees it, or GPU-<uuid>); "
        "empty = any GPU the daemon can see. A registration on another GPU is refused (422 DeviceMismatch).",
    ),
    Key(
        "store",
        "name",
        parse_name,
        None,
        "Shared-memory name of the store (default: patchswarm-<run_id>); for engine stores, the control block.",
    ),
    Key(
        "store",
        "size",
        parse_size,
        0,
        "Capacity in bytes ('16GiB'); 0 = exactly the model. A model larger than this is refused (engine stores: "
        "the engine's buffer must hold the model; registering a smaller one gets 422 BufferTooSmall).",
    ),
    Key(
        "store",
        "ranks",
        count_in(1, 256),
        1,
        "Rank stores this daemon feeds (tensor-parallel ranks on this host), each holding only its rank's part "
        "of the model, named <store.name>.r<k> when more than 1 (store.size then applies to each). More than 1 "
        "needs store.plan.",
    ),
    Key(
        "store",
        "plan",
        parse_plan,
        "none",
        "Layout plan mapping the model's tensors to each rank's runtime parameters: none (one store holding the "
        "model as published), auto (the built-in plan for the architecture in the board's config.json), a "
        "built-in family name (llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3; head counts "
        "still from config.json), or the path of a plan file (docs/models.md; read and checked at start-up).",
    ),
    Key(
        "store",
        "devices",
        parse_devices,
        [],
        "store.kind cuda with store.ranks > 1: the GPU of each rank's buffer, one per rank (cuda:N or GPU-<uuid>); "
        "empty = any GPU. Ignored by shm and engine-shm stores.",
    ),
    Key("api", "socket", parse_str, "/run/patchswarm/api.sock", "Unix socket of the local HTTP API."),
    Key("api", "group", parse_str, "", "Group owning the socket (mode 0660); empty = the daemon's group."),
    Key(
        "http",
        "max_connections",
        count_in(1, 1 << 20),
        1024,
        "Connections each server (peer, sidecar, API socket, metrics) holds at once; one more is answered 503 and "
        "closed. Keep it well under the open-files limit (the unit sets LimitNOFILE=65536).",
    ),
    Key(
        "http",
        "max_connections_per_address",
        count_in(1, 1 << 20),
        64,
        "Of those, connections one client address holds at once (IPv6: one /64); one more is answered 503 and "
        "closed. Loopback clients (this machine's processes) are not counted.",
    ),
    Key("http", "header_timeout", parse_positive_duration, 10.0, "From connect until a request's headers are in."),
    Key("http", "idle_timeout", parse_positive_duration, 60.0, "An idle keep-alive connection is closed after this."),
    Key("http", "body_timeout", parse_positive_duration, 60.0, "A request's whole body must arrive within this."),
    Key(
        "http",
        "send_timeout",
        parse_positive_duration,
        60.0,
        "A client that reads nothing of a response for this long is cut off.",
    ),
    Key("sidecar", "enabled", parse_bool, False, "Run the version-aware reverse proxy in front of the engine."),
    Key("sidecar", "listen", parse_listen, "127.0.0.1:8081", "Where the sidecar listens."),
    Key("sidecar", "upstream", parse_url, "http://127.0.0.1:8080", "The engine's HTTP API."),
    Key(
        "sidecar",
        "allow_routes",
        parse_routes,
        [],
        "Engine routes the sidecar forwards besides its allow list of inference and metadata routes "
        "(docs/sidecar.md): exact paths like '/v1/messages', or '/p/*' for every path below /p. Any other "
        "path is answered 404 without reaching the engine; a control route here stops the daemon at start-up.",
    ),
    Key(
        "sidecar",
        "commit_mode",
        choice("quiesce", "in_place"),
        "quiesce",
        "quiesce: drain every request before activating; in_place: drain only requests pinned to an exact "
        "version and pause the engine (POST upstream /pause_generation, then /continue_generation) while writing.",
    ),
    Key(
        "sidecar",
        "drain_timeout",
        parse_positive_duration,
        20.0,
        "How long an activation waits for in-flight requests to finish (admission closed meanwhile); past it, "
        "admission reopens on the old version and the activation is retried with backoff. Keep it under the "
        "sidecar's 30 s admission wait, so requests held during a drain run when it gives up (not 503).",
    ),
    Key(
        "engine",
        "kind",
        choice("none", "zero-copy", "vllm", "sglang"),
        "none",
        "The engine the daemon drives (docs/engines.md). none: no engine under control, the store's version is "
        "reported as served. zero-copy: an engine reading the store (the reference or transformers engine) "
        "confirms each version (POST /patchswarm/v1/commit) before it is reported as served. vllm, sglang: "
        "engines whose workers copy each version's changed regions from the rank stores (vLLM with "
        "--worker-extension-cls patchswarm.daemon.vllm_worker.PatchswarmWorkerExtension and "
        "VLLM_SERVER_DEV_MODE=1; SGLang with --custom-weight-loader patchswarm.daemon.sglang_loader.load_regions).",
    ),
    Key("engine", "url", parse_url, None, "The engine's control API (default: sidecar.upstream)."),
    Key(
        "engine",
        "pause_mode",
        choice("in_place", "retract"),
        "in_place",
        "sglang: how requests are held during an update: in_place keeps them in the running batch (SGLang then "
        "cannot flush its cache while they run); retract moves them back to the queue, to be recomputed on the "
        "new weights.",
    ),
    Key(
        "engine",
        "flush_cache",
        parse_bool,
        True,
        (
            "On each version, ask the engine to drop cached KV/prefixes computed with older versions. false: "
            "vLLM and SGLang may then reuse a prefix's KV computed with an older version in a response reported "
            "as the new one (the transformers engine keys its cache by version and never does)."
        ),
    ),
    Key(
        "engine",
        "commit_timeout",
        parse_positive_duration,
        30.0,
        "How long the engine may take to acknowledge a version; past it the commit is retried with backoff "
        "(the version is reported as served only once acknowledged).",
    ),
    Key("data", "dir", parse_str, "/var/lib/patchswarm", "Journal, state and high-water marks."),
    Key(
        "export",
        "dir",
        parse_str,
        "",
        "Also write each activated version here as a Hugging Face checkpoint directory, v<N>, with the "
        "symlink current pointing at the newest (the last 2 kept), for an engine to cold-start from with "
        "its normal loader; empty = off. A failed export is logged and shown in the status reason; serving "
        "goes on (docs/models.md).",
    ),
    Key(
        "metrics",
        "listen",
        parse_listen,
        None,
        "Serve Prometheus metrics over TCP here (HOST:PORT, GET /metrics); they are always on the API socket.",
    ),
    Key(
        "tls",
        "enabled",
        parse_bool,
        False,
        "Mutual TLS for the swarm endpoints (node.listen) and every request to peers and seeds, against the "
        "cluster CA (docs/security.md): then every peer, bootstrap and seed URL must be https:// (never a "
        "silent fallback to plain HTTP); an s3:// gs:// az:// board is read over the provider's HTTPS.",
    ),
    Key("tls", "ca", parse_str, None, "PEM bundle of the cluster CA(s) peers' certificates must chain to."),
    Key("tls", "cert", parse_str, None, "PEM certificate of this host (from the cluster CA; `patchswarm certs`)."),
    Key(
        "tls",
        "key",
        parse_str,
        None,
        "PEM private key of tls.cert (unencrypted; keep it 0600: one every user can read is warned about).",
    ),
    Key(
        "tls",
        "sidecar",
        parse_bool,
        True,
        "With tls.enabled, the sidecar listener too (its clients then present a cluster certificate).",
    ),
    Key(
        "tls",
        "metrics",
        parse_bool,
        True,
        "With tls.enabled, the metrics listener too (the scraper then presents a cluster certificate).",
    ),
    Key(
        "tls",
        "check_hostname",
        parse_bool,
        False,
        "Also check that a peer's certificate names the host in its URL (off: peers announce bare addresses; "
        "the cluster CA is the check, docs/security.md).",
    ),
    Key(
        "tls",
        "reload_interval",
        parse_positive_duration,
        5.0,
        "How often the certificate files are checked for changes (rotation without restart).",
    ),
    Key(
        "log",
        "format",
        choice("json", "text"),
        "json",
        "json: one object per line; text: LEVEL logger: message key=value ... (the same fields).",
    ),
    Key("log", "level", choice("debug", "info", "warning", "error"), "info", "Log level."),
]


BY_PATH = {k.path: k for k in SCHEMA}


SECTIONS = sorted({k.section for k in SCHEMA})


# PATCHSWARM_* variables read outside the schema (the other tools, fault injection, test and bench knobs).
OTHER_ENV = frozenset(
    {
        "PATCHSWARM_CLUSTER_SECRET",
        "PATCHSWARM_DEBUG",
        "PATCHSWARM_FAULT_AT",
        "PATCHSWARM_HTTP_EXEMPT_LOOPBACK",  # tests: count loopback clients too (swarm/serving.py)
        "PATCHSWARM_FAULT_KILLS",
        "PATCHSWARM_CRASH_ROUNDS",  # tests: kills per point between rank activations (test_daemon_crash.py)
        "PATCHSWARM_CRASH_KILLS",
        "PATCHSWARM_BENCH_CONFIG",
        "PATCHSWARM_BENCH_PROFILE",
        "PATCHSWARM_BENCH_TRACE",
    }
)


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One warning per ``PATCHSWARM_*`` variable nothing reads (a typo would otherwise go unnoticed),
    naming the closest known variable."""
    known = sorted({k.env for k in SCHEMA} | OTHER_ENV)
    out = []
    for name in sorted(env):
        if not name.startswith("PATCHSWARM_") or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "the variables are listed in docs/daemon.md"
        out.append(f"{name}: unknown environment variable, ignored ({hint})")
    return out


def reference_markdown() -> str:
    """The configuration reference table (docs/daemon.md embeds it)."""
    lines = ["| key | default | environment | meaning |", "|---|---|---|---|"]
    for k in SCHEMA:
        default = "(required)" if k.required else ("" if k.default is None else f"`{k.default!r}`")
        lines.append(f"| `{k.path}` | {default} | `{k.env}` | {k.doc} |")
    return "\n".join(lines)

"""The rollout daemon's configuration: a TOML file, overridable by environment variables.

Every key is declared once in ``SCHEMA`` with its type, default and documentation (docs/daemon.md
is checked against it).  Any invalid value raises ConfigError naming the key, e.g.
``swarm.upload_rate: expected a rate like '100MB' (bytes per second), got 'fast'``.
Environment overrides: ``PATCHSWARM_<SECTION>_<KEY>`` (upper case), e.g. ``PATCHSWARM_SWARM_UPLOAD_RATE=50MB``.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import ipaddress
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchswarm.daemon.run_rules import check_run_id
from patchswarm.protocol.files import InputFileError, MissingFileError, read_file
from patchswarm.protocol.keys import MAX_KEY_FILE_BYTES
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.swarm.serving import ServerLimits
from patchswarm.swarm.tls import TlsError, TlsFiles, TlsReloader


class ConfigError(Exception):
    """A configuration problem, always naming the offending key."""


class ListenError(ConfigError):
    """A listen address that could not be bound (in use, not on this host, privileged port)."""


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "M": 1e6,
    "MB": 1e6,
    "G": 1e9,
    "GB": 1e9,
    "T": 1e12,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DURATION = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def _finite(x: float | int, v: Any) -> float:
    """``float(x)``, refusing what has no finite value (inf, nan, integers past the float range)."""
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"expected a finite value, got {v!r}")
    return f


def parse_size(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a size")
    if isinstance(v, int | float):
        if v < 0:
            raise ValueError(f"expected a finite, non-negative size, got {v!r}")
        return _finite(v, v)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"expected a size like '100MB' or '16GiB', got {v!r}")
    return _finite(float(m.group(1)) * _UNITS[m.group(2).upper()], v)


def parse_rate(v: Any) -> float:
    """Bytes per second; 0 means unlimited."""
    try:
        r = parse_size(v)
    except ValueError:
        raise ValueError(f"expected a rate like '100MB' (bytes per second), got {v!r}") from None
    return math.inf if r == 0 else r


def parse_duration(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0:
        return _finite(v, v)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)\s*", str(v))
    if not m:
        raise ValueError(f"expected a duration like '500ms', '5s' or '2m', got {v!r}")
    return _finite(float(m.group(1)) * _DURATION[m.group(2)], v)


def parse_positive_duration(v: Any) -> float:
    d = parse_duration(v)
    if d <= 0:
        raise ValueError(f"expected a duration above zero, got {v!r}")
    return d


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); IPv6 hosts in brackets (``[::1]:7000``); an empty host is 0.0.0.0."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (IPv6 as [::1]:PORT), got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            raise ValueError(f"expected an IPv6 address in brackets, got {listen!r}") from None
    if ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets ([{host}]:{port}), got {listen!r}")
    if not re.fullmatch(r"[A-Za-z0-9._-]{0,253}", host):
        raise ValueError(f"expected HOST:PORT with a host name or address, got {listen!r}")
    return host or "0.0.0.0", int(port)


def url_host(host: str) -> str:
    """A host as it goes into a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "no such address on this host",
    errno.EACCES: "permission denied (a port below 1024 needs privileges)",
}


@contextlib.contextmanager
def bind_errors(key: str, value: str) -> Iterator[None]:
    """Turn a failure to bind ``value`` into one line naming the config key, e.g.
    ``node.listen = [::1]:7000: address already in use``."""
    try:
        yield
    except socket.gaierror as e:
        raise ListenError(f"{key} = {value}: unknown host ({e.strerror})") from None
    except OSError as e:
        reason = _BIND_REASONS.get(e.errno or 0) or (e.strerror or str(e)).lower()
        raise ListenError(f"{key} = {value}: {reason}") from None


def parse_listen(v: Any) -> str:
    split_listen(parse_str(v))
    return str(v).strip()


def _shown(v: Any) -> str:
    """A rejected value as its error line shows it: a URL's credentials never (swarm/client_errors.py)."""
    from patchswarm.swarm.client_errors import shown_url

    return repr(shown_url(v)) if isinstance(v, str) else repr(v)


def parse_url(v: Any) -> str:
    if not isinstance(v, str) or not re.match(r"^https?://[^/\s]+", v):
        raise ValueError(f"expected an http(s) URL, got {_shown(v)}")
    return v.rstrip("/")


def parse_board_url(v: Any) -> str:
    """A board URL: http(s) (a seed, nginx, the store's HTTPS endpoint, a CDN) or an object store's
    s3:// gs:// az:// URL, read through its SDK with the provider's environment credentials."""
    from patchswarm.swarm.board_store import parse_store_url

    if isinstance(v, str) and parse_store_url(v) is not None:
        return v.rstrip("/")
    try:
        return parse_url(v)
    except ValueError:
        raise ValueError(f"expected an http(s), s3://, gs:// or az:// URL, got {_shown(v)}") from None


def _url_list(v: Any, parse: Callable[[Any], str]) -> list[str]:
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, list):
        raise ValueError("expected a list of URLs")
    return [parse(x.strip() if isinstance(x, str) else x) for x in v]


def parse_urls(v: Any) -> list[str]:
    return _url_list(v, parse_url)


def parse_board_urls(v: Any) -> list[str]:
    return _url_list(v, parse_board_url)


def parse_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def parse_name(v: Any) -> str:
    s = parse_str(v)
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", s):
        raise ValueError(f"expected letters, digits and . _ : - (at most 128), got {v!r}")
    return s


def parse_run_id(v: Any) -> str:
    return check_run_id(parse_str(v), "run id")


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def parse_int(v: Any) -> int:
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit())):
        raise ValueError(f"expected a whole number, got {v!r}")
    return int(v)


def count_in(lo: int, hi: int) -> Callable[[Any], int]:
    """A whole number in [lo, hi]."""

    def parse(v: Any) -> int:
        n = parse_int(v)
        if not lo <= n <= hi:
            raise ValueError(f"expected a whole number from {lo} to {hi}, got {n}")
        return n

    return parse


def parse_device(v: Any) -> str:
    s = parse_str(v).strip()
    if s in ("", "cpu") or re.fullmatch(r"cuda:[0-9]{1,3}", s) or re.fullmatch(r"(?i)GPU-[0-9a-f-]{8,64}", s):
        return s
    raise ValueError(f"expected '', 'cpu', 'cuda:N' or 'GPU-<uuid>', got {v!r}")


def parse_devices(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, list) or len(v) > 256:
        raise ValueError("expected a list of devices (cuda:N or GPU-<uuid>), at most 256")
    return [parse_device(x) for x in v]


def parse_plan(v: Any) -> str:
    """none, auto, a built-in family name, or a plan file's path (a value with a /; read at start-up)."""
    from patchswarm.protocol.layout_builtin import DENSE, MOE

    s = parse_str(v).strip()
    known = ["none", "auto", *sorted(DENSE | MOE)]
    if s in known or ("/" in s and len(s) <= 4096 and "\0" not in s):
        return s
    raise ValueError(f"expected one of {', '.join(known)} or a plan file's path (with a /), got {str(v)[:200]!r}")


def choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {v!r}")
        return str(v)

    return parse


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
_BY_PATH = {k.path: k for k in SCHEMA}
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


@dataclass(frozen=True)
class DaemonConfig:
    values: Mapping[str, Any]
    source: str
    warnings: tuple[str, ...] = ()  # (TLS files with TLS off, unknown variables) logged once logging is set up

    def __getitem__(self, path: str) -> Any:
        return self.values[path]

    def server_limits(self) -> ServerLimits:
        """The connection cap and deadlines every server of the daemon runs under (``http.*``)."""
        return ServerLimits(
            max_connections=self.values["http.max_connections"],
            max_connections_per_address=self.values["http.max_connections_per_address"],
            header_timeout_s=self.values["http.header_timeout"],
            idle_timeout_s=self.values["http.idle_timeout"],
            body_timeout_s=self.values["http.body_timeout"],
            send_timeout_s=self.values["http.send_timeout"],
        )

    def listen(self, path: str) -> tuple[str, int]:
        """A listen key's (host, port), IPv6 unbracketed."""
        return split_listen(self.values[path])

    @property
    def node_name(self) -> str:
        return str(self.values["node.name"] or socket.gethostname())

    @property
    def store_name(self) -> str:
        return str(self.values["store.name"] or f"patchswarm-{self.values['swarm.run_id']}")

    @property
    def data_dir(self) -> Path:
        return Path(self.values["data.dir"])

    def tls(self) -> TlsReloader | None:
        """The TLS contexts (swarm/tls.py) when tls.enabled; ConfigError naming the file at fault."""
        if not self.values["tls.enabled"]:
            return None
        files = TlsFiles(*(Path(self.values[f"tls.{n}"]) for n in ("ca", "cert", "key")))
        try:
            return TlsReloader(
                files, check_hostname=self.values["tls.check_hostname"], interval_s=self.values["tls.reload_interval"]
            )
        except TlsError as e:
            raise ConfigError(str(e)) from None

    def cluster_secret(self) -> bytes:
        path = Path(self.values["swarm.cluster_secret_file"])
        try:
            secret = read_file(path, MAX_KEY_FILE_BYTES).strip()
        except InputFileError as e:
            raise ConfigError(f"swarm.cluster_secret_file: cannot read {path}: {e.reason}") from None
        if len(secret) < 16:
            raise ConfigError(f"swarm.cluster_secret_file: {path} holds {len(secret)} bytes; at least 16 are needed")
        return secret


def load_config(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None) -> DaemonConfig:
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(read_file(path, 1 << 20).decode("utf-8"))
        except MissingFileError:
            raise ConfigError(f"{path}: no such configuration file") from None
        except InputFileError as e:
            raise ConfigError(str(e)) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except RecursionError:  # tomllib recurses once per nesting level of arrays and inline tables
            raise ConfigError(f"{path}: not valid TOML (nested too deeply)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return from_mapping(raw, env if env is not None else os.environ, source)


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str], source: str = "<mapping>") -> DaemonConfig:
    values: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section (known: {', '.join(SECTIONS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: must be a table ([{section}])")
        for name in body:
            if f"{section}.{name}" not in _BY_PATH:
                known = ", ".join(k.name for k in SCHEMA if k.section == section)
                raise ConfigError(f"{section}.{name}: unknown key (known in [{section}]: {known})")
    for key in SCHEMA:
        value = raw.get(key.section, {}).get(key.name, None)
        where = key.path
        if key.env in env:
            value, where = env[key.env], f"{key.path} (from ${key.env})"
        if value is None:
            if key.required:
                raise ConfigError(f"{key.path}: required ({key.doc})")
            values[key.path] = key.parse(key.default) if key.default is not None else None
            continue
        try:
            values[key.path] = key.parse(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    _check_ranks(values)
    _check_tls(values)
    return DaemonConfig(values, source, (*_tls_warnings(values), *unknown_env(env)))


def _check_tls(values: Mapping[str, Any]) -> None:
    """With tls.enabled: the three files named, and no peer or seed reached over plain HTTP (a board in an
    object store is read through its SDK, over the provider's HTTPS)."""
    from patchswarm.swarm.board_store import is_store_url
    from patchswarm.swarm.client_errors import shown_url

    if not values["tls.enabled"]:
        return
    for name in ("ca", "cert", "key"):
        if not values[f"tls.{name}"]:
            raise ConfigError(f"tls.{name}: required with tls.enabled")
    for key in ("swarm.bootstrap", "swarm.seed_urls", "node.advertise"):
        value = values[key]
        for url in value if isinstance(value, list) else [value] if value else []:
            if not url.startswith("https://") and not (key == "swarm.seed_urls" and is_store_url(url)):
                raise ConfigError(f"{key}: {shown_url(url)} is plain HTTP and tls.enabled is set: use https://")


def _tls_warnings(values: Mapping[str, Any]) -> list[str]:
    """TLS files named with tls.enabled off: most likely a forgotten switch, and the swarm in the clear."""
    named = [f"tls.{n}" for n in ("ca", "cert", "key") if values[f"tls.{n}"]]
    if values["tls.enabled"] or not named:
        return []
    verb = "is" if len(named) == 1 else "are"
    return [f"{', '.join(named)} {verb} set but tls.enabled is off: the swarm runs over plain HTTP"]


def _check_ranks(values: Mapping[str, Any]) -> None:
    """store.ranks, store.plan and store.devices together (one line naming the key at fault)."""
    ranks, plan, devices = values["store.ranks"], values["store.plan"], values["store.devices"]
    if ranks > 1 and plan == "none":
        raise ConfigError(
            f"store.plan: store.ranks = {ranks} needs a layout plan (auto, a built-in family or a plan file)"
        )
    if values["store.kind"] != "cuda":
        return  # (store.devices is ignored: shm buffers have no device)
    if devices and len(devices) != ranks:
        raise ConfigError(f"store.devices: {len(devices)} device(s) for store.ranks = {ranks}: give one per rank")
    if devices and values["store.device"]:
        raise ConfigError("store.device: set store.devices (one per rank) or store.device, not both")
    if ranks > 1 and values["store.device"]:
        raise ConfigError(f"store.device: one GPU for store.ranks = {ranks}: use store.devices, one per rank")
    if any(d == "cpu" for d in devices):
        raise ConfigError("store.devices: 'cpu' is not a GPU for store.kind 'cuda'")


def reference_markdown() -> str:
    """The configuration reference table (docs/daemon.md embeds it)."""
    lines = ["| key | default | environment | meaning |", "|---|---|---|---|"]
    for k in SCHEMA:
        default = "(required)" if k.required else ("" if k.default is None else f"`{k.default!r}`")
        lines.append(f"| `{k.path}` | {default} | `{k.env}` | {k.doc} |")
    return "\n".join(lines)

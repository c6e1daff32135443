"""Simulation scenarios: a TOML file -> a validated ``Scenario``, and the hosts and churn it describes.

Every key has a default; ``describe_defaults()`` lists them (docs/bandwidth-study.md reproduces
the list).  Quantities take units as strings or plain numbers in base units:

* sizes: ``"500MB"``, ``"4MiB"``, ``"5GB"``, or bytes (``4194304``);  MB = 10^6, MiB = 2^20;
* rates: ``"10Gbit/s"``, ``"100MB/s"``, or bytes/s;  Gbit/s = 10^9 bits/s = 1.25e8 bytes/s;
* durations: ``"40ms"``, ``"2s"``, ``"5min"``, or seconds; ``inf`` (TOML) where "never" makes sense.

Anything invalid raises ``ScenarioError`` naming the dotted key (``hosts.count: must be an
integer in [1, 10000], got 'ten'``); no other exception escapes ``parse_text``/``from_dict``.
"""

from __future__ import annotations

import math
import random
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.files import read_file
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.simulations.network import Backbone, Host, Region
from patchswarm.simulations.tcp_window import TcpModel

MAX_HOSTS = 10_000
MAX_REGIONS = 4
STRATEGIES = ("checkpoint", "central", "swarm")  # the bound is always computed beside them

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_RATE_UNITS = {
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "kib/s": 2.0**10,
    "mib/s": 2.0**20,
    "gib/s": 2.0**30,
    "bit/s": 1 / 8,
    "kbit/s": 1e3 / 8,
    "mbit/s": 1e6 / 8,
    "gbit/s": 1e9 / 8,
    "tbit/s": 1e12 / 8,
    "bps": 1 / 8,
    "kbps": 1e3 / 8,
    "mbps": 1e6 / 8,
    "gbps": 1e9 / 8,
}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


class ScenarioError(PatchswarmError):
    """A scenario file or override that is not valid; the message starts with the dotted key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key


@dataclass(frozen=True)
class _Field:
    kind: str  # int, float, size, rate, duration, str, strategies, bool
    default: Any
    lo: float = -math.inf
    hi: float = math.inf
    doc: str = ""
    allow_inf: bool = False


_NODE = NodeConfig("", "", b"")  # the swarm's own defaults, which [swarm] reads
_SCHED = _NODE.scheduler

_SCHEMA: dict[str, dict[str, _Field]] = {
    "": {
        "name": _Field("str", "scenario", doc="a label for reports"),
        "description": _Field("str", "", doc="free text for reports"),
    },
    "hosts": {
        "count": _Field("int", 16, 1, MAX_HOSTS, "receiving hosts N (the seed/store is one more)"),
        "uplink": _Field("rate", 1.25e9, 1.0, doc="default host uplink (10 Gbit/s)"),
        "downlink": _Field("rate", 1.25e9, 1.0, doc="default host downlink (10 Gbit/s)"),
        "spread": _Field("float", 0.0, 0.0, 0.9, "heterogeneity: each host's rates x uniform(1-spread, 1+spread)"),
        "slow_fraction": _Field("float", 0.0, 0.0, 1.0, "fraction of hosts that are slow"),
        "slow_factor": _Field("float", 0.1, 1e-4, 1.0, "a slow host's rates x this"),
    },
    "seed": {
        "uplink": _Field("rate", 1.25e9, 1.0, doc="uplink of the seed, which is also the central store"),
        "region": _Field("str", "", doc="region of the seed/store (default: the first region)"),
        "paced": _Field("bool", True, doc="swarm: the seed sends one chunk after another at its uplink rate"),
    },
    "payload": {
        "patch_size": _Field("size", 500 * 10**6, 1, 10**13, "bytes of one version's patch"),
        "checkpoint_size": _Field("size", 16 * 10**9, 1, 10**14, "bytes of a full checkpoint"),
        "chunk_size": _Field("size", 4 << 20, 1024, 1 << 32, "bytes per chunk"),
    },
    "versions": {
        "count": _Field("int", 1, 1, 1000, "versions published, one every interval"),
        "interval": _Field("duration", 30.0, 1e-3, 1e7, "seconds between two publications"),
    },
    "churn": {
        "crash_rate": _Field("float", 0.0, 0.0, 1.0, "probability that a host crashes during one churn window"),
        "rejoin_after": _Field(
            "duration", 10.0, 0.0, doc="mean seconds down (exponential); inf: never", allow_inf=True
        ),
        "window": _Field("duration", 0.0, 0.0, 1e7, "crashes fall in [publication, +window]; 0: versions.interval"),
    },
    "network": {
        "window": _Field("size", 4 << 20, 0, 1 << 40, "TCP window per flow (rate <= window/RTT); 0: no cap"),
        "quantum": _Field("duration", 0.0, 0.0, 10.0, "batch network events to multiples of this; 0: exact"),
        "initial_window": _Field(
            "size", 0, 0, 1 << 30, "TCP initial window, bytes: swarm requests pay handshakes and slow start; 0: off"
        ),
        "slow_start_after_idle": _Field("bool", True, doc="an idle connection's window falls back (Linux default)"),
        "send_buffer": _Field(
            "size", 0, 0, 1 << 30, "with initial_window: a chunk reply this small frees the server's slot at once"
        ),
    },
    "run": {
        "seed": _Field("int", 0, 0, 2**63 - 1, "RNG seed for hosts, churn and nodes"),
        "deadline": _Field(
            "duration", 3600.0, 1e-3, 1e9, "swarm: virtual s after the last publication before giving up"
        ),
        "strategies": _Field("strategies", STRATEGIES, doc=f"which of {', '.join(STRATEGIES)} to run"),
    },
    # Absent keys leave the node's own defaults (NodeConfig, SchedulerConfig); these read them.
    "swarm": {
        "max_inflight": _Field("int", _SCHED.max_inflight, 1, 1024, "chunk requests in flight per node"),
        "max_inflight_per_peer": _Field(
            "int", _SCHED.max_inflight_per_peer, 1, 1024, "requests in flight to one peer in this region"
        ),
        "max_inflight_per_remote_peer": _Field(
            "int", _SCHED.max_inflight_per_remote_peer, 1, 1024, "requests in flight to one peer in another region"
        ),
        "max_inflight_seed": _Field("int", _SCHED.max_inflight_seed, 1, 1024, "requests in flight to the seed"),
        "max_inflight_remote": _Field(
            "int",
            _SCHED.max_inflight_remote,
            0,
            1024,
            "requests in flight to other regions, besides max_inflight (0: within it)",
        ),
        "max_uploads": _Field("int", _NODE.max_uploads, 1, 1024, "concurrent uploads a node serves"),
        "upload_queue": _Field(
            "int", _NODE.upload_queue, 0, 1024, "requests waiting for an upload slot before refusals start"
        ),
        "seed_max_uploads": _Field("int", _NODE.seed_max_uploads, 1, 1024, "concurrent uploads the seed serves"),
        "seed_upload_queue": _Field(
            "int", _NODE.seed_upload_queue, 0, 1024, "requests waiting for one of the seed's upload slots"
        ),
        "announce_fanout": _Field(
            "int", _NODE.announce_fanout, 1, 1024, "peers told at once when availability changes"
        ),
        "announce_interval": _Field(
            "duration", _NODE.announce_interval, 1e-4, 10.0, "how often a node may announce new chunks"
        ),
        "announce_rare": _Field(
            "int",
            _NODE.announce_rare,
            -1,
            1 << 20,
            "news of a chunk at most this many peers hold goes out at once, not at the tick; -1: never",
        ),
        "seed_copy_window": _Field(
            "duration", _NODE.seed_copy_window, 0.0, 600.0, "the seed serves each chunk once per this window"
        ),
        "seed_object_copies": _Field(
            "int",
            _NODE.seed_object_copies,
            0,
            1 << 20,
            "requesters the seed hands each manifest to before it names them to the rest; 0: all",
        ),
        "seed_patience": _Field(
            "duration", _SCHED.seed_patience, 0.0, 600.0, "wait for a peer's copy before asking the seed"
        ),
        "endgame_remaining": _Field(
            "int", _SCHED.endgame_remaining, 0, 1 << 20, "duplicate requests once this few chunks are left"
        ),
        "max_peers": _Field(
            "int", _SCHED.max_peers, 0, 1 << 20, "peers a download considers at once (heard from last), 0: all"
        ),
        "tree_fanout": _Field(
            "int", _NODE.tree_fanout, 0, 64, "stripe trees of this fan-out once membership settles; 0: off"
        ),
        "tree_settle": _Field(
            "duration", _NODE.tree_settle, 0.0, 600.0, "trees only after the member list is unchanged this long"
        ),
        "tree_patience": _Field(
            "duration", _SCHED.tree_patience, 0.0, 600.0, "wait for a lagging stripe parent before asking others"
        ),
        "max_inflight_per_parent": _Field(
            "int", _SCHED.max_inflight_per_parent, 1, 1024, "requests in flight to a stripe parent"
        ),
        "max_members": _Field(
            "int",
            _NODE.membership.max_members,
            0,
            1 << 20,
            "membership view per node, 0: every member (thousands of hosts)",
        ),
    },
}
_REGION_KEYS = {
    "name": _Field("str", None, doc="unique name"),
    "share": _Field("float", None, 0.0, 1.0, "fraction of hosts (shares sum to 1)"),
    "latency": _Field("duration", 0.5e-3, 0.0, 10.0, "one-way latency inside the region"),
    "uplink": _Field("rate", None, 1.0, doc="host uplink here (default hosts.uplink)"),
    "downlink": _Field("rate", None, 1.0, doc="host downlink here (default hosts.downlink)"),
}
_BACKBONE_KEYS = {
    "a": _Field("str", None, doc="region"),
    "b": _Field("str", None, doc="region"),
    "capacity": _Field("rate", None, 1.0, doc="each direction", allow_inf=True),
    "latency": _Field("duration", 0.0, 0.0, 10.0, "one-way"),
    "pinned": _Field("bool", False, doc="flows between a and b always take this link, never a faster detour"),
}
_SECTION_LISTS = ("regions", "backbones")


@dataclass(frozen=True)
class RegionSpec:
    name: str
    share: float
    latency: float
    uplink: float | None
    downlink: float | None


@dataclass(frozen=True)
class Scenario:
    """A validated scenario; ``raw`` is the TOML document it came from (sweeps override it and re-validate)."""

    name: str
    description: str
    hosts: int
    uplink: float
    downlink: float
    spread: float
    slow_fraction: float
    slow_factor: float
    seed_uplink: float
    seed_paced: bool
    seed_region: str
    regions: tuple[RegionSpec, ...]
    backbones: tuple[Backbone, ...]
    patch_size: int
    checkpoint_size: int
    chunk_size: int
    versions: int
    interval: float
    crash_rate: float
    rejoin_after: float
    churn_window: float
    window: float | None
    quantum: float
    tcp: TcpModel | None  # slow start on the swarm's connections (network.initial_window > 0)
    rng_seed: int
    deadline: float
    strategies: tuple[str, ...]
    swarm: tuple[tuple[str, float], ...]  # NodeConfig/SchedulerConfig overrides given in the file, sorted
    raw: Mapping[str, Any]

    @property
    def chunks(self) -> int:
        return math.ceil(self.patch_size / self.chunk_size)

    def publication(self, version: int) -> float:
        """Virtual time when version ``version`` (1-based) is published."""
        return (version - 1) * self.interval


# ---------------------------------------------------------------- values


def _number(key: str, value: Any, units: Mapping[str, float], unit_name: str, allow_inf: bool) -> float:
    if isinstance(value, bool):
        raise ScenarioError(key, f"must be a {unit_name}, got {value!r}")
    if isinstance(value, int | float):
        x = float(value)
    elif isinstance(value, str):
        m = _QUANTITY.match(value)
        unit = m.group(2).lower() if m else ""
        if value.strip().lower() == "inf" and allow_inf:
            return math.inf
        if not m or (unit and unit not in units):
            known = ", ".join(sorted(k for k in units if k))
            raise ScenarioError(
                key, f"must be a {unit_name} like '{_EXAMPLES[unit_name]}' (units: {known}), got {value!r}"
            )
        x = float(m.group(1)) * (units[unit] if unit else 1.0)
    else:
        raise ScenarioError(key, f"must be a {unit_name}, got {type(value).__name__}")
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise ScenarioError(key, f"must be a finite {unit_name}, got {value!r}")
    return x


_EXAMPLES = {"size": "500MB", "rate": "10Gbit/s", "duration": "40ms", "number": "0.5"}


def _value(key: str, f: _Field, value: Any) -> Any:
    if f.kind == "str":
        if not isinstance(value, str) or len(value) > 200:
            raise ScenarioError(key, f"must be a string of at most 200 characters, got {value!r}")
        return value
    if f.kind == "strategies":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
            raise ScenarioError(key, f"must be a non-empty list of strategy names from {list(STRATEGIES)}")
        bad = [s for s in value if s not in STRATEGIES]
        if bad or len(set(value)) != len(value):
            raise ScenarioError(key, f"must name each of {list(STRATEGIES)} at most once, got {value!r}")
        return tuple(s for s in STRATEGIES if s in value)
    if f.kind == "bool":
        if not isinstance(value, bool):
            raise ScenarioError(key, f"must be true or false, got {value!r}")
        return value
    if f.kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not f.lo <= value <= f.hi:
            raise ScenarioError(key, f"must be an integer in [{f.lo:g}, {f.hi:g}], got {value!r}")
        return value
    tables: dict[str, Mapping[str, float]] = {
        "float": {},
        "size": _SIZE_UNITS,
        "rate": _RATE_UNITS,
        "duration": _TIME_UNITS,
    }
    units = tables[f.kind]
    unit_name = "number" if f.kind == "float" else f.kind
    x = _number(key, value, {"": 1.0, **units}, unit_name, f.allow_inf)
    if not (f.lo <= x <= f.hi or (x == math.inf and f.allow_inf)):
        raise ScenarioError(key, f"must be in [{f.lo:g}, {f.hi:g}], got {value!r}")
    if f.kind == "size":
        if not x.is_integer():
            raise ScenarioError(key, f"must be a whole number of bytes, got {value!r}")
        return int(x)
    return x


def _table(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(key, f"must be a table, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ScenarioError(key, f"keys must be strings, got {k!r}")
    return value


def _fields(prefix: str, table: Mapping[str, Any], schema: Mapping[str, _Field]) -> dict[str, Any]:
    for k in table:
        if k not in schema:
            raise ScenarioError(f"{prefix}{k}", f"unknown key (known: {', '.join(schema)})")
    out: dict[str, Any] = {}
    for k, f in schema.items():
        if k in table:
            out[k] = _value(f"{prefix}{k}", f, table[k])
        elif f.default is None and f.kind in ("rate",) and k in ("uplink", "downlink"):
            out[k] = None
        elif f.default is None:
            raise ScenarioError(f"{prefix}{k}", "is required")
        else:
            out[k] = f.default
    return out


# ---------------------------------------------------------------- scenario


def _regions(raw: Any) -> tuple[RegionSpec, ...]:
    if raw is None:
        return (RegionSpec("r0", 1.0, 0.5e-3, None, None),)
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_REGIONS:
        raise ScenarioError("regions", f"must be a list of 1 to {MAX_REGIONS} tables ([[regions]])")
    specs = []
    for i, r in enumerate(raw):
        v = _fields(f"regions[{i}].", _table(f"regions[{i}]", r), _REGION_KEYS)
        if not v["name"]:
            raise ScenarioError(f"regions[{i}].name", "must not be empty")
        specs.append(RegionSpec(v["name"], v["share"], v["latency"], v["uplink"], v["downlink"]))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ScenarioError("regions", f"names must be unique, got {names}")
    total = math.fsum(s.share for s in specs)
    if abs(total - 1.0) > 1e-6:
        raise ScenarioError("regions", f"shares must sum to 1, got {total:g}")
    return tuple(specs)


def _backbones(raw: Any, regions: Sequence[RegionSpec]) -> tuple[Backbone, ...]:
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ScenarioError("backbones", "must be a list of tables ([[backbones]])")
    names = {r.name for r in regions}
    out = []
    for i, b in enumerate(raw):
        v = _fields(f"backbones[{i}].", _table(f"backbones[{i}]", b), _BACKBONE_KEYS)
        for end in ("a", "b"):
            if v[end] not in names:
                raise ScenarioError(f"backbones[{i}].{end}", f"unknown region {v[end]!r} (regions: {sorted(names)})")
        if v["a"] == v["b"]:
            raise ScenarioError(f"backbones[{i}]", "must join two different regions")
        out.append(Backbone(v["a"], v["b"], v["capacity"], v["latency"], v["pinned"]))
    reach = {regions[0].name}
    grew = True
    while grew:
        grew = False
        for b in out:
            if (b.a in reach) != (b.b in reach):
                reach |= {b.a, b.b}
                grew = True
    if reach != names:
        raise ScenarioError("backbones", f"regions {sorted(names - reach)} cannot be reached from {regions[0].name!r}")
    return tuple(out)


def from_dict(raw: Mapping[str, Any]) -> Scenario:
    """Validate a parsed TOML document; raises ``ScenarioError`` (naming the key) for anything invalid."""
    raw = _table("", raw)
    known = set(_SCHEMA) - {""} | set(_SCHEMA[""]) | set(_SECTION_LISTS)
    for k in raw:
        if k not in known:
            raise ScenarioError(k, f"unknown key (known: {', '.join(sorted(known))})")
    top = _fields("", {k: v for k, v in raw.items() if k in _SCHEMA[""]}, _SCHEMA[""])
    sec = {
        name: _fields(f"{name}.", _table(name, raw.get(name, {})), schema) for name, schema in _SCHEMA.items() if name
    }
    regions = _regions(raw.get("regions"))
    backbones = _backbones(raw.get("backbones"), regions)
    seed_region = sec["seed"]["region"] or regions[0].name
    if seed_region not in {r.name for r in regions}:
        raise ScenarioError("seed.region", f"unknown region {seed_region!r}")
    pay, ver, churn, net, run = sec["payload"], sec["versions"], sec["churn"], sec["network"], sec["run"]
    if pay["chunk_size"] > pay["patch_size"] * 2 and pay["chunk_size"] > 1 << 20:
        raise ScenarioError("payload.chunk_size", f"{pay['chunk_size']} is far larger than the patch")
    return Scenario(
        name=top["name"],
        description=top["description"],
        hosts=sec["hosts"]["count"],
        uplink=sec["hosts"]["uplink"],
        downlink=sec["hosts"]["downlink"],
        spread=sec["hosts"]["spread"],
        slow_fraction=sec["hosts"]["slow_fraction"],
        slow_factor=sec["hosts"]["slow_factor"],
        seed_uplink=sec["seed"]["uplink"],
        seed_paced=sec["seed"]["paced"],
        seed_region=seed_region,
        regions=regions,
        backbones=backbones,
        patch_size=pay["patch_size"],
        checkpoint_size=pay["checkpoint_size"],
        chunk_size=pay["chunk_size"],
        versions=ver["count"],
        interval=ver["interval"],
        crash_rate=churn["crash_rate"],
        rejoin_after=churn["rejoin_after"],
        churn_window=churn["window"] or ver["interval"],
        window=float(net["window"]) or None,
        quantum=net["quantum"],
        tcp=(
            TcpModel(
                float(net["initial_window"]),
                restart_after_idle=net["slow_start_after_idle"],
                send_buffer=float(net["send_buffer"]),
            )
            if net["initial_window"]
            else None
        ),
        rng_seed=run["seed"],
        deadline=run["deadline"],
        strategies=run["strategies"],
        swarm=tuple(sorted((k, v) for k, v in sec["swarm"].items() if k in _table("swarm", raw.get("swarm", {})))),
        raw=raw,
    )


def parse_text(text: str) -> Scenario:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError("", f"not valid TOML: {e}") from None
    return from_dict(doc)


def load(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        text = read_file(p, 1 << 20).decode("utf-8")  # a regular file of at most 1 MiB (protocol/files.py)
    except UnicodeDecodeError:
        raise ScenarioError("", f"{p}: not UTF-8 text") from None
    try:
        return parse_text(text)
    except ScenarioError as e:
        raise ScenarioError(e.key, f"{p}: {e}") from None


# ---------------------------------------------------------------- overrides (sweeps)


def parse_override_value(text: str) -> Any:
    """A value given on the command line: a TOML value if it is one (10, 0.3, inf, true), else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def with_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> Scenario:
    """The scenario ``raw`` with dotted keys replaced (``hosts.count``, ``churn.crash_rate``), validated."""
    doc: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) == 1 and key in _SCHEMA[""]:
            doc[key] = value
            continue
        if len(parts) != 2 or parts[0] not in _SCHEMA or not parts[0] or parts[1] not in _SCHEMA[parts[0]]:
            known = [f"{s}.{k}" for s, fields in _SCHEMA.items() if s for k in fields]
            raise ScenarioError(key, f"not a sweepable key (sweepable: {', '.join(known)})")
        section = doc.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ScenarioError(parts[0], "must be a table")
        section[parts[1]] = value
    return from_dict(doc)


def value_of(s: Scenario, key: str) -> Any:
    """The parsed value of a dotted key in ``s`` (units applied: ``payload.patch_size`` -> bytes)."""
    section, _, name = key.rpartition(".")
    f = _SCHEMA.get(section, {}).get(name)
    if f is None:
        raise ScenarioError(key, "not a scenario key")
    table = s.raw.get(section, {}) if section else s.raw
    return _value(key, f, table[name]) if name in table else f.default


# ---------------------------------------------------------------- hosts and churn


@dataclass(frozen=True)
class Layout:
    """The concrete network a scenario describes: the seed/store host, the receivers, regions, backbones."""

    seed: Host
    peers: tuple[Host, ...]
    regions: tuple[Region, ...]
    backbones: tuple[Backbone, ...]
    slow: frozenset[str]


def layout(s: Scenario) -> Layout:
    """Hosts assigned to regions by share (largest remainder), rates drawn from ``run.seed``."""
    rng = random.Random(f"{s.rng_seed}:hosts")
    quotas = [r.share * s.hosts for r in s.regions]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: s.hosts - sum(counts)]:
        counts[i] += 1
    peers: list[Host] = []
    for spec, n in zip(s.regions, counts, strict=True):
        up = spec.uplink if spec.uplink is not None else s.uplink
        down = spec.downlink if spec.downlink is not None else s.downlink
        for i in range(n):
            f = rng.uniform(1 - s.spread, 1 + s.spread) if s.spread else 1.0
            peers.append(Host(f"{spec.name}-{i:05d}", spec.name, up=up * f, down=down * f))
    slow = frozenset(h.id for h in rng.sample(peers, round(s.slow_fraction * len(peers))))
    peers = [Host(h.id, h.region, h.up * s.slow_factor, h.down * s.slow_factor) if h.id in slow else h for h in peers]
    seed = Host("seed", s.seed_region, up=s.seed_uplink, down=max(s.uplink, s.downlink))
    regions = tuple(Region(r.name, r.latency) for r in s.regions)
    return Layout(seed, tuple(peers), regions, s.backbones, slow)


@dataclass(frozen=True, order=True)
class ChurnEvent:
    time: float  # virtual seconds
    host: str
    up: bool  # False: crashes (no goodbye); True: rejoins


def churn_schedule(s: Scenario, peers: Sequence[Host]) -> tuple[ChurnEvent, ...]:
    """Crashes and rejoins, the same for every strategy: in each version's window each up host crashes with
    probability ``churn.crash_rate`` at a uniform time, and rejoins after an exponential downtime (mean
    ``churn.rejoin_after``; inf: never)."""
    if s.crash_rate <= 0:
        return ()
    rng = random.Random(f"{s.rng_seed}:churn")
    down_until = {h.id: -math.inf for h in peers}
    events: list[ChurnEvent] = []
    for v in range(1, s.versions + 1):
        t0 = s.publication(v)
        for h in peers:
            crash = rng.random() < s.crash_rate
            at = t0 + rng.random() * s.churn_window
            downtime = rng.expovariate(1 / s.rejoin_after) if 0 < s.rejoin_after < math.inf else s.rejoin_after
            if not crash or down_until[h.id] >= at:
                continue
            events.append(ChurnEvent(at, h.id, False))
            down_until[h.id] = at + downtime
            if downtime < math.inf:
                events.append(ChurnEvent(at + downtime, h.id, True))
    return tuple(sorted(events))


def describe_defaults() -> str:
    """Every key with its default and meaning, as Markdown table rows."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section, fields in _SCHEMA.items():
        for k, f in fields.items():
            rows.append(f"| `{section + '.' if section else ''}{k}` | `{f.default!r}` | {f.doc} |")
    for prefix, keys in (("regions[].", _REGION_KEYS), ("backbones[].", _BACKBONE_KEYS)):
        for k, f in keys.items():
            default = "required" if f.default is None and k not in ("uplink", "downlink") else repr(f.default)
            rows.append(f"| `{prefix}{k}` | `{default}` | {f.doc} |")
    return "\n".join(rows)

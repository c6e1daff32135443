from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.daemon.config import SCHEMA, ConfigError, from_mapping, load_config, parse_size

MINIMAL = {
    "swarm": {"run_id": "run-1", "cluster_secret_file": "/etc/patchswarm/secret"},
    "trust": {"root": "/etc/patchswarm/root.pub"},
}


def test_defaults_and_units() -> None:
    cfg = from_mapping(MINIMAL, {})
    assert cfg["swarm.upload_rate"] == math.inf and cfg["store.kind"] == "shm"
    assert cfg["trust.clock_skew"] == 300.0 and cfg.store_name == "patchswarm-run-1"
    cfg = from_mapping(
        {**MINIMAL, "store": {"size": "16GiB"}, "swarm": {**MINIMAL["swarm"], "upload_rate": "50MB"}}, {}
    )
    assert cfg["store.size"] == 16 * 2**30 and cfg["swarm.upload_rate"] == 50e6


def test_budgets_reach_the_node_and_default_to_the_swarms_own() -> None:
    from patchswarm.daemon.rollout import swarm_budgets
    from patchswarm.protocol.node_config import NodeConfig

    defaults = NodeConfig("n", "run-1", b"s" * 16)
    assert NodeConfig("n", "run-1", b"s" * 16, **swarm_budgets(from_mapping(MINIMAL, {}))) == defaults
    raw = {**MINIMAL, "swarm": {**MINIMAL["swarm"], "max_inflight_per_peer": 3, "upload_queue": 0, "max_peers": 0}}
    cfg = from_mapping(raw, {"PATCHSWARM_SWARM_MAX_INFLIGHT_REMOTE": "32"})
    got = NodeConfig("n", "run-1", b"s" * 16, **swarm_budgets(cfg))
    assert got.upload_queue == 0 and got.scheduler.max_inflight_per_peer == 3 and got.scheduler.max_peers == 0
    assert got.scheduler.max_inflight_remote == 32 and got.scheduler.max_inflight == defaults.scheduler.max_inflight


def test_environment_overrides_the_file() -> None:
    cfg = from_mapping(MINIMAL, {"PATCHSWARM_SWARM_UPLOAD_RATE": "10MB", "PATCHSWARM_NODE_ZONE": "z9"})
    assert cfg["swarm.upload_rate"] == 10e6 and cfg["node.zone"] == "z9"
    with pytest.raises(ConfigError, match=r"swarm\.upload_rate \(from \$PATCHSWARM_SWARM_UPLOAD_RATE\)"):
        from_mapping(MINIMAL, {"PATCHSWARM_SWARM_UPLOAD_RATE": "fast"})


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("swarm", "upload_rate", "fast", r"swarm\.upload_rate: expected a rate"),
        ("node", "listen", "nowhere", r"node\.listen: expected HOST:PORT"),
        ("node", "listen", "host:99999", r"node\.listen"),
        ("swarm", "bootstrap", ["ftp://x"], r"swarm\.bootstrap: expected an http"),
        ("store", "kind", "disk", r"store\.kind: expected one of shm, cuda"),
        ("store", "size", "-1GB", r"store\.size"),
        ("sidecar", "commit_mode", "yolo", r"sidecar\.commit_mode"),
        ("sidecar", "enabled", "maybe", r"sidecar\.enabled: expected true or false"),
        ("trust", "clock_skew", "soon", r"trust\.clock_skew: expected a duration"),
        ("swarm", "max_uploads", 2.5, r"swarm\.max_uploads: expected a whole number"),
        ("swarm", "max_uploads", -1, r"swarm\.max_uploads: expected a whole number"),
        ("swarm", "max_inflight", 0, r"swarm\.max_inflight: expected a whole number from 1 to 1024, got 0"),
        ("swarm", "max_inflight_per_peer", 0, r"swarm\.max_inflight_per_peer: expected a whole number from 1"),
        ("swarm", "upload_queue", -1, r"swarm\.upload_queue: expected a whole number"),
        ("swarm", "max_inflight_remote", 5000, r"swarm\.max_inflight_remote: expected a whole number from 0 to 1024"),
        ("swarm", "max_peers", -1, r"swarm\.max_peers: expected a whole number from 0"),
        ("node", "name", "bad name!", r"node\.name"),
        ("swarm", "colour", "red", r"swarm\.colour: unknown key"),
    ],
)
def test_each_bad_value_names_its_key(section: str, key: str, value: object, message: str) -> None:
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=message):
        from_mapping(raw, {})


def test_missing_required_and_unknown_sections() -> None:
    with pytest.raises(ConfigError, match=r"swarm\.run_id: required"):
        from_mapping({"trust": MINIMAL["trust"]}, {})
    with pytest.raises(ConfigError, match="unknown section"):
        from_mapping({**MINIMAL, "gpu": {}}, {})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_config(tmp_path / "missing.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("[swarm\nrun_id=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, {})
    short = tmp_path / "secret"
    short.write_text("short")
    cfg = from_mapping({**MINIMAL, "swarm": {**MINIMAL["swarm"], "cluster_secret_file": str(short)}}, {})
    with pytest.raises(ConfigError, match="at least 16"):
        cfg.cluster_secret()


def test_packaged_example_is_valid() -> None:
    cfg = load_config(Path(__file__).parents[3] / "packaging/daemon.toml", {})
    assert cfg["sidecar.enabled"] is True and cfg["store.size"] == 16 * 2**30


def test_every_key_is_documented() -> None:
    doc = (Path(__file__).parents[3] / "docs/daemon.md").read_text()
    missing = [k.path for k in SCHEMA if f"`{k.path}`" not in doc]
    assert not missing, f"docs/daemon.md lacks {missing}"


@given(st.one_of(st.text(max_size=12), st.integers(), st.floats(allow_nan=True), st.booleans(), st.none()))
def test_size_parser_never_crashes(value: object) -> None:
    try:
        assert parse_size(value) >= 0
    except ValueError:
        pass


@pytest.mark.parametrize(
    ("store", "env", "line"),
    [
        ({"ranks": 2}, {}, "store.plan: store.ranks = 2 needs a layout plan"),
        ({"ranks": 0, "plan": "auto"}, {}, "store.ranks: expected a whole number from 1 to 256"),
        ({"plan": "gpt2"}, {}, "store.plan: expected one of none, auto"),
        ({"ranks": 2, "plan": "auto", "kind": "cuda", "devices": ["cuda:0"]}, {}, "store.devices: 1 device(s)"),
        ({"ranks": 2, "plan": "auto", "kind": "cuda", "device": "cuda:0"}, {}, "store.device: one GPU for"),
        ({"ranks": 2, "plan": "auto", "kind": "cuda"}, {"PATCHSWARM_STORE_DEVICES": "cuda:0,nope"}, "store.devices"),
    ],
)
def test_rank_store_keys_are_checked_together(store: dict[str, object], env: dict[str, str], line: str) -> None:
    raw = {**MINIMAL, "store": store}
    with pytest.raises(ConfigError) as e:
        from_mapping(raw, env)
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)


def test_rank_store_keys() -> None:
    cfg = from_mapping({**MINIMAL, "store": {"ranks": 4, "plan": "llama"}}, {})
    assert (cfg["store.ranks"], cfg["store.plan"], cfg["store.devices"]) == (4, "llama", [])
    assert from_mapping({**MINIMAL, "store": {"plan": "/etc/patchswarm/plan.json"}}, {})["store.plan"].endswith(".json")
    shm = {"kind": "engine-shm", "ranks": 2, "plan": "auto", "devices": ["cuda:0"]}
    assert from_mapping({**MINIMAL, "store": shm}, {})["store.ranks"] == 2  # (devices: ignored, not a GPU store)

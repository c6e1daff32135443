"""Scenario files: units, defaults, layout, churn, and a clear ScenarioError (naming the key) for bad input."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.simulations.scenario import (
    Scenario,
    ScenarioError,
    churn_schedule,
    describe_defaults,
    from_dict,
    layout,
    load,
    parse_override_value,
    parse_text,
    value_of,
    with_overrides,
)

SCENARIOS = sorted((Path(__file__).parents[3] / "simulations" / "scenarios").glob("*.toml"))


def test_the_shipped_scenarios_are_valid() -> None:
    names = {p.stem for p in SCENARIOS}
    assert {"small", "regions3", "churn", "large", "huge"} <= names
    for path in SCENARIOS:
        s = load(path)
        lay = layout(s)
        assert len(lay.peers) == s.hosts
        assert len({h.id for h in lay.peers}) == s.hosts
    assert load(SCENARIOS[0]).name


def test_defaults_and_units() -> None:
    s = from_dict({})
    assert (s.hosts, s.uplink, s.patch_size, s.chunk_size, s.versions) == (16, 1.25e9, 500_000_000, 4 << 20, 1)
    assert [r.name for r in s.regions] == ["r0"] and s.seed_region == "r0"
    assert s.strategies == ("checkpoint", "central", "swarm")
    s = parse_text(
        """
        [hosts]
        uplink = "10Gbit/s"
        downlink = "100MB/s"
        [payload]
        patch_size = "1.5GB"
        chunk_size = "4MiB"
        checkpoint_size = 1000
        [versions]
        interval = "250ms"
        [churn]
        rejoin_after = inf
        """
    )
    assert s.uplink == 1.25e9 and s.downlink == 1e8
    assert s.patch_size == 1_500_000_000 and s.chunk_size == 4 * 2**20 and s.checkpoint_size == 1000
    assert s.interval == 0.25 and s.rejoin_after == math.inf
    assert s.chunks == math.ceil(1.5e9 / 2**22)
    assert "| `hosts.count` | `16` |" in describe_defaults()


@pytest.mark.parametrize(
    ("doc", "key", "words"),
    [
        ("[hosts]\ncount = 0", "hosts.count", "integer in [1, 10000]"),
        ("[hosts]\ncount = 10001", "hosts.count", "integer"),
        ('[hosts]\ncount = "ten"', "hosts.count", "'ten'"),
        ("[hosts]\ncountt = 10", "hosts.countt", "unknown key"),
        ('[hosts]\nuplink = "10 furlongs/s"', "hosts.uplink", "rate like '10Gbit/s'"),
        ("[hosts]\nuplink = -5", "hosts.uplink", "must be in"),
        ("[hosts]\nuplink = nan", "hosts.uplink", "finite"),
        ("[hosts]\nuplink = inf", "hosts.uplink", "finite"),
        ('[payload]\npatch_size = "1.5B"', "payload.patch_size", "whole number of bytes"),
        ("[payload]\nchunk_size = 10", "payload.chunk_size", "must be in"),
        ('[payload]\npatch_size = "1MB"\nchunk_size = "64MiB"', "payload.chunk_size", "far larger"),
        ("[churn]\ncrash_rate = 1.5", "churn.crash_rate", "must be in"),
        ('[run]\nstrategies = ["swarm", "bittorrent"]', "run.strategies", "bittorrent"),
        ("[run]\nstrategies = []", "run.strategies", "non-empty"),
        ("hosts = 5", "hosts", "must be a table"),
        ("bogus = 1", "bogus", "unknown key"),
        ('[seed]\nregion = "mars"', "seed.region", "unknown region"),
        ("[[regions]]\nname = 'a'\nshare = 0.5", "regions", "sum to 1"),
        ("[[regions]]\nshare = 1.0", "regions[0].name", "required"),
        ("[[regions]]\nname = 'a'\nshare = 1.0\nlatency = '3 parsecs'", "regions[0].latency", "duration"),
        ("[[regions]]\nname = 'a'\nshare = 0.5\n[[regions]]\nname = 'a'\nshare = 0.5", "regions", "unique"),
        (
            "[[regions]]\nname = 'a'\nshare = 0.5\n[[regions]]\nname = 'b'\nshare = 0.5",
            "backbones",
            "cannot be reached",
        ),
        (
            "[[regions]]\nname = 'a'\nshare = 1.0\n[[backbones]]\na = 'a'\nb = 'z'\ncapacity = 1e9",
            "backbones[0].b",
            "unknown region",
        ),
        (
            "[[regions]]\nname = 'a'\nshare = 0.5\n[[regions]]\nname = 'b'\nshare = 0.5\n"
            "[[backbones]]\na = 'a'\nb = 'b'\ncapacity = 1e9\npinned = 'yes'",
            "backbones[0].pinned",
            "true or false",
        ),
        ("regions = [1, 2, 3, 4, 5]", "regions", "1 to 4"),
        ("[hosts\ncount = 3", "", "not valid TOML"),
    ],
)
def test_bad_input_names_the_key(doc: str, key: str, words: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse_text(doc)
    assert e.value.key == key
    assert str(e.value).startswith(f"{key}: " if key else "")
    assert words in str(e.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[versions]\ncount = -1\n")
    with pytest.raises(ScenarioError, match=r"bad\.toml: versions\.count: must be an integer"):
        load(p)
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(ScenarioError, match="not UTF-8"):
        load(p)


def test_overrides_are_validated_like_the_file() -> None:
    base = load(next(p for p in SCENARIOS if p.stem == "small"))
    s = with_overrides(base.raw, {"hosts.count": 40, "payload.patch_size": parse_override_value("50MB")})
    assert (s.hosts, s.patch_size) == (40, 50_000_000)
    assert value_of(s, "payload.patch_size") == 50_000_000 and value_of(s, "churn.crash_rate") == 0.0
    assert base.hosts == 12  # the base is untouched
    assert parse_override_value("0.3") == 0.3 and parse_override_value("inf") == math.inf
    with pytest.raises(ScenarioError, match=r"^hosts\.count: must be an integer"):
        with_overrides(base.raw, {"hosts.count": parse_override_value("many")})
    with pytest.raises(ScenarioError, match=r"^regions\.share: not a sweepable key"):
        with_overrides(base.raw, {"regions.share": 1})


def test_layout_follows_shares_and_marks_slow_hosts() -> None:
    s = parse_text(
        """
        [hosts]
        count = 10
        uplink = 100
        downlink = 200
        slow_fraction = 0.2
        slow_factor = 0.5
        spread = 0.1
        [[regions]]
        name = "a"
        share = 0.55
        [[regions]]
        name = "b"
        share = 0.45
        uplink = 1000
        [[backbones]]
        a = "a"
        b = "b"
        capacity = "1Gbit/s"
        latency = "30ms"
        """
    )
    lay = layout(s)
    regions = [h.region for h in lay.peers]
    assert regions.count("a") + regions.count("b") == 10 and regions.count("a") in (5, 6)
    assert len(lay.slow) == 2
    for h in lay.peers:
        base = (100 if h.region == "a" else 1000) * (0.5 if h.id in lay.slow else 1.0)
        assert base * 0.9 <= h.up <= base * 1.1 + 1e-9
    assert layout(s) == lay  # deterministic in run.seed
    assert layout(with_overrides(s.raw, {"run.seed": 9})) != lay


def test_churn_schedule_alternates_per_host_and_is_deterministic() -> None:
    s = parse_text(
        "[hosts]\ncount = 50\n[versions]\ncount = 4\ninterval = 10\n[churn]\ncrash_rate = 0.5\nrejoin_after = 3"
    )
    lay = layout(s)
    events = churn_schedule(s, lay.peers)
    assert events == churn_schedule(s, lay.peers)
    assert 20 < sum(1 for e in events if not e.up) < 100
    state: dict[str, bool] = {}
    for e in events:
        assert state.get(e.host, True) != e.up  # a crash only when up, a rejoin only when down
        state[e.host] = e.up
    assert churn_schedule(from_dict({}), lay.peers) == ()
    never = with_overrides(s.raw, {"churn.rejoin_after": math.inf})
    assert all(not e.up for e in churn_schedule(never, layout(never).peers))


# ---------------------------------------------------------------- hypothesis: nothing but ScenarioError


def _parse_or_scenario_error(fn: Any, arg: Any) -> None:
    try:
        result = fn(arg)
    except ScenarioError as e:
        assert str(e)
        return
    assert isinstance(result, Scenario)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_a_scenario_or_a_scenario_error(text: str) -> None:
    _parse_or_scenario_error(parse_text, text)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["10Gbit/s", "4MiB", "40ms", "0.5", "inf", "1e999", "3 MB", "MB", "", "r0", "swarm"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_KEYS = {
    "hosts": ["count", "uplink", "downlink", "spread", "slow_fraction", "slow_factor"],
    "seed": ["uplink", "region"],
    "payload": ["patch_size", "checkpoint_size", "chunk_size"],
    "versions": ["count", "interval"],
    "churn": ["crash_rate", "rejoin_after", "window"],
    "network": ["window", "quantum"],
    "run": ["seed", "deadline", "strategies"],
    "swarm": ["max_inflight", "announce_fanout"],
}


@st.composite
def _documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 6))):
        section = draw(st.sampled_from(sorted(_KEYS)))
        table = doc.setdefault(section, {})
        if isinstance(table, dict):
            table[draw(st.sampled_from(_KEYS[section]))] = draw(_values)
    if draw(st.booleans()):
        doc[draw(st.sampled_from(["regions", "backbones", "name", "hosts", "other"]))] = draw(_values)
    return doc


@settings(max_examples=400, deadline=None)
@given(_documents())
def test_any_document_is_a_scenario_or_a_scenario_error(doc: dict[str, Any]) -> None:
    _parse_or_scenario_error(from_dict, doc)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([f"{s}.{k}" for s, ks in _KEYS.items() for k in ks]), _values)
def test_a_bad_override_names_its_key(key: str, value: Any) -> None:
    try:
        with_overrides({}, {key: value})
    except ScenarioError as e:
        assert e.key.startswith(key) or e.key in ("payload.chunk_size", "seed.region")

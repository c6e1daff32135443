"""Unknown PATCHSWARM_* environment variables are reported, naming the closest known one."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchswarm.daemon.config import SCHEMA, from_mapping, unknown_env
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import Swarm

MINIMAL = {
    "swarm": {"run_id": "r", "cluster_secret_file": "/s"},
    "trust": {"root": "/r.pub"},
}


def test_a_misspelt_variable_names_the_closest_known_one() -> None:
    env = {"PATCHSWARM_SWARM_UPLOAD_RAT": "1MB", "PATCHSWARM_LOG_FORMAT": "text", "HOME": "/root"}
    assert unknown_env(env) == [
        "PATCHSWARM_SWARM_UPLOAD_RAT: unknown environment variable, ignored "
        "(did you mean PATCHSWARM_SWARM_UPLOAD_RATE?)"
    ]


def test_a_variable_like_nothing_known_points_at_the_docs() -> None:
    [line] = unknown_env({"PATCHSWARM_ZZZZZZZZZZZZZZZZZZZZ": "1"})
    assert line.endswith("(the variables are listed in docs/daemon.md)")


def test_known_variables_raise_no_warning() -> None:
    env = {k.env: "x" for k in SCHEMA} | {"PATCHSWARM_FAULT_AT": "x", "PATCHSWARM_CLUSTER_SECRET": "x"}
    assert unknown_env(env) == []


def test_the_config_carries_the_warnings() -> None:
    cfg = from_mapping(MINIMAL, {"PATCHSWARM_STORE_SIZ": "1GiB"})
    assert cfg.warnings == (
        "PATCHSWARM_STORE_SIZ: unknown environment variable, ignored (did you mean PATCHSWARM_STORE_SIZE?)",
    )


@pytest.mark.asyncio
async def test_the_daemon_logs_one_line_per_unknown_variable_at_start(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)
    d.start(PATCHSWARM_SWARM_UPLOAD_RAT="1MB", PATCHSWARM_LOG_FORMAT="text")
    try:
        await d.wait_version(1)
        assert await d.stop() == 0
        lines = [line for line in d.log.read_text().splitlines() if "unknown environment variable" in line]
        assert lines == [
            "WARNING patchswarm.daemon: PATCHSWARM_SWARM_UPLOAD_RAT: unknown environment variable, ignored "
            "(did you mean PATCHSWARM_SWARM_UPLOAD_RATE?)"
        ]
    finally:
        d.cleanup()
        await sw.close()

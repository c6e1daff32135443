"""Metrics: the documented names are the exported ones, and `metrics.listen` serves them over TCP."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import aiohttp
import pytest

from patchswarm.daemon.config import ListenError
from patchswarm.daemon.metrics import DaemonMetrics, serve_metrics
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import Swarm

DOCS = Path(__file__).parents[3] / "docs"


def exported_names() -> set[str]:
    """Metric names as a scrape shows them (a counter's family ``x`` is scraped as ``x_total``)."""
    out = set()
    for mf in DaemonMetrics().registry.collect():
        out.add(mf.name + "_total" if mf.type == "counter" else mf.name)
    return out


def documented_table() -> set[str]:
    text = (DOCS / "daemon.md").read_text()
    return set(re.findall(r"^\| `([a-z_]+)` \| (?:gauge|counter|histogram) \|", text, re.M))


def test_the_docs_table_lists_exactly_the_exported_metrics() -> None:
    exported, documented = exported_names(), documented_table()
    assert documented, "docs/daemon.md has no metrics table"
    assert exported - documented == set(), "exported but not documented"
    assert documented - exported == set(), "documented but not exported"
    for name in ("patchswarm_peers", "patchswarm_time_to_activation_seconds", "process_resident_memory_bytes"):
        assert name in exported


def test_every_metric_named_anywhere_in_the_docs_is_exported() -> None:
    exported = exported_names()
    suffixes = ("_bucket", "_sum", "_count")
    # (the vLLM worker extension's methods share the prefix: docs/engines.md names them)
    methods = set(re.findall(r"def (patchswarm_[a-z_]+)", (DOCS.parent / "daemon" / "vllm_worker.py").read_text()))
    for doc in DOCS.glob("*.md"):
        for name in set(re.findall(r"\bpatchswarm_[a-z_]+\b", doc.read_text())) - methods:
            base = next((name[: -len(s)] for s in suffixes if name.endswith(s)), name)
            assert name in exported or base in exported, f"{doc.name} names {name}, which is not exported"


def test_time_to_activation_is_observed_from_head_seen_to_version_active() -> None:
    m = DaemonMetrics()
    m.sync(m._seen, 1, 1)
    m.sync(m._seen, 1, 3)  # heads of 2 and 3 seen
    m.sync(m._seen, 3, 3)  # 3 active: one observation (2 was skipped)
    m.sync(m._seen, 3, 3)
    text = m.render().decode()
    assert "patchswarm_time_to_activation_seconds_count 1.0" in text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def scrape(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


@pytest.mark.asyncio
async def test_serve_metrics_on_ipv6_loopback_and_a_taken_port_names_the_key() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    port = free_port()
    runner = await serve_metrics(lambda: b"x 1\n", f"[::1]:{port}")
    try:
        status, ctype, body = await scrape(f"http://[::1]:{port}/metrics")
        assert (status, body) == (200, "x 1\n") and ctype.startswith("text/plain")
        with pytest.raises(ListenError, match=rf"^metrics.listen = \[::1\]:{port}: address already in use$"):
            await serve_metrics(lambda: b"", f"[::1]:{port}")
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_the_daemon_serves_its_metrics_on_metrics_listen_and_logs_fields_in_text(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    port = free_port()
    d = make_daemon(sw, "d1", tmp_path, extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    d.start(PATCHSWARM_LOG_FORMAT="text")
    try:
        await d.wait_version(1)
        await d.wait_version(sw.publish(scale=5e-4))
        status, _, text = await scrape(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        scraped = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
        for name in ("patchswarm_version_applied", "patchswarm_peers", "process_resident_memory_bytes"):
            assert name in scraped, text
        assert "patchswarm_version_applied 2.0" in text
        assert re.search(r"^INFO patchswarm.daemon: activated version=2 pause_s=[0-9.]+$", d.log.read_text(), re.M)
        assert "patchswarm_time_to_activation_seconds_count" in scraped
        assert await d.stop() == 0
        with pytest.raises(aiohttp.ClientError):  # the listener closed with the daemon
            await scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.asyncio
async def test_a_taken_metrics_port_stops_the_daemon_with_a_line_naming_the_key(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = make_daemon(sw, "d1", tmp_path, extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        d.start()
        try:
            assert d.proc is not None
            rc = await asyncio.to_thread(d.proc.wait, 60)
            log = d.log.read_text()
            assert rc == 1, log
            assert f"metrics.listen = 127.0.0.1:{port}: address already in use" in log
            assert "Traceback" not in log
        finally:
            d.cleanup()
            await sw.close()

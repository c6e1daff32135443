"""Prometheus metrics of the rollout daemon (versions, bytes by source, failures, pauses, staleness).

They are served on the API socket's ``/metrics`` and, when ``metrics.listen`` is set, over TCP by
:func:`serve_metrics`.  docs/daemon.md lists every exported name (a test compares the two).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from patchswarm.daemon.config_values import bind_errors, split_listen
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.node_metrics import Metrics as NodeMetrics
from patchswarm.swarm.serving import ServerLimits, serve_tcp

# Head seen -> version active: a catch-up of a few steps over a slow link takes minutes.
ACTIVATION_BUCKETS = (0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Versions seen but not yet active that keep their first-seen time (a host far behind skips most).
_PENDING_CAP = 64


class DaemonMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.version = Gauge("patchswarm_version_applied", "Version the store holds (written and verified)", registry=r)
        self.served = Gauge(
            "patchswarm_version_served",
            "Version the engine acknowledged serving (engine.kind none: the store's)",
            registry=r,
        )
        self.target = Gauge("patchswarm_version_target", "Newest version this host knows of", registry=r)
        self.staleness = Gauge("patchswarm_staleness_versions", "Target minus applied version", registry=r)
        self.stale_seconds = Gauge(
            "patchswarm_staleness_seconds",
            "Seconds since a newer version than the applied one became known",
            registry=r,
        )
        self.applied = Counter("patchswarm_versions_applied", "Versions activated in the store", registry=r)
        self.bytes_in = Counter("patchswarm_received_bytes", "Chunk bytes received", ["source"], registry=r)
        self.bytes_out = Counter("patchswarm_uploaded_bytes", "Chunk bytes served to peers", registry=r)
        self.chunk_failures = Counter(
            "patchswarm_chunk_failures", "Chunks that failed their size or hash check", registry=r
        )
        self.bans = Counter("patchswarm_peer_bans", "Peers banned for sending bad chunks", registry=r)
        self.heads_refused = Counter(
            "patchswarm_heads_refused",
            "Signed heads refused (forged, untrusted or revoked signer, expired, other run, rewind, equivocation)",
            ["reason"],
            registry=r,
        )
        self.objects_refused = Counter(
            "patchswarm_objects_refused",
            "Board objects from peers or mirrors that were not the ones asked for (wrong manifest hash)",
            registry=r,
        )
        self.versions_unreadable = Counter(
            "patchswarm_versions_unreadable",
            "Versions skipped before any chunk was fetched: their manifest needs what this build cannot read",
            registry=r,
        )
        self.run_halted = Gauge(
            "patchswarm_run_halted",
            "1 when equivocation by the run's signer halted it (proof kept on disk)",
            registry=r,
        )
        self.head_ttl = Gauge(
            "patchswarm_head_ttl_seconds",
            "Seconds until the newest accepted head expires (negative: the board may be frozen)",
            registry=r,
        )
        self.head_age = Gauge(
            "patchswarm_head_age_seconds",
            "Seconds since the newest head this host saw (accepted, or refused as expired) was signed",
            registry=r,
        )
        self.tls_expiry = Gauge(  # (labelled by file, so absent with TLS off rather than 0)
            "patchswarm_tls_cert_expiry_timestamp_seconds",
            "Unix time the TLS certificate in use (tls.cert) expires; peers refuse it from then on",
            ["file"],
            registry=r,
        )
        self.apply_failures = Counter("patchswarm_apply_failures", "Versions that failed to fetch or apply", registry=r)
        self.pause = Histogram(
            "patchswarm_activation_pause_seconds",
            "Time the version fence was held while writing a version into the store",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.peers = Gauge("patchswarm_peers", "Peers whose holdings this node knows", registry=r)
        self.time_to_activation = Histogram(
            "patchswarm_time_to_activation_seconds",
            "From a version's head first seen to the version active in the store (sampled every 0.25 s)",
            buckets=ACTIVATION_BUCKETS,
            registry=r,
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds
        PlatformCollector(registry=r)  # python_info
        self._seen = NodeMetrics()
        self._head_seen: dict[int, float] = {}  # version -> monotonic time its head was first seen
        self._applied: int | None = None
        self._refused_seen: dict[str, int] = {}
        self._objects_seen = 0
        self._unreadable_seen = 0
        self._stale_since: float | None = None

    def sync(
        self, node: NodeMetrics, applied: int | None, target: int | None, *, swarm: SwarmNode | None = None
    ) -> None:
        """Fold the swarm node's running totals in (as deltas) and refresh the gauges."""
        if swarm is not None:
            self._sync_trust(swarm)
            self.peers.set(len(swarm.peers))
        self._sync_activation(applied, target)
        for counter, field, labels in (
            (self.bytes_in, "bytes_from_peers", {"source": "peer"}),
            (self.bytes_in, "bytes_from_seed", {"source": "seed"}),
            (self.bytes_out, "bytes_uploaded", None),
            (self.chunk_failures, "hash_failures", None),
            (self.bans, "bans", None),
            (self.apply_failures, "apply_failures", None),
        ):
            delta = getattr(node, field) - getattr(self._seen, field)
            if delta > 0:
                (counter.labels(**labels) if labels else counter).inc(delta)
            setattr(self._seen, field, getattr(node, field))
        if applied is not None:
            self.version.set(applied)
        if target is not None:
            self.target.set(target)
        lag = (target or 0) - (applied or 0) if target is not None else 0
        self.staleness.set(max(lag, 0))
        if lag > 0 and self._stale_since is None:
            self._stale_since = time.monotonic()
        elif lag <= 0:
            self._stale_since = None
        self.stale_seconds.set(0 if self._stale_since is None else time.monotonic() - self._stale_since)

    def _sync_activation(self, applied: int | None, target: int | None) -> None:
        now = time.monotonic()
        if target is not None and (applied is None or target > applied) and target not in self._head_seen:
            if len(self._head_seen) >= _PENDING_CAP:
                del self._head_seen[min(self._head_seen)]
            self._head_seen[target] = now
        if applied is not None and applied != self._applied:
            self._applied = applied
            seen = self._head_seen.get(applied)
            if seen is not None:
                self.time_to_activation.observe(now - seen)
            for v in [v for v in self._head_seen if v <= applied]:
                del self._head_seen[v]

    def _sync_trust(self, swarm: SwarmNode) -> None:
        stats = swarm.puller.stats
        for reason, count in stats.refused.items():
            delta = count - self._refused_seen.get(reason, 0)
            if delta > 0:
                self.heads_refused.labels(reason=reason).inc(delta)
            self._refused_seen[reason] = count
        refused_objects = getattr(swarm.source, "refused", 0)
        if refused_objects > self._objects_seen:
            self.objects_refused.inc(refused_objects - self._objects_seen)
            self._objects_seen = refused_objects
        if stats.unreadable > self._unreadable_seen:
            self.versions_unreadable.inc(stats.unreadable - self._unreadable_seen)
            self._unreadable_seen = stats.unreadable
        self.run_halted.set(1 if swarm.puller.tracker.halted else 0)
        # A host that only ever saw expired heads (started after the board froze) still exports how long ago.
        expires_ms = max(stats.head_expires_ms or 0, stats.frozen_since_ms or 0) or None
        if expires_ms is not None:
            self.head_ttl.set(expires_ms / 1000 - time.time())
        if stats.head_created_ms is not None:
            self.head_age.set(time.time() - stats.head_created_ms / 1000)

    def render(self) -> bytes:
        out: bytes = generate_latest(self.registry)
        return out


async def serve_metrics(
    render: Callable[[], bytes],
    listen: str,
    key: str = "metrics.listen",
    limits: ServerLimits | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> web.AppRunner:
    """Serve ``GET /metrics`` (``render()``) over TCP at ``listen`` (HOST:PORT, IPv6 as [::1]:PORT), under the
    same connection cap and deadlines as the daemon's other servers (swarm/serving.py).

    A failure to bind raises ListenError (a ConfigError) naming ``key``; the caller cleans the runner up at shutdown.
    """

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=1024)  # GET only: no request body is ever read
    app.router.add_get("/metrics", metrics)
    host, port = split_listen(listen)
    with bind_errors(key, listen):
        runner, _ = await serve_tcp(app, host, port, limits, ssl_context)  # (TLS: a scraper needs a cluster cert)
    return runner

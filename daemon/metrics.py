"""Prometheus metrics of the rollout daemon (versions, bytes by source, failures, pauses, staleness)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from swarm.node import Metrics as NodeMetrics


class DaemonMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.version = Gauge("patchswarm_version_applied", "Version the engine serves from the store", registry=r)
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
        self.chunk_failures = Counter("patchswarm_chunk_failures", "Chunks that failed their hash", registry=r)
        self.bans = Counter("patchswarm_peer_bans", "Peers banned for sending bad chunks", registry=r)
        self.apply_failures = Counter("patchswarm_apply_failures", "Versions that failed to fetch or apply", registry=r)
        self.pause = Histogram(
            "patchswarm_activation_pause_seconds",
            "Time the version fence was held while writing a version into the store",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self._seen = NodeMetrics()
        self._stale_since: float | None = None

    def sync(self, node: NodeMetrics, applied: int | None, target: int | None) -> None:
        """Fold the swarm node's running totals in (as deltas) and refresh the gauges."""
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

    def render(self) -> bytes:
        out: bytes = generate_latest(self.registry)
        return out

"""Prometheus metrics of the rollout daemon (versions, bytes by source, failures, pauses, staleness)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from swarm.node import Metrics as NodeMetrics
from swarm.node import SwarmNode


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
        self.apply_failures = Counter("patchswarm_apply_failures", "Versions that failed to fetch or apply", registry=r)
        self.pause = Histogram(
            "patchswarm_activation_pause_seconds",
            "Time the version fence was held while writing a version into the store",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self._seen = NodeMetrics()
        self._refused_seen: dict[str, int] = {}
        self._objects_seen = 0
        self._stale_since: float | None = None

    def sync(
        self, node: NodeMetrics, applied: int | None, target: int | None, *, swarm: SwarmNode | None = None
    ) -> None:
        """Fold the swarm node's running totals in (as deltas) and refresh the gauges."""
        if swarm is not None:
            self._sync_trust(swarm)
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

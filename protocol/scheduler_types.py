"""The chunk scheduler's vocabulary (protocol/scheduler.py): its configuration, what it knows of a
peer, a request it hands out, and why a request failed."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class FailureReason(enum.Enum):
    HASH = "hash"  # the chunk failed its hash: ban the peer
    ERROR = "error"  # connection or protocol error: rest the peer
    TIMEOUT = "timeout"  # past its deadline: rest the peer and cut its rate estimate
    BUSY = "busy"  # refused for load (the seed's answer when overloaded): rest for retry_after
    MISSING = "missing"  # the peer says it does not hold the chunk: clear that bit


@dataclass(frozen=True, slots=True)
class PeerInfo:
    peer_id: str
    zone: str = ""
    region: str = ""
    is_seed: bool = False  # the trainer seed: has everything, asked only as a last resort


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_inflight: int = 6  # per node (more only polls busy uplinks faster: each refusal costs both ends CPU)
    # Requests to peers in other regions, besides max_inflight (0: counted in it).  A remote flow runs at
    # most window / RTT (4 MiB / 120 ms: ~35 MB/s), so 16 fill ~550 MB/s of downlink from across an ocean.
    max_inflight_remote: int = 16
    # Per peer in this region: one flow fills a link here, and a second request to the same peer only
    # waits in its line while other holders sit idle (simulated swarms: 0.61 -> 0.59 s at N = 300).
    max_inflight_per_peer: int = 1
    # Per peer in another region (a "remote" peer, see max_inflight_remote): a flow there runs at
    # window / RTT, so one peer's uplink takes several (regions3 N = 30: 2.40 s with 2, 2.60 s with 1).
    max_inflight_per_remote_peer: int = 2
    max_inflight_seed: int = 5  # Kraken: 5 to origins
    random_first: int = 4  # BitTorrent: first pieces random, then rarest-first
    endgame_remaining: int = 3  # Kraken: endgame at <= 3 chunks left: duplicate in-flight requests
    deadline_base: float = 2.0  # per-request deadline = base + size / deadline_rate (a peer never measured)
    deadline_rate: float = 2e6  # bytes/s assumed as the slowest acceptable peer
    # A measured peer's deadline (protocol/peer_timing.py): deadline_slack x the duration its delivery
    # rate predicts for the chunk, plus 4 deviations and its round trip, at least the fixed deadline
    # above and at most deadline_max.  Across regions a transfer's time is the peer's, not a constant's:
    # the fixed 2.5 s for 1 MiB timed out 240-570 times per run on the real-latency testbed
    # (docs/bandwidth-study.md section 7).  Never shorter than the fixed one: on the testbed shorter
    # deadlines for fast peers (a 2 s floor) timed out as often.  0: the fixed deadline for every peer.
    deadline_slack: float = 2.0
    deadline_max: float = 30.0
    ban_seconds: float = 60.0  # a peer that sent a chunk failing its hash is not asked for this long
    failure_backoff: float = 1.0  # rest after error / timeout / refusal, doubling per consecutive failure
    seed_patience: float = 1.0  # seconds a chunk may wait while a peer holds it before the seed may be asked
    slow_factor: float = 4.0  # holders below seed_rate / slow_factor are "too slow": the seed may be used
    rate_alpha: float = 0.3  # EWMA weight for delivered-rate estimates
    backoff_cap: float = 30.0  # the doubling rest stops growing here
    initial_rate: float = 1.25e9  # bytes/s assumed for a peer never measured (10 Gbit/s: optimistic)
    # >0: an active set of at most this many non-seed peers, the most recently heard from (BitTorrent
    # keeps ~50 connections); a round walks every known peer, so this bounds its cost in large swarms
    # (simulated 1,000 hosts: the same time to all, 0.596 / 0.595 s).  0: every peer heard from.
    max_peers: int = 64
    # With stripe trees (``set_parents``): how long a chunk some peer holds waits for this node's
    # parent in its stripe before the usual rules may place it elsewhere (a slow or stuck relay).
    # Each such request loads a relay outside the plan: 1,000 simulated hosts took 0.5005 s with
    # 0.1, 0.4934 s with 0.2 or 0.3.
    tree_patience: float = 0.2
    # Per stripe parent: the second waits behind the first at the parent (swarm/node.py ``_follow``),
    # so the parent's flow to this node has no round trip's gap between chunks.
    max_inflight_per_parent: int = 2

    def __post_init__(self) -> None:
        for name in (
            "max_inflight",
            "max_inflight_per_peer",
            "max_inflight_per_remote_peer",
            "max_inflight_seed",
            "max_inflight_per_parent",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("random_first", "endgame_remaining", "max_inflight_remote", "max_peers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "deadline_base",
            "ban_seconds",
            "failure_backoff",
            "seed_patience",
            "backoff_cap",
            "tree_patience",
            "deadline_slack",
        ):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be finite and >= 0")
        for name in ("deadline_rate", "slow_factor", "initial_rate"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be finite and > 0")
        if not 0 <= self.deadline_max < math.inf:
            raise ValueError("deadline_max must be finite and >= 0")
        if not 0 < self.rate_alpha <= 1:
            raise ValueError("rate_alpha must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Request:
    chunk: int
    peer_id: str
    deadline: float
    duplicate: bool = False  # endgame duplicate

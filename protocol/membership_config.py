"""The membership's timing and fan-out (protocol/membership.py), and the Lifeguard suspicion timeouts
they give."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Timing and fan-out: memberlist's LAN defaults but a 10 s anti-entropy sync (memberlist: 30 s); seconds."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_probes: int = 3
    gossip_interval: float = 0.2
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    suspicion_min_mult: float = 4.0  # shortest timeout = mult * log10(N + 1) * probe_interval
    suspicion_max_mult: float = 6.0  # longest timeout, as a multiple of the shortest
    sync_interval: float = 10.0
    awareness_max: int = 8  # cap on the (1 + awareness) multiplier of probe interval and timeout
    dead_reclaim: float = 30.0
    max_piggyback: int = 16
    suspicion_confirmations: int = 3  # Lifeguard K: independent suspectors expected
    nack_fraction: float = 0.8  # a helper nacks after this share of (probe_interval - probe_timeout)
    max_members: int = 0  # >0: a bounded view of at most this many other members (see the module docstring)
    # Full membership (max_members = 0) still stops admitting strangers past this many: a peer holding the
    # cluster secret could otherwise name members without end (memory, and a probe for each address).
    max_full_members: int = 65_536
    # Gossip frames older than frame_window (by their sender's clock, beyond frame_skew) or more than
    # frame_skew ahead are refused, as are repeats: a captured frame cannot be replayed (protocol/wire.py).
    # The skew is the daemon's trust.clock_skew default: a host its heads tolerate is heard too.
    frame_window: float = 60.0
    frame_skew: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout < self.probe_interval:
            raise ValueError("need 0 < probe_timeout < probe_interval")
        if min(self.gossip_interval, self.sync_interval, self.dead_reclaim) <= 0:
            raise ValueError("intervals must be positive")
        if self.indirect_probes < 0 or self.gossip_fanout < 1 or self.retransmit_mult < 1:
            raise ValueError("indirect_probes >= 0, gossip_fanout >= 1 and retransmit_mult >= 1 required")
        if self.suspicion_min_mult <= 0 or self.suspicion_max_mult < 1:
            raise ValueError("need suspicion_min_mult > 0 and suspicion_max_mult >= 1")
        if self.awareness_max < 1 or self.max_piggyback < 1 or self.suspicion_confirmations < 0:
            raise ValueError("awareness_max >= 1, max_piggyback >= 1, suspicion_confirmations >= 0 required")
        if not 0 < self.nack_fraction < 1:
            raise ValueError("need 0 < nack_fraction < 1")
        if self.max_members < 0:
            raise ValueError("max_members must be >= 0 (0: every member)")
        if self.max_full_members < 1:
            raise ValueError("max_full_members must be >= 1")
        if not (0 <= self.frame_window < math.inf and 0 <= self.frame_skew < math.inf):
            raise ValueError("frame_window and frame_skew must be finite and >= 0")

    @property
    def nack_timeout(self) -> float:
        """How long a helper waits for the target before it nacks (so the Nack beats the deadline)."""
        return self.nack_fraction * (self.probe_interval - self.probe_timeout)


def suspicion_bounds(config: MembershipConfig, n: int) -> tuple[float, float]:
    """Shortest and longest suspicion timeout in a cluster of ``n`` live nodes (self included)."""
    shortest = config.suspicion_min_mult * math.log10(max(n, 1) + 1) * config.probe_interval
    return shortest, config.suspicion_max_mult * shortest


def suspicion_timeout(confirmations: int, expected: int, shortest: float, longest: float) -> float:
    """Lifeguard: ``longest`` with no confirmations, shrinking logarithmically to ``shortest`` at ``expected``."""
    if expected < 1:
        return shortest
    frac = math.log(confirmations + 1) / math.log(expected + 1)
    return max(shortest, longest - frac * (longest - shortest))

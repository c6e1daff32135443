"""A swarm node's counters (what the daemon's metrics export and its status prints as JSON)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metrics:
    bytes_from_peers: int = 0
    bytes_from_seed: int = 0
    bytes_uploaded: int = 0
    chunks_uploaded: int = 0
    busy_replies: int = 0
    hash_failures: int = 0
    bans: int = 0
    versions_applied: int = 0
    apply_failures: int = 0
    upload_stalls: int = 0  # transfers aborted at their deadline (the requester stopped reading)
    # transfers whose requester closed the connection before the chunk had left (it gave up: a deadline,
    # an endgame duplicate that lost), and their bytes: counted in bytes_uploaded, not all sent
    request_timeouts: int = 0  # chunk requests of this node that passed their deadline
    uploads_abandoned: int = 0
    bytes_abandoned: int = 0
    requester_refusals: int = 0  # requests refused for their requester's share or rest (upload_stall_rest)
    gossip_stale: int = 0  # authenticated gossip frames refused as too old (or too far ahead)
    gossip_replayed: int = 0  # authenticated gossip frames refused as repeats of one accepted before

"""Board objects (heads, manifests, certificates, root documents) fetched from the swarm.

A node asks, in order: what it already holds, the peer that announced the object, peers
likely to hold it, then the seed's board over plain HTTP.  Manifests are named by the hash of
their body, so a peer's wrong answer is discarded here and the next source is tried;
everything else is verified by the caller (signatures) before it is trusted or re-served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import blake3

from daemon.sources import HttpSource, SourceError
from protocol.errors import LimitExceededError
from protocol.signed import Envelope
from swarm.transport import TransportError

if TYPE_CHECKING:
    from swarm.node import SwarmNode

PEER_TRIES = 3
OBJECT_TIMEOUT = 5.0


class SwarmSource:
    def __init__(self, node: SwarmNode) -> None:
        self.node = node
        self.fetched: dict[str, bytes] = {}
        self.refused = 0  # answers that were not the object asked for (a lying peer or mirror)
        self._boards = [HttpSource(url) for url in node.config.seed_urls]

    def last_manifest_bytes(self, manifest_id: bytes) -> bytes:
        return self.fetched.get(f"manifests/{manifest_id.hex()}", b"")

    def _candidates(self, rel: str, prefer: str | None) -> list[str]:
        """``prefer``, then random peers (holders of a manifest first), then one seed.

        O(peers) filtering and O(PEER_TRIES) random draws per object, not a sort of every peer view."""
        node = self.node
        addrs: list[str] = [prefer] if prefer else []
        views = list(node.peers.values())
        if rel.startswith("manifests/"):
            mid = bytes.fromhex(rel.split("/", 1)[1])
            holders = [v for v in views if mid in v.ann.complete or any(m == mid for m, _ in v.ann.partial)]
            views = holders or views
        others = [v.info.addr for v in views if v.info.addr not in addrs]
        want = max(0, PEER_TRIES - len(addrs))
        picked = node.rng.sample(others, min(want, len(others)))
        seeds = sorted(v.info.addr for v in views if v.ann.seed and v.info.addr not in addrs)
        return addrs + picked + seeds[:1]

    def _acceptable(self, rel: str, data: bytes) -> bool:
        if not rel.startswith("manifests/"):
            return True
        try:
            if blake3.blake3(Envelope.from_bytes(data, "patchswarm/manifest").body).hexdigest() == rel.split("/", 1)[1]:
                return True
        except Exception:
            pass
        self.refused += 1
        return False

    async def get(self, rel: str, limit: int, prefer: str | None = None) -> bytes | None:
        node = self.node
        held = node.objects.get(rel)
        if held is not None and not rel.endswith("/head"):
            return held
        for addr in self._candidates(rel, prefer):
            try:
                data = await node.transport.get_object(addr, rel, limit, OBJECT_TIMEOUT)
            except TransportError:
                continue
            if data is not None and self._acceptable(rel, data):
                self.fetched[rel] = data
                return data
        for board in self._boards:
            try:
                data = await board.get(rel, limit)
            except (SourceError, LimitExceededError):
                continue
            if data is not None and self._acceptable(rel, data):
                self.fetched[rel] = data
                return data
        return None

    async def close(self) -> None:
        for b in self._boards:
            await b.close()

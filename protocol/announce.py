"""What a node announces and to whom, sans-IO.

A node pushes its availability (like BitTorrent's HAVE) soon after it changes and now and then
anyway, and a new head at once.  This object builds the announcement (a seed's is its offer:
protocol/seeding.py) and picks who hears it: peers that lack chunks we hold first, nearest first.
The asyncio node (swarm/node.py) decides when, frames and sends it.  Random choices draw from the
injected generator, in the order the node has always drawn them (a simulation replays a seed).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from patchswarm.protocol.membership import Membership
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.seeding import SeedPolicy
from patchswarm.protocol.wire import Announcement


class AnnouncePolicy:
    """``peers``, ``live`` and ``partial`` (the downloads under way: manifest id -> scheduler) are the
    node's own, read here, never written."""

    def __init__(
        self,
        config: NodeConfig,
        me: NodeInfo,
        peers: dict[str, PeerView],
        live: LiveMembers,
        membership: Membership,
        seeding: SeedPolicy,
        partial: dict[bytes, ChunkScheduler],
        rng: random.Random,
    ) -> None:
        self.config = config
        self.me = me
        self.peers = peers
        self.live = live
        self.membership = membership
        self.seeding = seeding
        self.partial = partial
        self.rng = rng

    def announcement(self, head_counter: int, version: int, complete: list[bytes], now: float) -> Announcement:
        """What this node holds: the newest versions it holds in full, and its chunks of those under way
        (a seed: what it offers of its two newest, the rest of its versions as complete)."""
        if self.config.is_seed:
            partial = self.seeding.offers(complete, now)
            offered = {mid for mid, _ in partial}
            whole = tuple(m for m in complete[-8:] if m not in offered)
        else:
            partial = tuple((mid, s.have.to_bytes()) for mid, s in self.partial.items())
            whole = tuple(complete[-8:])
        return Announcement(
            run_id=self.config.run_id,
            head_counter=head_counter,
            version=version,
            complete=whole,
            partial=partial,
            seed=self.config.is_seed,
        )

    def behind(self, head_counter: int) -> list[NodeInfo]:
        """Up to ``announce_fanout`` live members that have not announced ``head_counter``, at random:
        they hear of a new head at once, not at the next announce tick (a head spreads in hops, and
        each hop waiting for the tick would add up to ``announce_interval``)."""
        sample = self.config.announce_sample
        if 0 < sample < len(self.live):
            alive = self.rng.sample(self.live.members, sample)
        else:
            alive = sorted(self.live.members, key=lambda i: i.node_id)
        behind = []
        for info in alive:
            view = self.peers.get(info.node_id)
            if view is None or view.ann.head_counter < head_counter:
                behind.append(info)
        self.rng.shuffle(behind)
        return behind[: self.config.announce_fanout]

    def targets(self, count: int, head_counter: int, complete: list[bytes]) -> list[NodeInfo]:
        """Peers that lack chunks we hold first ("interested", as BitTorrent says), nearest first, then anyone.

        With ``announce_sample`` > 0 only that many live members, drawn at random, are considered:
        O(sample) instead of O(members) per announcement (large simulated swarms)."""
        sample = self.config.announce_sample
        if 0 < sample < len(self.live):
            alive = self.rng.sample(self.live.members, sample)
        else:
            alive = sorted(self.membership.alive(), key=lambda i: i.node_id)
        mine = {mid: self._held_bits(mid) for mid in [*self.partial, *complete[-2:]]}
        zone, region = self.me.zone, self.me.region

        def tier(i: NodeInfo) -> tuple[bool, bool]:
            return i.zone != zone, i.region != region

        interested = [i for i in alive if self._wants_from_us(i.node_id, mine)]
        if interested and not self.config.is_seed:
            interested += self._stale_nearer(alive, min(map(tier, interested)), tier, head_counter)
        self.rng.shuffle(interested)
        interested.sort(key=tier)
        chosen = {i.node_id for i in interested}
        rest = [i for i in alive if i.node_id not in chosen]
        self.rng.shuffle(rest)
        return (interested + rest)[:count]

    def _stale_nearer(
        self,
        alive: list[NodeInfo],
        nearest: tuple[bool, bool],
        tier: Callable[[NodeInfo], tuple[bool, bool]],
        head: int,
    ) -> list[NodeInfo]:
        """Peers nearer than every peer known to want our chunks, whose last announcement predates the
        head we follow: they want this version too, but interest is read from what a peer last told
        us, so hosts of one region whose views of each other predated the version announced only to
        far peers that had spoken since (a simulated 3-region swarm: asia hosts took 70-100% of their
        chunks across the ocean).  Only nearer ones, and only once some peer is known to want our
        chunks, so that where peers are alike nothing changes (a 30-host one-region swarm was 5%
        slower); not at a seed, whose one copy of each chunk would then go to its own zone."""
        out = []
        for i in alive:
            view = self.peers.get(i.node_id)
            if view is not None and view.ann.head_counter < head and not view.ann.seed and tier(i) < nearest:
                out.append(i)
        return out

    def _held_bits(self, mid: bytes) -> int | None:
        """Our chunks of a manifest as an int bitmask (None: all of them)."""
        sched = self.partial.get(mid)
        return None if sched is None else int.from_bytes(sched.have.to_bytes(), "little")

    def _wants_from_us(self, node_id: str, mine: dict[bytes, int | None]) -> bool:
        view = self.peers.get(node_id)
        if view is None:
            return False
        for mid, bits in view.ann.partial:
            if mid in mine:
                ours = mine[mid]
                theirs = int.from_bytes(bits, "little")
                if ours is None or ours & ~theirs:
                    return True
        return False

"""What a node's downloads know of their peers, sans-IO: who holds which chunks, and stripe trees.

A download (swarm/node.py ``_download``) asks its ``ChunkScheduler`` (protocol/scheduler.py) for
requests; this object keeps the scheduler told who holds what: each peer's latest announcement,
the holders a refusal named ("hints"), and, near the end, the seeds again.  It remembers which
peers changed since each download last looked, so a wake-up costs O(changes), not O(peers).  With
``tree_fanout`` it plants stripe trees (protocol/trees.py) over the members it knows.  No clock
reads: every call that needs the time takes ``now``.
"""

from __future__ import annotations

import math
import random

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import PeerInfo
from patchswarm.protocol.trees import StripeTrees
from patchswarm.protocol.wire import Announcement


def retry_delay(config: NodeConfig, failures: int, rng: random.Random) -> float:
    """How long to wait after ``failures`` failed catch-ups in a row: ``retry_backoff``, doubling per
    failure up to ``retry_backoff_max``, drawn between half and all of that (hosts that failed
    together, say on a seed's restart, do not retry in step)."""
    step = min(config.retry_backoff_max, config.retry_backoff * 2.0 ** min(failures - 1, 32))
    return step / 2 + rng.uniform(0.0, step / 2)


class Downloads:
    """``peers`` and ``live`` are the node's views, shared: this object writes ``peers`` (an
    announcement heard, a member gone, a hinted holder), the membership events update ``live``."""

    def __init__(self, config: NodeConfig, me: NodeInfo, peers: dict[str, PeerView], live: LiveMembers) -> None:
        self.config = config
        self.me = me
        self.peers = peers
        self.live = live
        self.partial: dict[bytes, ChunkScheduler] = {}  # the downloads under way, by manifest id
        self.seq = 0
        # manifest being downloaded -> peers whose announcement or hints changed since its scheduler last heard
        # (a dict as an ordered set: the same order in every process)
        self.dirty: dict[bytes, dict[str, None]] = {}
        self.hints: dict[bytes, dict[str, set[int]]] = {}  # manifest -> peer -> chunks a seed said it holds
        self.tree_children: dict[bytes, tuple[tuple[str, ...], ...]] = {}  # manifest -> per stripe: our children

    def start(self, mid: bytes, sched: ChunkScheduler, now: float) -> None:
        """A download of ``mid`` begins: every known peer is news to it.  With trees (and a member list
        that has settled, ``tree_settle``), its stripe parents are planted first."""
        if (
            self.config.tree_fanout
            and not self.config.is_seed
            and not self.config.membership.max_members  # a bounded view: each host would plan over other members
            and now - self.live.changed_at >= self.config.tree_settle
        ):
            self.plant_trees(sched, mid)
        self.partial[mid] = sched
        self.dirty[mid] = dict.fromkeys(self.peers)

    def finish(self, mid: bytes) -> None:
        """The download of ``mid`` ended (done, failed or cancelled)."""
        del self.partial[mid]
        self.hints.pop(mid, None)
        self.tree_children.pop(mid, None)
        self.dirty.pop(mid, None)

    def heard(self, sender: NodeInfo, ann: Announcement, now: float) -> None:
        """An announcement of this run from ``sender``."""
        self.seq += 1
        self.peers[sender.node_id] = PeerView(sender, ann, now, self.seq)
        for dirty in self.dirty.values():
            dirty[sender.node_id] = None

    def gone(self, node_id: str) -> None:
        """The membership declared ``node_id`` dead or gone."""
        self.peers.pop(node_id, None)
        for sched in self.partial.values():
            sched.remove_peer(node_id)
            sched.orphan(node_id)

    def missing_at(self, mid: bytes, peer_id: str, chunk: int) -> None:
        """``peer_id`` answered that it has not got ``chunk``: forget a hint that said it had."""
        self.hints.get(mid, {}).get(peer_id, set()).discard(chunk)
        self.touch(peer_id)

    def children(self, mid: bytes, chunk: int) -> tuple[str, ...]:
        """With trees, the members whose parent this node is in ``chunk``'s stripe (told of it at once)."""
        children = self.tree_children.get(mid)
        if not children:
            return ()
        return children[chunk % len(children)]

    def take_hints(self, mid: bytes, chunk: int, holders: tuple[str, ...], missing: int, now: float) -> bool:
        """A refusal named peers that got ``chunk``: ask them (``missing``: chunks we still lack).
        True: the download should look again (it named someone)."""
        if not holders:
            return False
        hints = self.hints.setdefault(mid, {})
        # Near the end a hint about a live member that never announced to us still names a holder
        # worth asking (earlier, many nodes asking the seed's first holder at once only crowd it).
        last_chunks = missing <= self.config.scheduler.endgame_remaining
        for holder in holders:
            if holder != self.me.node_id:
                hints.setdefault(holder, set()).add(chunk)
                if last_chunks and holder not in self.peers and (info := self.live.get(holder)) is not None:
                    ann = Announcement(self.config.run_id, -1, -1)
                    self.peers[holder] = PeerView(info, ann, now)
                self.touch(holder)
        return True

    def touch(self, node_id: str) -> None:
        """What ``node_id`` holds may have changed (a hint): every download looks at it again."""
        view = self.peers.get(node_id)
        if view is not None:
            self.seq += 1
            view.seq = self.seq
            for dirty in self.dirty.values():
                dirty[node_id] = None

    def refresh(self, sched: ChunkScheduler, mid: bytes, nchunks: int, now: float) -> None:
        """Tell the scheduler who holds what: announcements, plus the seed's hints not yet announced.

        Only peers whose announcement or hints changed since the last call are looked at, so one
        wake-up costs O(changes), not O(peers)."""
        hints = self.hints.get(mid, {})
        changed = self.dirty.get(mid)
        if not changed:
            return
        self.dirty[mid] = {}
        for node_id in changed:
            view = self.peers.get(node_id)
            if view is None:
                continue
            ann = view.ann
            peer = PeerInfo(view.info.node_id, view.info.zone, view.info.region, is_seed=ann.seed)
            bits = None
            for partial_mid, partial_bits in ann.partial:  # (usually one: no dict per peer and wake)
                if partial_mid == mid:
                    bits = partial_bits
            if bits is None and (ann.seed or mid in ann.complete):
                sched.update_peer(peer, None, now)
                continue
            hinted = hints.get(view.info.node_id)
            if bits is None and not hinted:
                continue
            try:
                has = Bitfield.mask_from_bytes(nchunks, bits) if bits is not None else 0
            except PatchswarmError:
                continue  # a malformed bitfield: ignore that claim
            for i in hinted or ():
                has |= 1 << i
            sched.update_peer(peer, has, now)

    def ask_seeds_again(self, sched: ChunkScheduler, nchunks: int, asked: dict[int, float], now: float) -> bool:
        """Nothing in flight, nothing to ask, and only the last ``endgame_remaining`` chunks left: the
        seeds hold every chunk, so take back what their refusals (a withheld chunk reads as MISSING
        for ``failure_backoff``) said, at most every ``busy_retry_after`` per chunk; a seed serves a
        finishing requester what it withholds from others (``SeedPolicy.requester_finishing``).  Without this a
        node that heard of no holder of its last chunks sat idle until the refusals aged (a simulated
        1,000-host swarm, cold start: the last host sat 360 ms with two chunks left).  Only at the end:
        earlier, asking the seed again while holders exist costs it copies (16 hosts, 50 ms copy
        windows: 1.5-1.6 copies against 1.1).  True when there is something to ask now."""
        if not 0 < nchunks - sched.held_count <= self.config.scheduler.endgame_remaining:
            return False
        left = [c for c in range(nchunks) if not sched.holds(c)]
        seeds = [view.info.node_id for view in self.peers.values() if view.ann.seed]
        due = [c for c in left if now >= asked.get(c, -math.inf) + self.config.busy_retry_after]
        for c in due:
            asked[c] = now
            for seed in seeds:
                sched.on_have(seed, c, now)
        return bool(due and seeds)

    def plant_trees(self, sched: ChunkScheduler, mid: bytes) -> None:
        """Stripe trees over the non-seed members of this node's region it knows of (itself included).
        A flow across regions runs at window / RTT, so a tree stays in its region; where no seed is in
        the region, its roots fetch by the usual rules (from holders anywhere, or the seed)."""
        me = self.me
        members = [me.node_id]
        seed_here = False
        for info in self.live.members:
            view = self.peers.get(info.node_id)
            if view is not None and view.ann.seed:
                seed_here = seed_here or info.region == me.region
            elif info.region == me.region:
                members.append(info.node_id)
        trees = StripeTrees.build(mid, members, self.config.tree_fanout)
        parents = trees.parents(me.node_id)
        sched.set_parents(parents if seed_here else tuple("" if p is None else p for p in parents))
        self.tree_children[mid] = trees.children(me.node_id)

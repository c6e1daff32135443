"""A seed's serving policy, sans-IO: super-seeding windows, withholding, booked returns, manifest copies.

A seed holds every chunk first, and its uplink is the swarm's scarcest link while chunks are new.  It
hands out each chunk at most once per ``seed_copy_window`` and offers only what it has not handed out
(BitTorrent's "super-seeding"), names the holders to those it refuses, spaces the returns of the
requesters it turns away, and hands each manifest to ``seed_object_copies`` requesters before naming
them to the rest.  The asyncio node (swarm/node.py, swarm/uploads.py) asks this object and acts on the
answers; every call takes ``now``, and the one random choice draws from the injected generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView

SEED_HOLD_WINDOWS = 4  # a seed withholds a chunk peers announce for at most this many seed_copy_windows


class SeedPolicy:
    """What a seed offers, withholds and names.  ``peers``: the node's views of its peers (read, not
    written); ``manifest_chunks``: a version's chunk hashes by manifest id, in order (the seed's board)."""

    def __init__(
        self,
        config: NodeConfig,
        peers: dict[str, PeerView],
        manifest_chunks: Callable[[bytes], list[bytes]],
        rng: random.Random,
    ) -> None:
        self.config = config
        self.peers = peers
        self.manifest_chunks = manifest_chunks
        self.rng = rng
        self.served: dict[bytes, tuple[float, tuple[str, ...]]] = {}  # chunk -> (when handed out, to whom)
        self.chunk_lists: dict[bytes, list[bytes]] = {}
        self.chunk_index: dict[bytes, dict[bytes, int]] = {}  # manifest -> chunk hash -> its index
        # manifest path -> (when the seed started counting, node ids it gave the manifest to since)
        self.objects_given: dict[str, tuple[float, list[str]]] = {}
        self.next_return = 0.0  # the next free return time for a refused requester

    def offers(self, complete: list[bytes], now: float) -> tuple[tuple[bytes, bytes], ...]:
        """What a seed offers of the newest versions: chunks it has not handed out within the window,
        less those it handed out before that peers now announce (see ``refusal``)."""
        window = self.config.seed_copy_window
        offers = []
        for mid in complete[-2:]:
            hashes = self.chunks_of(mid)
            offer = Bitfield(len(hashes))
            announced: int | None = None  # computed only if some handed-out chunk's window has passed
            for i, h in enumerate(hashes):
                last = self.served.get(h, (-math.inf, ()))[0]
                if now - last < window:
                    continue
                if now - last < SEED_HOLD_WINDOWS * window:
                    if announced is None:
                        announced = self.announced_bits(mid, now)
                    if announced >> i & 1:
                        continue
                offer.set(i)
            offers.append((mid, offer.to_bytes()))
        return tuple(offers)

    def announced_bits(self, mid: bytes, now: float) -> int:
        """The chunks of ``mid`` some non-seed peer heard from within the window announces (bit i: chunk i; -1: all)."""
        bits = 0
        recent = now - self.config.seed_copy_window
        for view in self.peers.values():
            ann = view.ann
            if ann.seed or view.seen < recent:
                continue
            if mid in ann.complete:
                return -1
            for m, b in ann.partial:
                if m == mid:
                    bits |= int.from_bytes(b, "little")
        return bits

    def announced_holders(
        self, chunk_hash: bytes, complete: list[bytes], now: float, limit: int = 4
    ) -> tuple[str, ...]:
        """Up to ``limit`` non-seed peers heard from within the window that announce holding the chunk (O(peers)).

        Only recent announcements count: a crashed holder stops announcing long before membership
        declares it dead."""
        place = self.chunk_place(chunk_hash, complete)
        if place is None:
            return ()
        mid, i, _ = place
        recent = now - self.config.seed_copy_window
        holders = []
        for view in self.peers.values():
            ann = view.ann
            if ann.seed or view.seen < recent:
                continue
            if mid in ann.complete or any(
                m == mid and len(b) * 8 > i and b[i >> 3] >> (i & 7) & 1 for m, b in ann.partial
            ):
                holders.append(view.info.node_id)
                if len(holders) >= limit:
                    break
        return tuple(holders)

    def chunks_of(self, mid: bytes) -> list[bytes]:
        hashes = self.chunk_lists.get(mid)
        if hashes is None:
            hashes = self.manifest_chunks(mid)
            self.chunk_lists[mid] = hashes
        return hashes

    def chunk_place(self, chunk_hash: bytes, complete: list[bytes]) -> tuple[bytes, int, int] | None:
        """(manifest id, first index, chunks in the version) of a chunk in the seed's two newest
        versions (the older first), or None: a dict lookup, not a scan, on each request the seed gets."""
        for mid in complete[-2:]:
            hashes = self.chunks_of(mid)
            index = self.chunk_index.get(mid)
            if index is None:
                index = self.chunk_index[mid] = {h: i for i, h in reversed(list(enumerate(hashes)))}
            i = index.get(chunk_hash)
            if i is not None:
                return mid, i, len(hashes)
        return None

    def requester_finishing(self, chunk_hash: bytes, held: int, complete: list[bytes]) -> bool:
        """The requester says it lacks at most ``endgame_remaining`` chunks of this chunk's version: a
        seed serves it even a chunk it withholds.  Its last chunks are the ones the swarm's slowest
        host waits for, when the holders it heard of are busy or named wrongly (a simulated 1,000-host
        swarm, cold start: its last host sat 360 ms with two chunks left and no holder it knew of); one more copy of
        a few chunks costs the seed little.  A requester lying about it only gets served as by a
        central seed, within the seed's upload slots."""
        if held < 0:
            return False
        place = self.chunk_place(chunk_hash, complete)
        return place is not None and place[2] - held <= self.config.scheduler.endgame_remaining

    def refusal(self, chunk_hash: bytes, complete: list[bytes], now: float) -> tuple[str, ...] | None:
        """The holders to name instead of serving the chunk, or None: serve it.

        A seed hands out each chunk once per window; within it, the requester is pointed at the
        holders.  (The driver answers with a Missing naming them, not a Busy: the seed is not loaded,
        it withholds this chunk, and the requester should ask it for another at once; a Busy would
        rest the seed for everyone it refused, leaving its uplink idle while chunks nobody holds wait.)

        After the window, a chunk handed out before is refused still while live peers announce holding
        it: on a slow (or loaded) swarm the window passes before the peers have passed the chunk
        round, and the seed would otherwise serve it again to everyone who has not found a holder yet.
        It is served again once no live peer announces it (its holders died or never shared it), and
        after ``SEED_HOLD_WINDOWS`` windows in any case: an announcement is only a claim (a lying or
        broken peer must not keep the chunk from everyone)."""
        last, given_to = self.served.get(chunk_hash, (-math.inf, ()))
        age = now - last
        if age < self.config.seed_copy_window:
            return given_to
        if age < SEED_HOLD_WINDOWS * self.config.seed_copy_window and (
            holders := self.announced_holders(chunk_hash, complete, now)
        ):
            return holders
        return None

    def hand_out(self, chunk_hash: bytes, requester: str, now: float) -> None:
        """The chunk goes out now (its window starts)."""
        self.served[chunk_hash] = (now, (requester,) if requester else ())

    def return_time(self, now: float, back: float, per_upload: float) -> float:
        """The seed spaces the requesters it refuses half an upload apart (its slots free one every
        ``per_upload``), after those it refused before: they come back at twice the rate it can take
        them, so its line stays full and few are refused twice (a simulated 200-host swarm: 1,000
        refusals per 20 ms at the seed became ~10; 4 seeds: 25% fewer requests in all, 2% sooner done).
        Bookings wrap round at ``busy_retry_after`` ahead (everyone told "the longest wait" would come
        back at once)."""
        first = back
        back = max(back, self.next_return)
        if back - now >= self.config.busy_retry_after:
            back = first  # the bookings reach the longest wait: start again from the earliest return
        self.next_return = back + per_upload / 2
        return back

    def object_holders(self, path: str, requester: str, live: LiveMembers, now: float) -> tuple[str, ...] | None:
        """For a manifest request from ``requester``: the addresses of up to 4 live requesters it was
        given to, to ask instead, or None: serve it.

        A seed hands each manifest to ``seed_object_copies`` requesters, then names some of those
        still alive to the others (they ask them, then come back insisting, and are served),
        counting afresh every ``SEED_HOLD_WINDOWS`` copy windows (8 s).  On a cold start every host
        asks the seed for the same manifest within a millisecond: 10,000 simulated hosts took 41 ms
        of its uplink that way (51 MB of a 6 KB manifest; a 70B model's anchor manifest is ~1 MB)
        before the chunks only it holds could go out."""
        since, given = self.objects_given.get(path, (now, []))
        if now - since > SEED_HOLD_WINDOWS * self.config.seed_copy_window:
            since, given = now, []  # an anchor's manifest stays for many versions; its first holders may be gone
        self.objects_given[path] = (since, given)
        if len(given) >= self.config.seed_object_copies:
            alive = [info.addr for g in given if (info := live.get(g)) is not None]
            if alive:
                return tuple(self.rng.sample(alive, min(4, len(alive))))
            given.clear()  # every one of them is gone: hand it out afresh
        if requester in live:  # only a requester that can be named counts as a copy given
            given.append(requester)
        return None

    def keep_objects(self, named: set[str]) -> None:
        """Stop counting copies of manifests the head no longer names."""
        self.objects_given = {p: a for p, a in self.objects_given.items() if p in named}

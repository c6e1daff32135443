"""The asyncio swarm node: drives the sans-IO cores over a Transport and a Clock, so the same node
runs on real sockets and in virtual time.

The rules are in protocol/: membership, the chunk scheduler, and the node's own (announce.py what
to announce and to whom, uploads.py and seeding.py the upload slots and the seed's serving policy,
head_follow.py the head followed, download.py what downloads know of their peers).  This module
holds the node's lifecycle, its gossip and membership loops and the catch-up; serving chunks is in
swarm/uploads.py, fetching them in swarm/download.py, fetching heads in swarm/heads.py.

A node follows one run: it learns of new heads (gossip, or polling the seed's board), plans
the fewest-bytes path from the version it holds, fetches each manifest and then every chunk
from peers (the seed only as a last resort), verifies each chunk before storing or serving
it, applies the version to a staging copy, verifies the target digest, and only then makes
it the held version.  What it verified it serves to others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from patchswarm.protocol.announce import AnnouncePolicy
from patchswarm.protocol.board_names import HEAD_TAG, head_rel, manifest_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import verify_chunk
from patchswarm.protocol.download import Downloads, retry_delay
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.head import Head
from patchswarm.protocol.head_follow import HeadFollower
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.membership import Membership
from patchswarm.protocol.membership_messages import MemberState, Message, NodeInfo, Send
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.seeding import SeedPolicy
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.uploads import UploadPolicy
from patchswarm.protocol.wire import (
    SEQ_PER_MS,
    STALE,
    Announcement,
    FrameGuard,
    GossipFrame,
    WireError,
    decode_frame,
    encode_frame,
)
from patchswarm.swarm.board_files import BoardReader
from patchswarm.swarm.download import ChunkFetcher, VerifyChunk
from patchswarm.swarm.futures import settle
from patchswarm.swarm.heads import HeadFetcher
from patchswarm.swarm.node_metrics import Metrics
from patchswarm.swarm.puller import Puller
from patchswarm.swarm.sources import SwarmSource
from patchswarm.swarm.staging import ApplyVersion, apply_chunks
from patchswarm.swarm.stores import ChunkStore, MemoryChunkStore
from patchswarm.swarm.transport import Busy, Clock, Handlers, Missing, SendChunk, Transport, TransportError
from patchswarm.swarm.uploads import ChunkServer

log = logging.getLogger("patchswarm.swarm")

REJOIN_INTERVAL = 5.0


class SwarmNode:
    def __init__(
        self,
        config: NodeConfig,
        addr: str,
        transport: Transport,
        clock: Clock,
        policy: KeyPolicy,
        rng: random.Random,
        *,
        chunks: ChunkStore | None = None,
        board: BoardReader | None = None,
        held: Held | None = None,
        on_version: Callable[[Held], Awaitable[None] | None] | None = None,
        verify_chunk: VerifyChunk = verify_chunk,
        apply: ApplyVersion = apply_chunks,
    ) -> None:
        self.config = config
        self.info = NodeInfo(config.node_id, addr, config.zone, config.region)
        self._transport = transport
        self.clock = clock
        self.policy = policy
        self.rng = rng
        self.board = board  # the seed's own board (it serves every object and chunk from there)
        self.chunks: ChunkStore = chunks if chunks is not None else MemoryChunkStore(config.cache_bytes)
        self.objects: dict[str, bytes] = {}  # verified board objects this node serves
        self.held = held
        self.on_version = on_version
        self.apply = apply
        self.metrics = Metrics()
        self.membership = Membership(self.info, config.membership, rng, clock.now())
        # Frame freshness (protocol/wire.py): our frames' counter, and the check on the frames we receive.
        self._frame_seq = int(clock.wall() * 1000) * SEQ_PER_MS
        self.frame_guard = FrameGuard(
            round(config.membership.frame_window * 1000), round(config.membership.frame_skew * 1000)
        )
        self.peers: dict[str, PeerView] = {}
        self.follow = HeadFollower()  # the head held, the fetch under way, refusals warned of
        self.complete: list[bytes] = []  # manifest ids whose chunks this node holds in full (newest last)
        self.live = LiveMembers()  # live members, kept from membership events
        self.downloads = Downloads(config, self.info, self.peers, self.live)
        self.partial = self.downloads.partial  # the downloads under way: manifest id -> its scheduler
        self.applied: list[CatalogEntry] = []  # every catalog step this node applied, in order
        self.phase = "idle"  # idle | fetching | staging (applying and verifying a version off to the side)
        self.seeding = SeedPolicy(config, self.peers, self._board_chunk_hashes, rng)
        self.uploads = UploadPolicy(config, self.seeding)
        self.upload_bucket = self.uploads.bucket
        self.upload_slots = self.uploads.slots
        self.requesters = self.uploads.requesters
        self.announce = AnnouncePolicy(
            config, self.info, self.peers, self.live, self.membership, self.seeding, self.partial, rng
        )
        self.source = SwarmSource(self, config.seed_urls)
        self.puller = Puller(
            self.source, policy, config.run_id, clock=self._wall, payload_formats=config.payload_formats
        )
        self._wake = asyncio.Event()
        self._announce_dirty = False
        self._announce_wake = asyncio.Event()  # set with _announce_dirty: wakes an idle announce loop
        self._announce_tick: asyncio.Future[None] | None = None  # the announce loop's interval, while it waits
        # The loop the node runs on, taken on first use: asyncio.get_running_loop() makes a getpid()
        # system call each time (Python 3.11), and the hot paths below would make hundreds of thousands.
        self._io_loop: asyncio.AbstractEventLoop | None = None
        self.serving = ChunkServer(
            config,
            config.node_id,
            self.chunks,
            clock,
            self.metrics,
            self.uploads,
            self.seeding,
            self._complete,
            self._availability_changed,
            self._loop,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        # (what, version, clock time) of each step of the latest catch-ups: "head" accepted, "manifest"
        # fetched, "chunk" (the first one verified), "chunks" (all), "applied"; for studies of where time goes.
        self.marks: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=64)
        self.error: str | None = None  # why the last catch-up failed (None once one succeeds)
        self.failures = 0  # catch-ups failed in a row (the retry backoff grows with it)
        self.retry_at: float | None = None  # clock time of the next try, while a failed one waits
        self.heads = HeadFetcher(
            config,
            config.node_id,
            clock,
            self.follow,
            self.source,
            self.puller,
            self.objects,
            self.partial,
            self.marks,
            self._took_head,
        )
        self.fetcher = ChunkFetcher(
            config,
            self.info,
            self.chunks,
            clock,
            transport,
            self.downloads,
            self.metrics,
            rng,
            verify_chunk,
            self.marks,
            self._got_chunk,
            self._loop,
            from_board=self.source.board_chunk if config.seed_urls and not config.is_seed else None,
        )
        self.download_bucket = self.fetcher.bucket
        self.seed_bytes_by_manifest = self.fetcher.seed_bytes_by_manifest  # chunk bytes per manifest id
        self.peer_bytes_by_manifest = self.fetcher.peer_bytes_by_manifest

    # ------------------------------------------------------------ lifecycle

    @property
    def transport(self) -> Transport:
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """(A partitioned simulation gives its nodes their transport after they are built.)"""
        self._transport = transport
        self.fetcher.transport = transport

    @property
    def verify_chunk(self) -> VerifyChunk:
        """How a received chunk is checked (the simulator's placeholders: by size alone)."""
        return self.fetcher.verify_chunk

    @verify_chunk.setter
    def verify_chunk(self, verify: VerifyChunk) -> None:
        self.fetcher.verify_chunk = verify

    @property
    def head(self) -> Head | None:
        """The head this node follows (verified; a seed: its board's)."""
        return self.follow.head

    @property
    def head_counter(self) -> int:
        return self.follow.counter

    @head_counter.setter
    def head_counter(self, counter: int) -> None:
        self.follow.counter = counter

    @property
    def head_error(self) -> str | None:
        """Why the last head this node checked was refused (None: it was not)."""
        return self.follow.error

    @head_error.setter
    def head_error(self, error: str | None) -> None:
        self.follow.error = error

    def handlers(self) -> Handlers:
        return Handlers(
            gossip=self.handle_gossip,
            chunk=self.handle_chunk,
            object=self.handle_object,
            refuse=self.refuse_chunk,
            chunk_from=self.handle_chunk,
        )

    def _complete(self) -> list[bytes]:
        return self.complete

    def _board_chunk_hashes(self, mid: bytes) -> list[bytes]:
        assert self.board is not None
        return [ref.hash for ref in self.board.manifest(mid).chunks]

    def _wall(self) -> float:
        return self.clock.wall()

    def _wall_ms(self) -> int:
        return int(self.clock.wall() * 1000)

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._io_loop
        if loop is None:
            loop = self._io_loop = asyncio.get_running_loop()
        return loop

    async def start(self) -> None:
        if self.board is not None:
            self._load_board_head()
        seeds = [NodeInfo("", addr) for addr in self.config.bootstrap if addr != self.info.addr]
        self._dispatch(self.membership.join(seeds, self.clock.now()))
        self._tasks = [
            asyncio.create_task(self._membership_loop(), name=f"{self.info.node_id}-membership"),
            asyncio.create_task(self._announce_loop(), name=f"{self.info.node_id}-announce"),
        ]
        if self.board is not None:
            self._tasks.append(asyncio.create_task(self._board_watch_loop(), name=f"{self.info.node_id}-board"))
        else:
            self._tasks.append(asyncio.create_task(self._sync_loop(), name=f"{self.info.node_id}-sync"))
            if self.config.seed_urls:
                self._tasks.append(asyncio.create_task(self._head_poll_loop(), name=f"{self.info.node_id}-poll"))

    async def stop(self, *, leave: bool = True) -> None:
        self._stopping = True
        if leave:
            for send in self.membership.leave(self.clock.now()):
                with contextlib.suppress(TransportError):
                    await self.transport.send(send.to.addr, self._frame(send.message))
        tasks = [*self._tasks, *self._background]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    # ------------------------------------------------------------ gossip

    def announcement(self) -> Announcement:
        return self.announce.announcement(
            self.head_counter, self.held.version if self.held else -1, self.complete, self.clock.now()
        )

    def _frame(self, message: Message | None) -> bytes:
        self._frame_seq += 1
        frame = GossipFrame(self.info, self.announcement(), message, self._wall_ms(), self._frame_seq)
        return encode_frame(self.config.cluster_secret, frame)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Fire-and-forget work that stop() must still cancel."""
        if self._stopping:
            coro.close()
            return
        task = self._loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _dispatch(self, sends: list[Send]) -> None:
        if self._stopping:
            return
        for send in sends:
            self.transport.post(send.to.addr, self._frame(send.message))

    def handle_gossip(self, data: bytes) -> None:
        try:
            frame = decode_frame(self.config.cluster_secret, data)
        except WireError as e:
            log.warning("%s: dropped gossip: %s", self.info.node_id, e)
            return
        if frame.sender.node_id == self.info.node_id:
            return
        if (why := self.frame_guard.check(frame.sender.node_id, frame.sent_ms, frame.seq, self._wall_ms())) is not None:
            # Authenticated but not fresh: a replay, or a sender whose clock is off by more than frame_skew.
            if why == STALE:
                self.metrics.gossip_stale += 1
            else:
                self.metrics.gossip_replayed += 1
            log.debug("%s: dropped gossip from %s: %s", self.info.node_id, frame.sender.node_id, why)
            return
        now = self.clock.now()
        if frame.message is not None:  # None: an availability push only
            self._dispatch(self.membership.receive(now, frame.sender, frame.message))
        self._on_announcement(frame.sender, frame.announcement, now)
        self._apply_membership_events()

    def _on_announcement(self, sender: NodeInfo, ann: Announcement, now: float) -> None:
        if ann.run_id != self.config.run_id:
            return
        self.downloads.heard(sender, ann, now)
        if log.isEnabledFor(logging.DEBUG) and ann.partial:
            log.debug(
                "%s: hears %s has %s",
                self.info.node_id,
                sender.node_id,
                [bin(int.from_bytes(b, "little")).count("1") for _, b in ann.partial],
            )
        self.fetcher.wake(news=True)
        if self.board is None and self.follow.fetch_for(ann.head_counter):
            self._spawn(self.heads.fetch(prefer=sender.addr, counter=ann.head_counter))

    def _apply_membership_events(self) -> None:
        for info, state in self.membership.drain_events():
            self.live.track(info, state, self.clock.now())
            if state in (MemberState.DEAD, MemberState.LEFT):
                self.downloads.gone(info.node_id)
                self.fetcher.wake()

    def settle_members(self) -> None:
        """Take the membership's news so far as old: a node given the view of a running swarm (a
        simulation's warm start) has known these members for long, as ``tree_settle`` asks."""
        self.live.settle(self.clock.now())

    async def _membership_loop(self) -> None:
        last_join = self.clock.now()
        while not self._stopping:
            now = self.clock.now()
            if now - last_join >= REJOIN_INTERVAL and not self.membership.alive_count():  # cheap test first
                # Alone (a long partition, or every peer restarted): knock on the bootstrap list again.
                last_join = now
                seeds = [NodeInfo("", addr) for addr in self.config.bootstrap if addr != self.info.addr]
                self._dispatch(self.membership.join(seeds, now))
            self._dispatch(self.membership.tick(now))
            self._apply_membership_events()
            delay = max(0.01, min(self.membership.next_deadline() - self.clock.now(), 1.0))
            await self.clock.sleep(delay)

    async def _announce_loop(self) -> None:
        """Push our availability soon after it changes (like BitTorrent's HAVE), and now and then anyway.

        At most one push per ``announce_interval``; between changes the loop sleeps until the next
        change or refresh instead of waking every interval (thousands of idle nodes in a simulation)."""
        last_refresh = self.clock.now()
        loop = self._loop()
        while not self._stopping:
            # The interval, cut short by rare news (one future and one timer: thousands of nodes do this).
            tick: asyncio.Future[None] = loop.create_future()
            timer = loop.call_later(self.config.announce_interval, settle, tick, None)
            self._announce_tick = tick
            try:
                await tick
            finally:
                self._announce_tick = None
                timer.cancel()
            now = self.clock.now()
            if not self._announce_dirty and (rest := last_refresh + self.config.announce_refresh - now) > 0:
                self._announce_wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(rest):
                        await self._announce_wake.wait()
                now = self.clock.now()
            if self._announce_dirty:
                self._announce_dirty = False
                targets = self.announce.targets(self.config.announce_fanout, self.head_counter, self.complete)
            elif now - last_refresh >= self.config.announce_refresh:
                last_refresh = now
                targets = self.announce.targets(self.config.membership.gossip_fanout, self.head_counter, self.complete)
            else:
                continue
            frame = self._frame(None)
            for info in targets:
                self.transport.post(info.addr, frame)

    def _availability_changed(self, *, rare: bool = False) -> None:
        """Announce what we hold at the next tick; ``rare`` (a chunk few peers hold): now."""
        self._announce_dirty = True
        self._announce_wake.set()
        if rare and self._announce_tick is not None:
            settle(self._announce_tick, None)

    def _push_head(self) -> None:
        """Tell peers that have not announced our head counter about it now, not at the next announce tick:
        a head spreads in hops, and each hop waiting for the tick would add up to ``announce_interval``."""
        if not self.config.head_push or self._stopping:
            return
        targets = self.announce.behind(self.head_counter)
        if not targets:
            return
        frame = self._frame(None)
        for info in targets:
            self.transport.post(info.addr, frame)

    # ------------------------------------------------------------ serving

    async def handle_chunk(
        self, chunk_hash: bytes, requester: str, held: int, send: SendChunk, origin: str = ""
    ) -> Busy | Missing | None:
        """Answer a chunk request (swarm/uploads.py ``ChunkServer.handle_chunk``)."""
        return await self.serving.handle_chunk(chunk_hash, requester, held, send, origin)

    def refuse_chunk(self, chunk_hash: bytes, requester: str, held: int) -> Busy | Missing | None:
        """The refusal ``handle_chunk`` would answer at once, or None (``ChunkServer.refuse_chunk``)."""
        return self.serving.refuse_chunk(chunk_hash, requester, held)

    async def handle_object(
        self, path: str, requester: str = "", insist: bool = False, *, off_loop: bool = False
    ) -> bytes | Missing | None:
        """A board object this node holds (a seed: its board's); None if it has not got it.

        A seed hands each manifest to ``seed_object_copies`` requesters, then answers the others with
        the addresses of up to 4 of those still alive (they ask them, then come back insisting, and
        are served), counting afresh every ``SEED_HOLD_WINDOWS`` copy windows (8 s).
        On a cold start every host asks the seed for the same manifest within a millisecond: 10,000
        simulated hosts took 41 ms of its uplink that way (51 MB of a 6 KB manifest; a 70B model's
        anchor manifest is ~1 MB) before the chunks only it holds could go out.
        ``off_loop``: read the board file in a thread (a real server: a manifest may be 64 MiB; a
        simulation keeps its reads on its virtual clock)."""
        if path.startswith("chunks/"):
            return None  # chunks go out through handle_chunk only, under the upload slots and the rate limit
        if self.board is None:
            return self.objects.get(path)
        # Confined to the board's layout, bounded (swarm/board_files.py).
        read = self.board.read_served
        data = await asyncio.to_thread(read, path) if off_loop else read(path)
        copies = self.config.seed_object_copies
        if data is None or not self.config.is_seed or insist or copies <= 0 or not path.startswith("manifests/"):
            return data
        if not requester:
            return data  # a client that does not name itself (older nodes, plain HTTP) cannot follow names
        holders = self.seeding.object_holders(path, requester, self.live, self.clock.now())
        if holders is not None:
            return Missing(holders)
        return data

    # ------------------------------------------------------------ heads

    def _load_board_head(self) -> None:
        assert self.board is not None
        data = self.board.read(head_rel(self.config.run_id))
        if data is None:
            return
        head = Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)
        if self.follow.board_head(head):
            self.complete = [e.manifest_id for e in head.catalog]
            named = {manifest_rel(mid) for mid in self.complete}
            self.seeding.keep_objects(named)
            self._availability_changed()
            self._push_head()

    async def _board_watch_loop(self) -> None:
        while not self._stopping:
            try:
                self._load_board_head()
            except (PatchswarmError, OSError) as e:
                log.warning("seed: cannot read the board head: %s", e)
            await self.clock.sleep(self.config.board_watch_interval)

    def board_changed(self) -> None:
        """The seed's board head may have moved (a publisher's notification): read it now, not at the next watch."""
        self._load_board_head()

    async def _head_poll_loop(self) -> None:
        while not self._stopping:
            await self.heads.fetch(prefer=None)
            await self.clock.sleep(self.config.head_poll_interval)

    # ------------------------------------------------------------ fetching versions

    async def _sync_loop(self) -> None:
        while not self._stopping:
            head = self.head
            if head is None or (self.held is not None and self.held.version >= head.version):
                self._wake.clear()
                await self._wait(self._wake, 1.0)
                continue
            try:
                await self._catch_up(head)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure: report it, keep the node alive, retry from a clean state
                self.phase = "idle"
                self.error = f"{type(e).__name__}: {e}" if not isinstance(e, PatchswarmError) else str(e)
                self.metrics.apply_failures += 1
                self.failures += 1
                delay = self.retry_delay()
                log.warning("%s: catch-up failed: %s (retry in %.1f s)", self.info.node_id, self.error, delay)
                self.retry_at = self.clock.now() + delay
                self._wake.clear()  # (set by the head this try followed: only a newer one cuts the wait)
                await self._wait(self._wake, delay)
                self.retry_at = None
            else:
                self.error, self.failures = None, 0

    def retry_delay(self) -> float:
        """How long to wait after ``failures`` failed catch-ups in a row: bounded, with jitter."""
        return retry_delay(self.config, self.failures, self.rng)

    async def _catch_up(self, head: Head) -> None:
        steps = self.puller.plan(head, self.held)
        while steps:
            entry = steps.pop(0)
            self.phase = "fetching"
            manifest, signed = await self.puller.fetch_signed_manifest(entry)
            log.debug("%s: manifest of version %d fetched", self.info.node_id, entry.version)
            self.marks.append(("manifest", entry.version, self.clock.now()))
            if not self.puller.readable(entry, manifest):  # (said and counted there) nothing of it fetched
                steps = self.puller.plan(head, self.held)
                continue
            rel = manifest_rel(entry.manifest_id)
            self.objects[rel] = signed  # the bytes that verified, and only those, are served
            self.source.forget(rel)
            self.heads.keep_trusted()  # the manifest signer's certificate
            prepare = getattr(self.apply, "prepare", None)  # e.g. swarm.staging.StagedApply
            if prepare is not None:
                prepare(self.held, manifest)
            try:
                parts = await self.fetcher.download(manifest)
            except BaseException:
                discard = getattr(self.apply, "discard", None)
                if discard is not None:
                    discard(manifest)
                raise
            mid = manifest.manifest_id
            if mid in self.complete:  # (a retry after a failed activation: downloaded before)
                self.complete.remove(mid)
            self.complete.append(mid)
            self.complete = self.complete[-16:]
            self.marks.append(("chunks", entry.version, self.clock.now()))
            self.phase = "staging"
            applied = self.apply(self.held, manifest, parts)
            new = await applied if inspect.isawaitable(applied) else applied
            del parts
            if self.on_version is not None:
                # The host activates first (e.g. into the engine's memory); if that fails, this node
                # does not adopt the version and will try again.
                result = self.on_version(new)
                if asyncio.iscoroutine(result):
                    await result
            self.held = new
            self.marks.append(("applied", entry.version, self.clock.now()))
            self.applied.append(entry)
            self.metrics.versions_applied += 1
            self._availability_changed()
            if self.head is not None and self.head.version != head.version:
                break  # a newer head arrived: replan from here
        self.phase = "idle"

    def _took_head(self) -> None:
        """A newer head was taken: announce it, and wake the catch-up."""
        self._availability_changed()
        self._wake.set()
        self._push_head()

    def _got_chunk(self, mid: bytes, chunk: int, rare: bool) -> None:
        """A download verified and stored a chunk: announce it, and tell our stripe's children at once."""
        self._availability_changed(rare=rare)
        self._tell_children(mid, chunk)

    def _tell_children(self, mid: bytes, chunk: int) -> None:
        """A relay's news of a chunk of its stripe goes to that stripe's children at once."""
        kids = self.downloads.children(mid, chunk)
        if not kids:
            return
        frame = self._frame(None)
        for child in kids:
            info = self.live.get(child)
            if info is not None:
                self.transport.post(info.addr, frame)

    async def _wait(self, event: asyncio.Event, timeout: float) -> None:
        waiter = asyncio.ensure_future(event.wait())
        sleeper = asyncio.ensure_future(self.clock.sleep(timeout))
        await asyncio.wait([waiter, sleeper], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        sleeper.cancel()

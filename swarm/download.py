"""Downloading a version, the asyncio side: the loop that asks the scheduler for requests, and the fetches.

What to ask of whom is decided by sans-IO objects: the chunk scheduler (protocol/scheduler.py) and
what the downloads know of their peers (protocol/download.py).  This module holds the tasks of the
fetches under way, the one future the loop waits on, the download rate limit, and the transfers.

A node that knows no seed but has boards (``seed_urls``: an object store, its HTTPS endpoint, a CDN)
takes from the board the chunks no peer can give it (and polls the board, not its peers, for the
head: swarm/sources.py): only when it has nothing to ask of anyone
and nothing under way, a few at a time (``BOARD_FETCHES``), chosen at random so that hosts starting
together fetch different chunks and then trade them; each is verified and announced like any other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.chunks import ChunkRef
from patchswarm.protocol.download import Downloads
from patchswarm.protocol.errors import ChunkError
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.ratelimit import TokenBucket
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, Request
from patchswarm.swarm.futures import settle
from patchswarm.swarm.node_metrics import Metrics
from patchswarm.swarm.stores import ChunkStore
from patchswarm.swarm.transport import Busy, Clock, Missing, Transport, TransportError

log = logging.getLogger("patchswarm.swarm")

VerifyChunk = Callable[[int, bytes, ChunkRef], None]
FromBoard = Callable[[ChunkRef], Awaitable[bytes | None]]

BOARD = "(board)"  # the peer id board fetches are filed under (no peer has it)
BOARD_FETCHES = 4  # board fetches at once, per download
# After a board fetch that brought nothing (missing, refused, throttled, a wrong chunk) the board is
# left alone for a while, doubling up to the last: a store's 403 or 404 answers in milliseconds, and
# without a pause every host would ask again at once, forever (each request billed).
BOARD_RETRY_S = (1.0, 30.0)
TIMEOUT_MARGIN = 0.25  # seconds the transport waits past a request's deadline (see ``fetch``)


class ChunkFetcher:
    """A node's chunk downloads.  ``got_chunk(manifest id, chunk, rare)``: a chunk was verified and
    stored (announce it; ``rare``: few peers hold it); ``marks``: the node's record of when each step
    of a catch-up happened (this adds "chunk", the first one verified); ``loop``: the event loop."""

    def __init__(
        self,
        config: NodeConfig,
        me: NodeInfo,
        chunks: ChunkStore,
        clock: Clock,
        transport: Transport,
        downloads: Downloads,
        metrics: Metrics,
        rng: random.Random,
        verify_chunk: VerifyChunk,
        marks: deque[tuple[str, int, float]],
        got_chunk: Callable[[bytes, int, bool], None],
        loop: Callable[[], asyncio.AbstractEventLoop],
        from_board: FromBoard | None = None,
    ) -> None:
        self.config = config
        self.me = me
        self.chunks = chunks
        self.clock = clock
        self.transport = transport
        self.downloads = downloads
        self.peers = downloads.peers
        self.metrics = metrics
        self.rng = rng
        self.verify_chunk = verify_chunk
        self.marks = marks
        self.got_chunk = got_chunk
        self.loop = loop
        self.from_board = from_board
        self.board_wait = 0.0  # the pause after the last failed board fetch (0 after a success)
        self.board_after = 0.0  # clock time before which the boards are not asked
        self.bucket = TokenBucket(config.download_rate, config.download_rate * 0.1)
        # Chunk bytes received per manifest id, from the seed and from peers (per-version accounting;
        # kept out of Metrics, which daemons print as JSON).
        self.seed_bytes_by_manifest: dict[bytes, int] = {}
        self.peer_bytes_by_manifest: dict[bytes, int] = {}
        self.change_waiter: asyncio.Future[None] | None = None  # the download loop, while it waits
        self.full = False  # it waits with every request it may have in flight out

    async def download(self, manifest: Manifest) -> list[bytes | memoryview]:
        """Every chunk of ``manifest``, verified and stored, in order (the caller applies them); or, from a
        store that spools downloads to a file (swarm/spool.py), one part: the whole payload, mapped."""
        mid = manifest.manifest_id
        begin = getattr(self.chunks, "begin", None)
        if begin is not None:
            begin(manifest)
        sizes = [c.size for c in manifest.chunks]
        have = Bitfield(len(sizes))
        for i, ref in enumerate(manifest.chunks):
            if ref.hash in self.chunks:
                have.set(i)
        me = PeerInfo(self.me.node_id, self.me.zone, self.me.region)
        sched = ChunkScheduler(sizes, me, self.config.scheduler, self.rng, have)
        self.downloads.start(mid, sched, self.clock.now())
        pinned = getattr(self.chunks, "pinned", None)
        if isinstance(pinned, set):
            pinned.update(ref.hash for ref in manifest.chunks)
        running: dict[tuple[int, str], asyncio.Task[None]] = {}
        seed_asked: dict[int, float] = {}  # chunk -> when Downloads.ask_seeds_again last put it to the seeds
        try:
            while not sched.complete:
                now = self.clock.now()
                self.downloads.refresh(sched, mid, len(sizes), now)
                for req in sched.expired(now):
                    self.metrics.request_timeouts += 1
                    log.debug("%s: chunk %d from %s -> timeout at %.3f", self.me.node_id, req.chunk, req.peer_id, now)
                    task = running.pop((req.chunk, req.peer_id), None)
                    if task:
                        task.cancel()
                requests = sched.next_requests(now)
                if not requests and not running and self.downloads.ask_seeds_again(sched, len(sizes), seed_asked, now):
                    requests = sched.next_requests(now)
                for req in requests:
                    running[(req.chunk, req.peer_id)] = self.loop().create_task(
                        self.fetch(sched, manifest, mid, req, running)
                    )
                if not requests and not running and self._board_due():
                    left = [c for c in range(len(sizes)) if not sched.holds(c)]
                    for c in self.rng.sample(left, min(BOARD_FETCHES, len(left))):
                        running[(c, BOARD)] = self.loop().create_task(
                            self.fetch_board(sched, manifest, mid, c, running)
                        )
                if sched.complete:
                    break
                self.full = sched.full
                deadline = sched.next_deadline()
                timeout = 0.25 if deadline is None else max(0.005, min(0.25, deadline - self.clock.now()))
                await self.until_change(timeout)
        finally:
            self.full = False
            for task in running.values():
                task.cancel()
            self.downloads.finish(mid)
            if isinstance(pinned, set):
                pinned.difference_update(ref.hash for ref in manifest.chunks)
        spooled = getattr(self.chunks, "payload", None)
        if spooled is not None:  # (hashed again over the file: off the loop)
            whole = await asyncio.to_thread(spooled, manifest)
            if whole is not None:
                return [whole]
        parts: list[bytes | memoryview] = []
        for ref in manifest.chunks:
            data = self.chunks.get(ref.hash)
            if data is None:
                raise ChunkError(-1, "a verified chunk was evicted before assembly")
            parts.append(data)
        return parts

    def _board_due(self) -> bool:
        """Boards are asked only by a node that knows no seed (a seed holds every chunk the board does)."""
        if self.from_board is None or self.clock.now() < self.board_after:
            return False
        return not any(v.ann.seed for v in self.peers.values())

    def _board_failed(self) -> None:
        first, most = BOARD_RETRY_S
        self.board_wait = min(most, max(first, 2 * self.board_wait))
        self.board_after = self.clock.now() + self.board_wait * (0.5 + 0.5 * self.rng.random())  # (hosts apart)

    async def fetch_board(
        self,
        sched: ChunkScheduler,
        manifest: Manifest,
        mid: bytes,
        chunk: int,
        running: dict[tuple[int, str], asyncio.Task[None]],
    ) -> None:
        """Chunk ``chunk`` from a board: verified, stored and announced as a peer's would be."""
        ref = manifest.chunks[chunk]
        assert self.from_board is not None
        try:
            now = self.clock.now()
            if (pause := self.bucket.reserve(now, ref.size) - now) > 0:
                await self.clock.sleep(pause)
            start = self.clock.now()
            data = await self.from_board(ref)
            if data is None:
                self._board_failed()
                return
            if sched.holds(chunk):
                return
            try:
                self.verify_chunk(chunk, data, ref)
            except ChunkError as e:
                log.warning("%s: %s from the board", self.me.node_id, e)
                self._board_failed()
                return
            self.board_wait = 0.0
            self.chunks.put(ref.hash, data)
            if sched.held_count == 0:
                self.marks.append(("chunk", manifest.version, self.clock.now()))
            self.metrics.bytes_from_seed += len(data)  # the board is the seed of a swarm that has none
            self.seed_bytes_by_manifest[mid] = self.seed_bytes_by_manifest.get(mid, 0) + len(data)
            end = self.clock.now()
            for dup in sched.on_success(end, chunk, BOARD, len(data), max(end - start, 1e-6)):
                task = running.pop((dup.chunk, dup.peer_id), None)
                if task is not None and task is not asyncio.current_task():
                    task.cancel()
            self.got_chunk(mid, chunk, True)
        finally:
            running.pop((chunk, BOARD), None)
            self.wake()

    def wake(self, *, news: bool = False) -> None:
        """Wake the download loop.  ``news`` (an announcement): not while every request it may have in
        flight is out, since it could start none; a fetch that ends wakes it, and the news is
        waiting in ``Downloads.dirty`` then (simulated swarms: most announcements reach a full downloader)."""
        waiter = self.change_waiter
        if news and self.full:
            return
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def until_change(self, timeout: float) -> None:
        """Wait until what peers hold changes, a fetch ends (``fetch`` wakes it on its way out), or
        ``timeout`` (loop) seconds pass.

        One future and one timer rather than helper tasks or callbacks on every fetch: a download
        loop wakes about once per chunk, so this is on the hot path of large (simulated) swarms."""
        loop = self.loop()
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(max(0.0, timeout), settle, fut, None)
        self.change_waiter = fut
        try:
            await fut
        finally:
            self.change_waiter = None
            timer.cancel()

    def take_hints(self, mid: bytes, chunk: int, holders: tuple[str, ...], missing: int) -> None:
        """A refusal named peers that got ``chunk``: ask them (``Downloads.take_hints``)."""
        if self.downloads.take_hints(mid, chunk, holders, missing, self.clock.now()):
            self.wake()

    async def fetch(
        self,
        sched: ChunkScheduler,
        manifest: Manifest,
        mid: bytes,
        req: Request,
        running: dict[tuple[int, str], asyncio.Task[None]],
    ) -> None:
        ref = manifest.chunks[req.chunk]
        view = self.peers.get(req.peer_id)
        try:
            if view is None:
                sched.on_failure(self.clock.now(), req.chunk, req.peer_id, FailureReason.ERROR)
                return
            now = self.clock.now()
            if (pause := self.bucket.reserve(now, ref.size) - now) > 0:
                await self.clock.sleep(pause)
            start = self.clock.now()
            try:
                # A little past the deadline: the scheduler's expiry, not the transport's timer, ends a late
                # request, as a TIMEOUT (it cuts the peer's rate estimate, which lengthens its next deadline:
                # protocol/peer_timing.py), not as an ERROR (which does not).
                timeout = max(req.deadline - start, 0.05) + TIMEOUT_MARGIN
                reply = await self.transport.get_chunk(
                    view.info.addr, ref.hash, ref.size, timeout, self.me.node_id, sched.held_count
                )
            except TransportError:
                sched.on_failure(self.clock.now(), req.chunk, req.peer_id, FailureReason.ERROR)
                return

            log.debug(
                "%s: chunk %d from %s -> %s after %.3fs",
                self.me.node_id,
                req.chunk,
                req.peer_id,
                type(reply).__name__,
                self.clock.now() - start,
            )
            if isinstance(reply, Busy):
                self.metrics.busy_replies += 1
                now = self.clock.now()
                sched.on_failure(now, req.chunk, req.peer_id, FailureReason.BUSY, reply.retry_after, now - start)
                self.take_hints(mid, req.chunk, reply.holders, len(manifest.chunks) - sched.held_count)
                return
            if isinstance(reply, Missing):
                self.downloads.missing_at(mid, req.peer_id, req.chunk)
                now = self.clock.now()
                sched.on_failure(now, req.chunk, req.peer_id, FailureReason.MISSING, elapsed=now - start)
                self.take_hints(mid, req.chunk, reply.holders, len(manifest.chunks) - sched.held_count)
                return
            try:
                self.verify_chunk(req.chunk, reply, ref)
            except ChunkError as e:
                self.metrics.hash_failures += 1
                self.metrics.bans += 1
                log.warning("%s: %s from %s: banned", self.me.node_id, e, req.peer_id)
                sched.on_failure(self.clock.now(), req.chunk, req.peer_id, FailureReason.HASH)
                return
            if sched.holds(req.chunk):
                return  # an endgame duplicate lost the race
            self.chunks.put(ref.hash, reply)
            if sched.held_count == 0:
                self.marks.append(("chunk", manifest.version, self.clock.now()))
            if view.ann.seed:
                self.metrics.bytes_from_seed += len(reply)
                by = self.seed_bytes_by_manifest
            else:
                self.metrics.bytes_from_peers += len(reply)
                by = self.peer_bytes_by_manifest
            by[mid] = by.get(mid, 0) + len(reply)
            end = self.clock.now()
            for dup in sched.on_success(end, req.chunk, req.peer_id, len(reply), max(end - start, 1e-6)):
                # Popped here: a task cancelled before it first ran never reaches its own ``finally``,
                # and a stale entry in ``running`` would keep the loop from asking the seeds again.
                task = running.pop((dup.chunk, dup.peer_id), None)
                if task is not None and task is not asyncio.current_task():
                    task.cancel()
            self.got_chunk(mid, req.chunk, sched.holders(req.chunk) <= self.config.announce_rare)
        finally:
            running.pop((req.chunk, req.peer_id), None)
            self.wake()  # (a task the loop cancels before it first ran never gets here: nor need it)

"""Serving chunks, the asyncio side: the line of waiting requests, the transfers and their deadlines.

The rules (slots, shares, the seed's withholding, when to come back) are sans-IO objects in
protocol/uploads.py and protocol/seeding.py; this module holds what they cannot: the futures of the
requests waiting for a slot, the timers that end their waits, and the transfers themselves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.seeding import SeedPolicy
from patchswarm.protocol.uploads import UploadPolicy
from patchswarm.swarm.futures import settle
from patchswarm.swarm.node_metrics import Metrics
from patchswarm.swarm.stores import ChunkStore
from patchswarm.swarm.transport import Busy, Clock, Missing, SendChunk

log = logging.getLogger("patchswarm.swarm")


def _hand_over(waiting: collections.deque[asyncio.Future[bool]]) -> bool:
    """Give a freed upload slot to the first request still waiting in ``waiting``; False: none waits."""
    while waiting:
        turn = waiting.popleft()
        if not turn.done():
            turn.set_result(True)
            return True
    return False


class ChunkServer:
    """A node's chunk uploads.  ``complete``: the manifest ids the node holds in full (a seed's
    withholding looks at the newest two); ``offer_changed``: a seed's offer shrank (announce it);
    ``loop``: the event loop the node runs on."""

    def __init__(
        self,
        config: NodeConfig,
        node_id: str,
        chunks: ChunkStore,
        clock: Clock,
        metrics: Metrics,
        uploads: UploadPolicy,
        seeding: SeedPolicy,
        complete: Callable[[], list[bytes]],
        offer_changed: Callable[[], None],
        loop: Callable[[], asyncio.AbstractEventLoop],
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.chunks = chunks
        self.clock = clock
        self.metrics = metrics
        self.uploads = uploads
        self.seeding = seeding
        self.complete = complete
        self.offer_changed = offer_changed
        self.loop = loop
        self.queue: collections.deque[asyncio.Future[bool]] = collections.deque()  # the line for a slot
        # With trees: requester -> its requests waiting behind the transfer under way to it (see _follow)
        self.followers: dict[str, collections.deque[asyncio.Future[bool]]] = {}

    async def handle_chunk(
        self, chunk_hash: bytes, requester: str, held: int, send: SendChunk, origin: str = ""
    ) -> Busy | Missing | None:
        """Answer a chunk request: Busy, Missing, or None after sending the bytes through ``send``.

        The upload slot is held until ``send`` returns, or until the transfer's deadline (see
        ``_send_within``): the slots bound the transfers under way, so a requester finds a free uplink
        or is told to come back, instead of every chunk being shared out at once and each taking
        longer (a relay can pass on only what it has received in full).
        ``held``: chunks of that version the requester says it holds (-1: not said; see
        ``SeedPolicy.requester_finishing``).  ``origin``: where the request came from (a transport on real
        sockets passes the address; the node id is unverified): its uploads are capped at
        ``uploads_per_requester``, and one that stalled rests (``upload_stall_rest``)."""
        if (refusal := self.refuse_chunk(chunk_hash, requester, held)) is not None:
            return refusal  # checked before reading the chunk or queueing for a slot
        key = origin or requester
        if key and (refusal := self._requester_refusal(key, capped=bool(origin))) is not None:
            return refusal
        uploads = self.uploads
        if key:
            uploads.requesters.begin(key)
        try:
            withholds = self.config.is_seed and not self.seeding.requester_finishing(chunk_hash, held, self.complete())
            if uploads.follows(requester):
                return await self._follow(chunk_hash, requester, withholds, send, key)
            line = uploads.may_wait_in_line(requester)
            if not self.config.is_seed or not requester:
                return await self._upload(chunk_hash, requester, withholds, send, line=line, key=key)
            # A seed counts each requester's uploads and waits: see _upload_slot.
            uploads.seed_begin(requester)
            try:
                return await self._upload(chunk_hash, requester, withholds, send, line=line, key=key)
            finally:
                uploads.seed_end(requester)
        finally:
            if key:
                uploads.requesters.end(key)

    def _requester_refusal(self, key: str, *, capped: bool) -> Busy | None:
        """Busy for a requester resting after a stall (until its rest ends) or, ``capped``, holding its
        share of the uploads already."""
        retry = self.uploads.requester_retry(key, capped=capped, now=self.clock.now(), waiting=len(self.queue))
        if retry is None:
            return None
        self.metrics.busy_replies += 1
        self.metrics.requester_refusals += 1
        return Busy(retry)

    def refuse_chunk(self, chunk_hash: bytes, requester: str, held: int) -> Busy | Missing | None:
        """The answer ``handle_chunk`` gives without waiting, or None: the chunk is not here (Missing),
        a seed withholds it (``_seed_refusal``), or no upload slot is free and there is no place in
        line for this requester (Busy).  A transport may call this first and spare a refused request
        the task ``handle_chunk`` runs in (simulated swarms refuse most requests at once); None does
        not promise a chunk: a request can still be refused after waiting in line."""
        if chunk_hash not in self.chunks:
            return Missing()
        withholds = self.config.is_seed and not self.seeding.requester_finishing(chunk_hash, held, self.complete())
        if withholds and (refusal := self._seed_refusal(chunk_hash)) is not None:
            return refusal
        if self.uploads.follows(requester):
            return None  # it waits behind its own transfer (_follow)
        if self.uploads.may_serve(requester, len(self.queue)):
            return None
        self.metrics.busy_replies += 1
        return Busy(self.busy_retry_after())

    def _seed_refusal(self, chunk_hash: bytes) -> Missing | None:
        """A seed hands out each chunk once per window; within it, point the requester at the holders
        (``SeedPolicy.refusal``)."""
        holders = self.seeding.refusal(chunk_hash, self.complete(), self.clock.now())
        if holders is None:
            return None
        self.metrics.busy_replies += 1
        return Missing(holders)

    def busy_retry_after(self) -> float:
        """When a refused requester should come back (``UploadPolicy.busy_retry_after``)."""
        return self.uploads.busy_retry_after(self.clock.now(), len(self.queue))

    async def _upload(
        self,
        chunk_hash: bytes,
        requester: str,
        withholds: bool,
        send: SendChunk,
        *,
        line: bool,
        slot: bool = False,
        key: str = "",
    ) -> Busy | Missing | None:
        """``handle_chunk`` once the chunk may be served: an upload slot (``line``: or a place in
        line for one; ``slot``: one handed over already), then the bytes at the upload rate."""
        if not slot and not await self._upload_slot(line=line):
            self.metrics.busy_replies += 1
            return Busy(self.busy_retry_after())
        uploads = self.uploads
        tracked = uploads.tracks(requester)
        if tracked:
            uploads.sending_begin(requester)
        try:
            if self.config.is_seed:
                # Check the window again now that a slot is ours, and only now count the copy as given:
                # a request refused for want of a slot must not use up the chunk's window.
                if withholds and (refusal := self._seed_refusal(chunk_hash)) is not None:
                    return refusal
                self.seeding.hand_out(chunk_hash, requester, self.clock.now())
                self.offer_changed()  # the offer shrank
            data = self.chunks.get(chunk_hash)
            if data is None:
                return Missing()
            start = self.clock.now()
            if (pause := uploads.bucket.reserve(start, len(data)) - start) > 0:
                await self.clock.sleep(pause)  # (no sleep(0): a loop turn per chunk served, for nothing)
            self.metrics.bytes_uploaded += len(data)
            uploads.sending(len(data))
            self.metrics.chunks_uploaded += 1
            if not await self._send_within(send, data, key):
                return None  # aborted at its deadline: the requester gets nothing more from this request
            uploads.sent(self.clock.now() - start)
            return None
        finally:
            if tracked:
                uploads.sending_end(requester)
            self._release_upload_slot(requester if tracked else "")

    async def _follow(
        self, chunk_hash: bytes, requester: str, withholds: bool, send: SendChunk, key: str = ""
    ) -> Busy | Missing | None:
        """With trees, a requester's next request waits behind the transfer under way to it and takes
        over its slot when it ends, as a second request on one connection would: a child keeps its
        parent's flow busy without a round trip's gap between chunks, and without a second flow
        halving the first's rate, which a chunk's every hop down the tree would pay (simulated 100
        hosts, 4 MiB chunks: 0.520 s with one request per parent, 0.502 s with a second behind it)."""
        waiting = self.followers.setdefault(requester, collections.deque())
        try:
            got = await self._await_turn(waiting, requester)
        finally:
            if not waiting and self.followers.get(requester) is waiting:
                del self.followers[requester]
        if not got:
            self.metrics.busy_replies += 1
            return Busy(self.busy_retry_after())
        return await self._upload(chunk_hash, requester, withholds, send, line=False, slot=True, key=key)

    async def _send_within(self, send: SendChunk, data: bytes, key: str) -> bool:
        """``send(data)`` within its deadline, max(``upload_deadline``, bytes / ``upload_floor_rate``);
        False: it passed, the send was cancelled (a transport aborts the connection then) and the
        requester rests; or the requester went away (``send`` raised ConnectionError).  The caller's
        slot is released once, by the caller, either way.  (Loop time: virtual in simulations, as the
        line's waits are.)"""
        cfg = self.config
        try:
            async with asyncio.timeout(max(cfg.upload_deadline, len(data) / cfg.upload_floor_rate)):
                await send(data)
        except ConnectionError:
            # The requester closed the connection (it gave up): the transport dropped what was not sent,
            # and the slot goes back now, to a request somebody still waits for.  No rest: giving up
            # at a deadline is what requesters do.
            self.metrics.uploads_abandoned += 1
            self.metrics.bytes_abandoned += len(data)
            return False
        except asyncio.CancelledError:
            # The same seen from a server that cancels a handler whose client left (swarm/serving.py), or
            # a shutdown: the transport aborted the connection; the caller's ``finally`` frees the slot.
            self.metrics.uploads_abandoned += 1
            self.metrics.bytes_abandoned += len(data)
            raise
        except TimeoutError:
            self.metrics.upload_stalls += 1
            if key:
                rest = self.uploads.requesters.stalled(key, self.clock.now())
                log.info("%s: upload to %s passed its deadline: aborted, resting it %.0f s", self.node_id, key, rest)
            return False
        return True

    async def _upload_slot(self, *, line: bool = True) -> bool:
        """A free upload slot, or a short wait in line for one: cheaper for everyone than a refusal and a retry.

        First come, first served.  A line ordered by need (fewest chunks held first, the neediest
        taking the last place from one holding more) was 4% faster on a simulated 1,000-host swarm
        whose members all knew each other, but 1.8x slower when the version was published as the
        hosts joined (docs/simulation.md section 5, sixth round).

        ``line=False``: a free slot or nothing.  A seed's line is for requesters it is not serving
        yet: one it is uploading to (or that waits already) gets a free slot, not a place in line.
        Otherwise a host keeping several requests at the seed (``max_inflight_seed``) takes several
        shares of the one copy, and the line stays with those served last, who ask again at once: in
        a seed-bound swarm of 8 paced hosts (tests/test_sim_agreement.py) a slow host took 14-24 of
        the 46 chunks and sat on them, the first it got reached everyone 9 s later, and the time to
        all was 8.8-11.3 s over 8 seeds; with this rule 8.0-9.1 s, each host taking 2-12 chunks."""
        if self.uploads.slots.acquire():
            return True
        if not self.uploads.line_has_room(line, len(self.queue)):
            return False
        return await self._await_turn(self.queue)

    async def _await_turn(self, waiting: collections.deque[asyncio.Future[bool]], requester: str = "") -> bool:
        """Wait in ``waiting`` (the line, or ``requester``'s followers) until a transfer's end hands its
        slot over (True) or ``upload_queue_wait`` passes (False)."""
        loop = self.loop()
        turn: asyncio.Future[bool] = loop.create_future()  # True: _release_upload_slot handed a slot over
        waiting.append(turn)
        # The wait's end is a timer answering False (one handle, not a sleeping task and asyncio.wait:
        # every queued request of a large simulated swarm comes through here).
        timer = loop.call_later(self.config.upload_queue_wait, settle, turn, False)
        try:
            return await turn
        except asyncio.CancelledError:
            # Cancelled while waiting: give back a slot already handed over, or leave the line.
            if turn.done() and not turn.cancelled() and turn.result():
                self._release_upload_slot(requester)
            raise
        finally:
            timer.cancel()
            if turn in waiting:
                waiting.remove(turn)

    def _release_upload_slot(self, requester: str = "") -> None:
        """Hand the slot to a request waiting behind this requester's transfer, or the line's first, or free it."""
        followers = self.followers.get(requester) if requester else None
        if (followers and _hand_over(followers)) or _hand_over(self.queue):
            return
        self.uploads.slots.release()

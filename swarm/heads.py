"""Fetching the head, the asyncio side: a head heard of in an announcement (or polled from the board's
URLs) is fetched, verified by the puller against the trust and the high-water mark, and taken.

Which fetch is worth starting, which head is held and which refusals to warn of is decided by
``HeadFollower`` (protocol/head_follow.py); this module does the fetching and the serving of what
verified (the head, and the certificates and root documents that verified it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from patchswarm.protocol.board_names import MAX_HEAD_BYTES, head_rel, manifest_rel
from patchswarm.protocol.errors import ExpiredError, PatchswarmError
from patchswarm.protocol.head import Head
from patchswarm.protocol.head_follow import HeadFollower
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.futures import drain
from patchswarm.swarm.puller import Puller
from patchswarm.swarm.sources import SwarmSource
from patchswarm.swarm.transport import Clock, TransportError

log = logging.getLogger("patchswarm.swarm")


class HeadFetcher:
    """``objects``: what the node serves (the head and what verified it go there; manifests the head
    no longer names leave); ``partial``: the downloads under way (their manifests stay);
    ``on_head``: a newer head was taken (announce it, wake the catch-up)."""

    def __init__(
        self,
        config: NodeConfig,
        node_id: str,
        clock: Clock,
        follow: HeadFollower,
        source: SwarmSource,
        puller: Puller,
        objects: dict[str, bytes],
        partial: dict[bytes, ChunkScheduler],
        marks: deque[tuple[str, int, float]],
        on_head: Callable[[], None],
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.clock = clock
        self.follow = follow
        self.source = source
        self.puller = puller
        self.objects = objects
        self.partial = partial
        self.marks = marks
        self.on_head = on_head

    async def fetch(self, prefer: str | None, counter: int = -1) -> None:
        try:
            await self.fetch_once(prefer)
        finally:
            self.follow.fetch_ended(counter)

    async def fetch_once(self, prefer: str | None) -> None:
        before = self.follow.counter
        try:
            # The root is refreshed (TUF: before a head is trusted) while the head travels: one round
            # trip instead of two on every new head.  If the refresh fails, the head is not waited for.
            travelling = asyncio.ensure_future(
                self.source.get(head_rel(self.config.run_id), MAX_HEAD_BYTES, prefer=prefer)
            )
            try:
                await self.puller.refresh_trust()
            except BaseException:
                travelling.cancel()
                travelling.add_done_callback(drain)  # it may have failed already
                raise
            data = await travelling
            if data is None:
                return
            # Verified, checked against the high-water mark (rewind, equivocation) and counted when refused.
            accepted = await self.puller.accept_head(data, newer_than=self.follow.counter)
        except (PatchswarmError, TransportError) as e:
            self._warn_refused(e)
            # e.g. expired beyond the clock skew: the host reports it; but a source still serving an
            # expired head does not mark the board frozen while the head this node holds is fresh
            # (a concurrent fetch may have just accepted a newer one).
            stale = isinstance(e, ExpiredError) and e.document == "head" and self.is_fresh()
            if isinstance(e, PatchswarmError) and not stale:
                self.follow.error = str(e)
            return
        finally:
            self.keep_trusted()
        self.follow.error = None
        if not self.follow.accept(accepted, before):
            return
        head = self.follow.head
        assert head is not None
        self.marks.append(("head", head.version, self.clock.now()))
        log.debug("%s: head %d (version %d) accepted", self.node_id, head.counter, head.version)
        self.objects[head_rel(self.config.run_id)] = data
        self._forget_manifests(head)
        self.on_head()

    def is_fresh(self) -> bool:
        """The head this node holds has not expired (beyond the trust's clock skew)."""
        head = self.follow.head
        return head is not None and self.puller.is_fresh(head)

    def _warn_refused(self, e: Exception) -> None:
        # A frozen board (or any refusal that repeats at every poll) is one warning a minute, not one
        # per poll: the status and the metrics say it continuously.  A new refusal is always told.
        what = str(e)
        if not self.follow.warn(what, self.clock.now()):
            log.debug("%s: head refused: %s", self.node_id, what)
            return
        log.warning("%s: head refused: %s", self.node_id, what)

    def keep_trusted(self) -> None:
        """Serve the certificates and root documents this node has verified: a node asks the peer
        that served it a head for that head's certificate before it asks the seed."""
        trust = self.puller.trust
        if isinstance(trust, TrustState):
            self.objects.update(self.source.take_trusted(trust))

    def _forget_manifests(self, head: Head) -> None:
        """Stop serving manifests the head's catalog no longer names (or the node would keep every
        manifest it ever fetched: about 1 MB per version of a large model)."""
        named = {manifest_rel(e.manifest_id) for e in head.catalog}
        named.update(manifest_rel(mid) for mid in self.partial)
        for rel in [r for r in self.objects if r.startswith("manifests/") and r not in named]:
            del self.objects[rel]

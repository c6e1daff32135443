"""A node's upload rules, sans-IO: slots, the line for them, per-requester shares, and when to come back.

An upload slot is held until the chunk is sent: the slots bound the transfers under way, so a
requester finds a free uplink or is told to come back, instead of every chunk being shared out at
once and each taking longer (a relay can pass on only what it has received in full).  This object
keeps the counts and answers the questions; the asyncio side (swarm/uploads.py) holds the waiting
requests' futures and the transfers, and tells it how many wait (``waiting``) and what each took.
"""

from __future__ import annotations

import math

from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.ratelimit import TokenBucket, UploadSlots
from patchswarm.protocol.requesters import RequesterLimits
from patchswarm.protocol.seeding import SeedPolicy


class UploadPolicy:
    def __init__(self, config: NodeConfig, seeding: SeedPolicy) -> None:
        self.config = config
        self.seeding = seeding
        # Bursts of upload_burst seconds: a limit holds over any window longer than that.
        self.bucket = TokenBucket(config.upload_rate, config.upload_rate * config.upload_burst)
        slots = config.max_uploads
        if config.is_seed:
            # With trees every root keeps max_inflight_per_parent requests here: serve them all at once.
            slots = max(config.seed_max_uploads, config.tree_fanout * config.scheduler.max_inflight_per_parent)
        self.slots = UploadSlots(slots)
        self.requesters = RequesterLimits(
            config.uploads_per_requester or max(1, slots - 1),
            rest=config.upload_stall_rest,
            max_rest=config.upload_stall_max_rest,
            memory=4 * config.upload_stall_max_rest,  # a requester stalling again within it rests longer
        )
        self.last_upload_bytes = 0  # typical chunk size, for the time a waiting line takes
        self.upload_seconds = 0.0  # EWMA of how long one upload held its slot (an unpaced uplink's drain rate)
        self.seed_uploading: dict[str, int] = {}  # requester -> its uploads under way or waiting at this seed
        # With trees: requester -> its transfers under way (a next request waits behind them: swarm/uploads.py)
        self.sending_to: dict[str, int] = {}

    def requester_retry(self, key: str, *, capped: bool, now: float, waiting: int) -> float | None:
        """When a requester resting after a stall (until its rest ends) or, ``capped``, holding its
        share of the uploads already should come back; None: it is neither."""
        if (rest := self.requesters.rest_left(key, now)) > 0:
            return rest
        if capped and self.requesters.at_share(key):
            return self.busy_retry_after(now, waiting)
        return None

    def follows(self, requester: str) -> bool:
        """With trees, a plain node's requester with a transfer under way waits behind it for its slot."""
        return bool(self.config.tree_fanout) and not self.config.is_seed and requester in self.sending_to

    def may_wait_in_line(self, requester: str) -> bool:
        """A seed's line is for requesters it is not serving yet (see swarm/uploads.py ``_upload_slot``)."""
        return not self.config.is_seed or not requester or requester not in self.seed_uploading

    def line_has_room(self, line: bool, waiting: int) -> bool:
        room = self.config.seed_upload_queue if self.config.is_seed else self.config.upload_queue
        return line and waiting < room

    def may_serve(self, requester: str, waiting: int) -> bool:
        """A slot is free, or there is a place in line for this requester."""
        return self.slots.in_use < self.slots.capacity or self.line_has_room(self.may_wait_in_line(requester), waiting)

    def seed_begin(self, requester: str) -> None:
        uploading = self.seed_uploading
        uploading[requester] = uploading.get(requester, 0) + 1

    def seed_end(self, requester: str) -> None:
        uploading = self.seed_uploading
        if (left := uploading[requester] - 1) > 0:
            uploading[requester] = left
        else:
            del uploading[requester]

    def tracks(self, requester: str) -> bool:
        """With trees, a plain node counts the transfers under way to each requester."""
        return bool(self.config.tree_fanout and requester and not self.config.is_seed)

    def sending_begin(self, requester: str) -> None:
        self.sending_to[requester] = self.sending_to.get(requester, 0) + 1

    def sending_end(self, requester: str) -> None:
        if (left := self.sending_to[requester] - 1) > 0:
            self.sending_to[requester] = left
        else:
            del self.sending_to[requester]

    def sending(self, nbytes: int) -> None:
        """A chunk of ``nbytes`` goes out."""
        self.last_upload_bytes = nbytes

    def sent(self, took: float) -> None:
        """A transfer ended in ``took`` seconds (from its slot to its last byte)."""
        self.upload_seconds = took if not self.upload_seconds else 0.7 * self.upload_seconds + 0.3 * took

    def busy_retry_after(self, now: float, waiting: int) -> float:
        """When a refused requester should come back: ``busy_retry_after``, or sooner when the line
        drains sooner.  A paced uplink drains its bucket's backlog (booked by the running uploads)
        plus the requests waiting at the size of the last chunk served; an unpaced one frees a slot
        every ``upload time / slots``, from the uploads it timed.  Half of that, so that requesters
        come back while the line still covers the uplink and it never goes idle; no sooner, since an
        earlier return only costs both ends another refusal (the loopback benchmark counted 15,000-18,000
        refusals for 1,600 chunks moved when everyone came back after half the backlog alone).  Telling
        each of many refused requesters to wait for its share of the uploads instead (refused x upload
        time) halved the refusals of a simulated 300-host swarm but left uplinks idle: 1.43x the time.

        A seed books the returns (``SeedPolicy.return_time``): while it injects new chunks every host
        asks it for the chunks nobody else holds, so a refusal telling everyone "half the line" brings
        them all back at once to be refused again."""
        retry = self.config.busy_retry_after
        if math.isfinite(self.config.upload_rate):
            per_upload = self.last_upload_bytes / self.config.upload_rate
            drain = self.bucket.reserve(now, 0) - now + waiting * per_upload
        elif self.upload_seconds:
            per_upload = self.upload_seconds / max(1, self.slots.capacity)
            drain = (waiting + 1) * per_upload
        else:
            return retry
        back = now + max(drain / 2, 0.001)
        if self.config.is_seed:
            back = self.seeding.return_time(now, back, per_upload)
        return min(retry, back - now)

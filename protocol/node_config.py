"""A swarm node's settings: the rules of its membership, scheduling, uploads, seed policy, heads and trees.

Plain data, read by the sans-IO node rules (protocol/uploads.py, seeding.py, announce.py, download.py,
head_follow.py) and by their asyncio driver (swarm/node.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.payload_formats import PAYLOAD_FORMATS
from patchswarm.protocol.scheduler_types import SchedulerConfig


@dataclass
class NodeConfig:
    node_id: str
    run_id: str
    cluster_secret: bytes
    zone: str = ""
    region: str = ""
    bootstrap: list[str] = field(default_factory=list)  # swarm addresses of peers (or the seed) to join through
    seed_urls: list[str] = field(default_factory=list)  # board URLs polled for the head as a fallback
    is_seed: bool = False
    upload_rate: float = math.inf  # bytes/s
    download_rate: float = math.inf
    upload_burst: float = 0.1  # seconds at upload_rate the upload bucket may send at once
    # An upload slot is held until the chunk is sent.  A relay passes a chunk on only once it has all of
    # it, so fewer transfers at once spread chunks sooner; but when a requester's downlink is shared, one
    # transfer does not fill the uplink.  4 (+ 4 waiting) fills it (simulated 10 Gbit/s swarms: 84% of the
    # links busy against 65% with 2); the seed serves 6 so its uplink stays full while chunks are new.
    max_uploads: int = 4
    # Requests waiting for an upload slot before refusals start.  Short: a request waiting here is one
    # its node cannot place with an idle holder (simulated swarms: 0.61 -> 0.58 s at N = 300 with 2).
    upload_queue: int = 2
    upload_queue_wait: float = 0.5
    seed_max_uploads: int = 6
    # The seed's line stays longer: it holds chunks nobody else has, so a request it refuses cannot go to
    # another holder, and its uplink idles until the refused come back (a seed-bound swarm of 8 paced
    # hosts, tests/test_sim_agreement.py: 10.2-12.6 s with a line of 2 against 9.3-9.7 s with 4).
    seed_upload_queue: int = 4
    busy_retry_after: float = 0.2
    # Every transfer has a deadline, max(upload_deadline, chunk bytes / upload_floor_rate): a requester
    # that stops reading would otherwise hold its slot forever, and a few such connections lock every
    # honest requester out.  On expiry the connection is aborted and the slot freed; the requester (by
    # the address it connects from) rests upload_stall_rest s, doubling per stall, up to upload_stall_max_rest.
    upload_deadline: float = 30.0
    upload_floor_rate: float = 128 * 1024  # bytes/s (a 4 MiB chunk: 32 s)
    # >0: a chunk reply's socket keeps at most this many bytes not yet sent (TCP_NOTSENT_LOWAT, Linux;
    # ignored elsewhere), the rest waiting in the process: the write of a chunk returns once it has left,
    # not once the kernel's send buffer (megabytes, autotuned) took it, so the upload slot covers the
    # transfer on the wire, and a requester that gives up stops the bytes not yet sent.  On by default:
    # with slots freed at the kernel's take, a seed across regions sent 2.1 copies of the patch for 1
    # received, and the swarm took 1.3x as long (docs/bandwidth-study.md section 7); 0: off.
    upload_notsent_lowat: int = 128 * 1024
    upload_stall_rest: float = 30.0
    upload_stall_max_rest: float = 900.0
    # Uploads one requester (by address) may have under way or waiting at once; 0: all slots but one,
    # so that a single client never holds them all.
    uploads_per_requester: int = 0
    # A seed hands out each chunk at most once per window ("super-seeding"): peers then get it from
    # each other, and the seed's uplink goes to chunks the swarm does not have yet.
    seed_copy_window: float = 2.0
    # A seed serves each manifest to this many requesters, then names some of them to the rest (0:
    # serves everyone): on a cold start every host asks it at once (see handle_object).
    seed_object_copies: int = 32
    head_poll_interval: float = 2.0
    # A failed catch-up is retried after retry_backoff, doubling per failure up to retry_backoff_max,
    # each wait drawn between half and all of that (the node's RNG: hosts that failed together, say
    # on a seed's restart, do not retry in step).  A new head cuts a wait short.
    retry_backoff: float = 0.5
    retry_backoff_max: float = 8.0
    announce_interval: float = 0.01  # a 4 MiB chunk takes 3.4 ms at 10 Gbit/s: news of it should not wait much longer
    # News of a chunk at most this many peers are known to hold goes out at once, not at the next tick:
    # a new chunk spreads in hops, and each hop waiting for the tick adds up to announce_interval.  0:
    # chunks nobody else is known to hold (the first hop from the seed): simulated 1,000 hosts 0.595 ->
    # 0.577 s with 5% fewer events; 2 was 0.568 s for 11% more events and 21% more gossip.
    announce_rare: int = 0
    announce_fanout: int = 6  # peers told at once when availability changes (those that lack what we have first)
    announce_refresh: float = 0.5  # even without changes, a few random peers hear from us this often
    announce_sample: int = 0  # >0: choose announcement targets among this many random live members (0: all)
    head_push: bool = True  # a node that accepts a new head tells announce_fanout peers that lack it at once
    board_watch_interval: float = 0.1  # how often a seed re-reads its board's head
    # >0: stripe trees of this fan-out (protocol/trees.py) over the members known when a download
    # starts: a chunk is asked of its stripe's parent, and a relay tells its children of each chunk
    # of its stripe at once.  0: every request goes where the scheduler's usual rules say.
    tree_fanout: int = 0
    # Trees only where this node's member list has not changed for this long: nodes that plan from
    # different lists wait on parents that are not relaying their stripe (published as 300 hosts
    # joined, trees planted at once took 2.8x the bound).  A node that may not plant uses the usual rules.
    tree_settle: float = 1.0
    cache_bytes: int = 1 << 30
    # The patch payload formats this node takes: every one its build reads.  Fewer only to act as an
    # older build would (tests, a fleet rehearsing an upgrade): a version needing another is planned
    # around from its manifest, none of its chunks fetched (protocol/catalog.py CatchUpPlanner).
    payload_formats: tuple[int, ...] = PAYLOAD_FORMATS
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.tree_fanout < 0:
            raise ValueError("tree_fanout must be >= 0")
        if not 0 <= self.tree_settle < math.inf:
            raise ValueError("tree_settle must be finite and >= 0")
        if not (0 < self.upload_deadline < math.inf and self.upload_floor_rate > 0):
            raise ValueError("upload_deadline must be finite and > 0, upload_floor_rate > 0")
        if not 0 <= self.upload_stall_rest <= self.upload_stall_max_rest < math.inf:
            raise ValueError("upload_stall_rest must be >= 0 and at most upload_stall_max_rest (finite)")
        if not 0 <= self.upload_notsent_lowat <= 1 << 30:
            raise ValueError("upload_notsent_lowat must be 0..2^30 bytes")
        if self.uploads_per_requester < 0:
            raise ValueError("uploads_per_requester must be >= 0")
        if not 0 < self.retry_backoff <= self.retry_backoff_max < math.inf:
            raise ValueError("retry_backoff must be > 0 and <= retry_backoff_max, which must be finite")

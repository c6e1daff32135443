"""A swarm node in its own process, over real HTTP on loopback (tests/unit/swarm/test_upload_slots.py,
tests/unit/swarm/test_gossip_replay.py).

Usage: python -m tests.support.node_worker NAME [--slots N] [--deadline S] [--chunk-bytes N] [--bootstrap URL]
                                        [--frame-window S] [--frame-skew S]
Prints {"port": P, "url": U, "hash": HEX} (the one chunk it serves), then answers stdin lines:
"metrics" prints the node's metrics as one JSON line, "peers" the ids of the peers it heard from;
end of input stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys

from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.server import start_http_node
from tests.support.swarmkit import FAST_MEMBERSHIP, RUN, SECRET

CHUNK_HASH = bytes(range(32))


async def main(args: argparse.Namespace) -> None:
    membership = dataclasses.replace(FAST_MEMBERSHIP, frame_window=args.frame_window, frame_skew=args.frame_skew)
    assert isinstance(membership, MembershipConfig)
    cfg = NodeConfig(
        args.name,
        RUN,
        SECRET,
        bootstrap=[args.bootstrap] if args.bootstrap else [],
        max_uploads=args.slots,
        upload_queue=0,  # a request finds a free slot or a 503 at once
        upload_deadline=args.deadline,
        upload_floor_rate=1e12,  # the deadline is upload_deadline whatever the size
        upload_stall_rest=600.0,
        membership=membership,
    )
    running = await start_http_node(cfg, TrustState(b"k" * 32), rng=random.Random(0))
    running.node.chunks.put(CHUNK_HASH, bytes(args.chunk_bytes))
    port = int(running.url.rsplit(":", 1)[1])
    print(json.dumps({"port": port, "url": running.url, "hash": CHUNK_HASH.hex()}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "metrics":
            print(json.dumps(dataclasses.asdict(running.node.metrics)), flush=True)
        elif line.strip() == "peers":
            print(json.dumps(sorted(running.node.peers)), flush=True)
    await running.stop(leave=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.support.node_worker")
    parser.add_argument("name")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--chunk-bytes", type=int, default=1000)
    parser.add_argument("--bootstrap", default="")
    parser.add_argument("--frame-window", type=float, default=60.0)
    parser.add_argument("--frame-skew", type=float, default=60.0)
    asyncio.run(main(parser.parse_args()))

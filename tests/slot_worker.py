"""A swarm node in its own process, serving one chunk over real HTTP (tests/test_upload_slots.py).

Usage: python -m tests.slot_worker SLOTS DEADLINE CHUNK_BYTES
Prints {"port": P, "hash": HEX}, then answers stdin lines: "metrics" prints the node's metrics as
one JSON line; end of input stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys

from protocol.trust import TrustState
from swarm.node import NodeConfig
from swarm.server import start_http_node
from tests.swarmkit import RUN, SECRET

CHUNK_HASH = bytes(range(32))


async def main(slots: int, deadline: float, size: int) -> None:
    cfg = NodeConfig(
        "server",
        RUN,
        SECRET,
        max_uploads=slots,
        upload_queue=0,  # a request finds a free slot or a 503 at once
        upload_deadline=deadline,
        upload_floor_rate=1e12,  # the deadline is upload_deadline whatever the size
        upload_stall_rest=600.0,
    )
    running = await start_http_node(cfg, TrustState(b"k" * 32), rng=random.Random(0))
    running.node.chunks.put(CHUNK_HASH, bytes(size))
    port = running.url.rsplit(":", 1)[1]
    print(json.dumps({"port": int(port), "hash": CHUNK_HASH.hex()}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "metrics":
            print(json.dumps(dataclasses.asdict(running.node.metrics)), flush=True)
    await running.stop(leave=False)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))

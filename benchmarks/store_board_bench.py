"""Publishing to and pulling from an object-store board, against moto on loopback, beside a directory.

    .venv/bin/python -m benchmarks.store_board_bench [--mb 48] [--chunk-mb 4]

Publishes one anchor of about ``--mb`` MB of bf16 weights to ``s3://`` (a moto server process this
starts; tests/support/moto_server.py) with 16 chunk puts in flight and with one at a time, and to a
local directory; then pulls it back through the SDK (swarm/board_store.py ``StoreSource``).  It
prints the publisher's write stage (chunks, manifest, head) and the pull, in MB/s of payload.  moto
is a Python server on the same cores: these figures bound what moto serves, not what S3 would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import torch

import patchswarm.daemon.board_store as board_store
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import source_for
from patchswarm.swarm.puller import Puller
from tests.support.boards import Keys
from tests.support.moto_server import moto_server

RUN = "bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=48.0, help="served size of the anchor (bf16), MB")
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="chunk size, MB")
    args = ap.parse_args()
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    rows = 1024
    cols = max(1, int(args.mb * 1e6 / 2 / rows / 8))
    gen = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(rows, cols, generator=gen) for i in range(8)}
    chunk = int(args.chunk_mb * (1 << 20))

    def publish(board: str) -> float:
        pub = Publisher(board, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN), chunk_size=chunk)
        info = pub.publish(weights)
        pub.close()
        mb = (info.anchor_bytes or 0) / 1e6
        where = "s3" if board.startswith("s3://") else "directory"
        write = info.stages["write"]
        print(f"  publish {where}: anchor {mb:.1f} MB, write {write:.2f} s ({mb / write:.0f} MB/s)")
        return mb

    async def pull(url: str) -> float:
        src = source_for(url)
        try:
            t = time.perf_counter()
            await Puller(src, TrustState(keys.root.key_id), RUN).catch_up(None)
            return time.perf_counter() - t
        finally:
            await src.close()

    with tempfile.TemporaryDirectory() as tmp, moto_server(Path(tmp) / "moto") as moto:
        os.environ.update(moto.env())
        print(f"moto at {moto.endpoint}; chunks of {args.chunk_mb:g} MB")
        for uploads in (board_store.UPLOADS, 1):
            board_store.UPLOADS = uploads
            print(f"{uploads} chunk put(s) in flight:")
            url = f"s3://{moto.new_bucket()}/board"
            mb = publish(url)
            seconds = asyncio.run(pull(url))
            print(f"  pull through the SDK: {seconds:.2f} s ({mb / seconds:.0f} MB/s, verified and decoded)")
        print("directory:")
        publish(str(Path(tmp) / "dir-board"))


if __name__ == "__main__":
    main()

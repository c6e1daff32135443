"""A trainer process for crash tests: publishes versions of a small model until killed.

Usage: python -m tests.support.publisher_worker BOARD RUN TRAINER_KEY CERT SEED
Prints "published N" after each version (the parent kills it at random moments).
"""

from __future__ import annotations

import sys

import torch

from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.keys import SigningKey


def main() -> None:
    board, run, key_path, cert_path, seed = sys.argv[1:6]
    pub = Publisher(
        board,
        SigningKey.load(key_path),
        run_id=run,
        anchor_every=3,
        keep_anchors=1,
        chunk_size=4096,
        certificate=open(cert_path, "rb").read(),  # noqa: SIM115
    )
    g = torch.Generator().manual_seed(int(seed))
    weights = {f"w{i}": torch.randn(256, 256, generator=g) * 0.02 for i in range(4)}
    while True:
        for w in weights.values():
            w.add_(torch.randn(w.shape, generator=g) * 2e-4)
        info = pub.publish(weights)
        print(f"published {getattr(info, 'version', '?')}", flush=True)


if __name__ == "__main__":
    main()

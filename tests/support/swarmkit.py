"""A loopback swarm for tests: a trainer publishing to a board, a seed node, N peer nodes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import Certificate, TrustState
from patchswarm.swarm.server import RunningNode, start_http_node
from patchswarm.swarm.staging import ApplyVersion
from patchswarm.swarm.tls import TlsReloader

SECRET = b"test-cluster-secret-0123456789ab"
RUN = "swarm-run"
# Faster failure detection than the production defaults, so tests finish quickly.
FAST_MEMBERSHIP = MembershipConfig(probe_interval=0.5, probe_timeout=0.2, gossip_interval=0.2, sync_interval=2.0)


@dataclass
class Swarm:
    tmp: Path
    root: SigningKey = field(default_factory=SigningKey.generate)
    trainer: SigningKey = field(default_factory=SigningKey.generate)
    seed: RunningNode | None = None
    nodes: dict[str, RunningNode] = field(default_factory=dict)
    served: dict[int, ServedModel] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    pub: Publisher | None = None
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    tls_for: Callable[[str], TlsReloader] | None = None  # a node's TLS contexts, by name (tests/support/tlskit.py)
    payload_format: int = DEFAULT_FORMAT  # of the trainer's patches (docs/format.md section 2a)

    def __post_init__(self) -> None:
        now = int(time.time() * 1000)
        cert = Certificate(self.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(self.root).to_bytes()
        self.board = Board(self.tmp / "board")
        self.pub = Publisher(
            self.board,
            self.trainer,
            run_id=RUN,
            certificate=cert,
            chunk_size=16 << 10,
            anchor_every=4,
            keep_anchors=2,
            payload_format=self.payload_format,
        )
        self.weights = {f"layer{i}.weight": torch.randn(256, 256, generator=self.gen) * 0.02 for i in range(4)}

    def publish(self, scale: float = 1e-4) -> int:
        assert self.pub is not None
        if self.served:
            for w in self.weights.values():
                w.add_(torch.randn(w.shape, generator=self.gen) * scale)
        info = self.pub.publish(self.weights)
        assert not hasattr(info, "result")
        v = self.pub.version
        self.served[v] = ServedModel.from_tensors(ServedFormat("bf16").convert(self.weights))
        return v

    def patch_bytes(self, version: int) -> int:
        from patchswarm.protocol.head import Head
        from patchswarm.protocol.signed import Envelope

        head = Head.from_bytes(Envelope.from_bytes(self.board.read(head_rel(RUN)) or b"", HEAD_TAG).body)
        return next(e.size for e in head.catalog if e.version == version and e.kind.value == "patch")

    def _tls(self, name: str) -> TlsReloader | None:
        return self.tls_for(name) if self.tls_for is not None else None

    def policy(self) -> TrustState:
        return TrustState(self.root.key_id)

    async def start_seed(self, zone: str = "z0", **kw: object) -> RunningNode:
        cfg = NodeConfig("seed", RUN, SECRET, zone=zone, region="r0", is_seed=True, membership=FAST_MEMBERSHIP, **kw)  # type: ignore[arg-type]
        self.seed = await start_http_node(
            cfg, self.policy(), board=self.board, rng=random.Random(0), tls=self._tls("seed")
        )
        return self.seed

    async def start_node(
        self, name: str, zone: str = "z0", region: str = "r0", apply: ApplyVersion | None = None, **kw: object
    ) -> RunningNode:
        assert self.seed is not None
        bootstrap = [self.seed.url, *(n.url for n in list(self.nodes.values())[:2])]
        cfg = NodeConfig(
            name,
            RUN,
            SECRET,
            zone=zone,
            region=region,
            bootstrap=bootstrap,
            seed_urls=[self.seed.url],
            membership=FAST_MEMBERSHIP,
            head_poll_interval=0.5,
            **kw,  # type: ignore[arg-type]
        )
        node = await start_http_node(
            cfg, self.policy(), rng=random.Random(hash(name) & 0xFFFF), tls=self._tls(name), apply=apply
        )
        self.nodes[name] = node
        return node

    async def crash(self, name: str) -> None:
        """Stop a node without a goodbye: its peers must find out by themselves."""
        await self.nodes.pop(name).stop(leave=False)

    async def wait_all(self, version: int, timeout: float = 60.0, names: list[str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            running = [self.nodes[n] for n in names] if names else list(self.nodes.values())
            versions = {r.node.info.node_id: (r.node.held.version if r.node.held else None) for r in running}
            if all(v == version for v in versions.values()):
                return
            if time.monotonic() > deadline:
                errors = {r.node.info.node_id: r.node.error for r in running if r.node.error}
                raise AssertionError(f"not all at version {version}: {versions}; errors: {errors}")
            await asyncio.sleep(0.05)

    def assert_bitwise(self) -> None:
        for r in self.nodes.values():
            held = r.node.held
            assert held is not None
            assert held.model.bitwise_equal(self.served[held.version]), r.node.info.node_id

    async def close(self) -> None:
        for r in list(self.nodes.values()):
            await r.stop()
        self.nodes.clear()
        if self.seed is not None:
            await self.seed.stop()

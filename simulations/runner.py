"""Real swarm nodes in virtual time: a seed serving a board and N peers on a simulated network.

``run_swarm`` builds one ``SimNet`` over a ``Network``, one ``swarm.node.SwarmNode`` per host
(the seed with the board and its chunk files, the peers with nothing), starts them all at
virtual time 0 and waits until every peer holds ``version`` (or ``deadline`` virtual seconds
pass).  The nodes are the production ones: same gossip, same chunk scheduler, same
verification and patch application; only the Transport and Clock are simulated.

Per-host rate limits belong to the network (``Host.up``/``Host.down``); the nodes' own token
buckets are left unlimited so that the model, not the node, is the bottleneck.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from daemon.board import Board
from daemon.pull import Held
from protocol.catalog import plan
from protocol.head import Head
from protocol.keys import KeyPolicy
from protocol.membership import MembershipConfig
from protocol.served import state_root
from protocol.signed import Envelope
from simulations.bounds import kumar_ross
from simulations.clock import SimClock, VirtualTimeLoop, run_virtual
from simulations.network import Backbone, Host, Network, Region
from simulations.transport import MessageStats, SimNet
from swarm.node import NodeConfig, SwarmNode
from swarm.stores import BoardChunkStore


@dataclass(frozen=True)
class SwarmSetup:
    """What a swarm simulation needs besides the hosts: the board, its trust, the run's identity."""

    board: Board
    run_id: str
    cluster_secret: bytes
    policy: Callable[[], KeyPolicy]  # a fresh trust state per node (nodes update theirs)
    epoch: float = field(default_factory=time.time)  # the Unix time that virtual time 0 stands for


@dataclass(frozen=True)
class SwarmResult:
    version: int
    seed: int
    payload_bytes: int  # what a fresh node must fetch to reach the version (its planned path)
    reached: dict[str, float]  # node id -> virtual seconds when it held the version
    time_to_all: float  # virtual seconds until the last peer held it (inf: deadline passed)
    lower_bound: float  # Kumar-Ross for payload_bytes over the hosts' links
    sent: dict[str, float]  # bytes each host put on the network (chunks, objects; gossip if sent as flows)
    from_seed: dict[str, int]  # chunk bytes each peer took from the seed
    from_peers: dict[str, int]
    seed_uploaded: int  # chunk bytes the seed node served
    messages: MessageStats
    errors: dict[str, str]
    roots: dict[str, bytes]  # node id -> state root of the model it holds (check against the published one)
    loop_jumps: int  # how often virtual time moved: a measure of simulated events

    @property
    def complete(self) -> bool:
        return self.time_to_all < float("inf")


def payload_bytes(board: Board, run_id: str, version: int, base: int | None = None) -> int:
    """Bytes a node holding ``base`` (None: nothing) fetches to reach ``version``: its planned path's payloads."""
    head = Head.from_bytes(Envelope.from_bytes(board.read(Board.head_rel(run_id)) or b"", "patchswarm/head").body)
    return sum(e.size for e in plan(head.catalog, base, version))


async def run_swarm(
    setup: SwarmSetup,
    seed_host: Host,
    peers: Sequence[Host],
    version: int,
    *,
    regions: Sequence[Region] = (),
    backbones: Sequence[Backbone] = (),
    window: float | None = None,
    seed: int = 0,
    deadline: float = 600.0,
    membership: MembershipConfig | None = None,
    node_options: dict[str, Any] | None = None,
    gossip_flows: bool = False,
    start_from: Held | None = None,
) -> SwarmResult:
    """Simulate on the running (virtual-time) loop; see ``simulate_swarm`` for the synchronous entry.

    ``start_from``: the version every peer holds at the start (None: nothing).  ``node_options``:
    NodeConfig fields for every node.  ``deadline``: virtual seconds before giving up.
    """
    kw: dict[str, Any] = {} if window is None else {"window": window}
    network = Network([seed_host, *peers], regions, backbones, **kw)
    net = SimNet(network, gossip_flows=gossip_flows)
    clock = SimClock(setup.epoch)
    t0 = clock.now()
    base = NodeConfig(
        "",
        setup.run_id,
        setup.cluster_secret,
        membership=membership or MembershipConfig(),
        **(node_options or {}),
    )
    reached: dict[str, float] = {}
    everyone = asyncio.Event()

    def recorder(node_id: str) -> Callable[[Held], None]:
        def on_version(held: Held) -> None:
            if held.version >= version and node_id not in reached:
                reached[node_id] = clock.now() - t0
                if len(reached) == len(peers):
                    everyone.set()

        return on_version

    def addr(host: Host) -> str:
        return f"sim://{host.id}"

    seed_cfg = replace(base, node_id=seed_host.id, region=seed_host.region, is_seed=True)
    seed_node = SwarmNode(
        seed_cfg,
        addr(seed_host),
        net.transport(seed_host.id),
        clock,
        setup.policy(),
        random.Random(f"{seed}:{seed_host.id}"),
        chunks=BoardChunkStore(setup.board.root),
        board=setup.board,
    )
    nodes = [seed_node]
    for i, h in enumerate(peers):
        held = Held(start_from.version, start_from.model.clone(), list(start_from.digests)) if start_from else None
        bootstrap = [addr(seed_host), *(addr(p) for p in peers[max(0, i - 2) : i])]
        cfg = replace(base, node_id=h.id, region=h.region, bootstrap=bootstrap)
        nodes.append(
            SwarmNode(
                cfg,
                addr(h),
                net.transport(h.id),
                clock,
                setup.policy(),
                random.Random(f"{seed}:{h.id}"),
                held=held,
                on_version=recorder(h.id),
            )
        )
    for node in nodes:
        net.register(node.info.addr, node.config.node_id, node.handlers())
    try:
        for node in nodes:
            await node.start()
        if peers:
            try:
                async with asyncio.timeout(deadline):
                    await everyone.wait()
            except TimeoutError:
                pass
    finally:
        for node in nodes:
            await node.stop(leave=False)
            await node.transport.close()
        net.close()
    size = payload_bytes(setup.board, setup.run_id, version, start_from.version if start_from else None)
    loop = asyncio.get_running_loop()
    return SwarmResult(
        version=version,
        seed=seed,
        payload_bytes=size,
        reached=dict(sorted(reached.items())),
        time_to_all=max(reached.values()) if len(reached) == len(peers) and peers else float("inf"),
        lower_bound=kumar_ross(size, seed_host.up, [p.up for p in peers], [p.down for p in peers]),
        sent=dict(sorted(network.traffic.sent.items())),
        from_seed={n.config.node_id: n.metrics.bytes_from_seed for n in nodes[1:]},
        from_peers={n.config.node_id: n.metrics.bytes_from_peers for n in nodes[1:]},
        seed_uploaded=seed_node.metrics.bytes_uploaded,
        messages=net.stats,
        errors={n.config.node_id: n.error for n in nodes if n.error},
        roots={n.config.node_id: state_root(n.held.model.specs, n.held.digests) for n in nodes[1:] if n.held},
        loop_jumps=loop.jumps if isinstance(loop, VirtualTimeLoop) else 0,
    )


def simulate_swarm(setup: SwarmSetup, seed_host: Host, peers: Sequence[Host], version: int, **kw: Any) -> SwarmResult:
    """Run ``run_swarm`` on a fresh virtual-time loop (no wall-clock waiting) and return its result."""
    return run_virtual(run_swarm(setup, seed_host, peers, version, **kw))

"""Real swarm nodes in virtual time: a seed serving a board and N peers on a simulated network.

One run function, ``_run``, builds the world once: one ``SimNet`` over a ``Network``, one
``swarm.node.SwarmNode`` per host (the seed with the board and its chunk files, the peers with
what they start from), starts them all at virtual time 0 and runs until every peer holds every
version asked for (or the deadline passes), publishing the versions on the seed's board and
crashing and reviving hosts (``Churn``) as told.  Its two uses: ``run_swarm`` (one version the
board already names, a ``SwarmResult``) and ``run_stream`` (versions published every T seconds,
churn, a ``StreamResult`` with one row per host and version).  The nodes are the production
ones: same gossip, same chunk scheduler, same verification and patch application; only the
Transport and Clock are simulated.

Per-host rate limits belong to the network (``Host.up``/``Host.down``); the nodes' own token
buckets are left unlimited so that the model, not the node, is the bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.catalog import plan
from patchswarm.protocol.head import Head
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.membership_messages import Sync
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.served import state_root
from patchswarm.protocol.signed import Envelope
from patchswarm.simulations.bounds import kumar_ross
from patchswarm.simulations.clock import SimClock, VirtualTimeLoop, long_lived, run_virtual
from patchswarm.simulations.network import Backbone, Host, Network, Region
from patchswarm.simulations.tcp_window import TcpModel
from patchswarm.simulations.transport import MessageStats, SimNet
from patchswarm.swarm.board_files import BoardReader
from patchswarm.swarm.download import VerifyChunk
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.staging import ApplyVersion
from patchswarm.swarm.stores import BoardChunkStore, ChunkStore, MemoryChunkStore


@dataclass(frozen=True)
class SwarmSetup:
    """What a swarm simulation needs besides the hosts: the board, its trust, the run's identity."""

    board: BoardReader
    run_id: str
    cluster_secret: bytes
    policy: Callable[[], KeyPolicy]  # a fresh trust state per node (nodes update theirs)
    epoch: float = field(default_factory=time.time)  # the Unix time that virtual time 0 stands for
    # Placeholder mode (simulations/synthetic.py fills these): the seed's chunk store (None: the
    # board's chunk files), the nodes' chunk check and apply (None: the production ones), and how
    # to move the board's head to a version (needed by ``simulate_stream``).
    seed_chunks: Callable[[], ChunkStore] | None = None
    verify_chunk: VerifyChunk | None = None
    apply: ApplyVersion | None = None
    publish: Callable[[int], None] | None = None

    def hooks(self) -> dict[str, Any]:
        """SwarmNode keyword arguments for the injected verification and apply (empty: production)."""
        kw: dict[str, Any] = {}
        if self.verify_chunk is not None:
            kw["verify_chunk"] = self.verify_chunk
        if self.apply is not None:
            kw["apply"] = self.apply
        return kw

    def seed_store(self) -> ChunkStore:
        return self.seed_chunks() if self.seed_chunks is not None else BoardChunkStore(self.board)


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


def payload_bytes(board: BoardReader, run_id: str, version: int, base: int | None = None) -> int:
    """Bytes a node holding ``base`` (None: nothing) fetches to reach ``version``: its planned path's payloads."""
    head = Head.from_bytes(Envelope.from_bytes(board.read(head_rel(run_id)) or b"", HEAD_TAG).body)
    return sum(e.size for e in plan(head.catalog, base, version))


# ---------------------------------------------------------------- what a run is given and gives back


# NodeConfig fields a stream run sets unless node_options says otherwise: choose announcement targets
# among 32 random live members instead of all (O(1) per announcement instead of O(N); same at N <= 32).
SIM_NODE_DEFAULTS: dict[str, Any] = {"announce_sample": 32}


@dataclass(frozen=True)
class Churn:
    """Hosts crash and come back (never the seed).

    ``rate``: crashes per host per virtual second (Poisson), each followed by a downtime drawn
    from an exponential of mean ``downtime``; ``schedule``: explicit ``(at, host id, seconds
    down)`` crashes on top; ``events``: explicit ``(at, host id, up)`` switches (``up=False``
    crashes the host if it is up, ``True`` brings it back if it is down), in any order.

    A crash kills the node at once: its transfers in both directions stop, its memory (chunk
    cache, partial downloads, peer views) is lost.  ``persist=True``: it rejoins holding its last
    complete version, as a daemon whose weight store survived the crash does; ``False``: it
    rejoins with nothing and fetches the anchor again.  It rejoins through the seed and two
    random live peers.
    """

    rate: float = 0.0
    downtime: float = 30.0
    schedule: tuple[tuple[float, str, float], ...] = ()
    events: tuple[tuple[float, str, bool], ...] = ()
    persist: bool = True

    def __post_init__(self) -> None:
        if self.rate < 0 or self.downtime <= 0:
            raise ValueError("churn needs rate >= 0 and downtime > 0")


@dataclass(frozen=True)
class HostVersion:
    """One row: when ``host`` first held ``version`` (or a newer one), and where its chunks came from."""

    host: str
    version: int
    published: float  # virtual seconds when the head named the version
    done: float  # virtual seconds when the host first held it (inf: never, within the run)
    from_seed: int  # chunk bytes of this version's manifest the host took from the seed (all its lives)
    from_peers: int

    @property
    def latency(self) -> float:
        return self.done - self.published


@dataclass(frozen=True)
class VersionStats:
    version: int
    published: float
    payload_bytes: int  # the version's own payload (a patch over the one before)
    time_to_all: float  # seconds from publication until every peer held it (inf: someone never did)
    lower_bound: float  # Kumar-Ross for payload_bytes over the seed's and peers' links
    seed_egress: int  # chunk bytes of this version the seed handed out (that arrived)
    peer_bytes: int  # chunk bytes of this version peers handed each other
    hosts_done: int


@dataclass(frozen=True)
class Outage:
    host: str
    down: float
    up: float  # inf: still down at the end


@dataclass(frozen=True)
class StreamResult:
    rows: tuple[HostVersion, ...]  # by version, then in the order the peers were given
    versions: tuple[VersionStats, ...]
    seed_uploaded: int  # chunk bytes the seed node served (all versions; replies cut short by a crash included)
    sent: dict[str, float]  # bytes each host put on the network
    messages: MessageStats
    errors: dict[str, str]  # last error per host (a node's catch-up failure), if any
    outages: tuple[Outage, ...]
    events: int  # how often virtual time moved (simulated event instants)
    end: float  # virtual seconds when the run stopped
    wall_seconds: float = field(default=0.0, compare=False)
    # per host (its last life): the node's (step, version, virtual seconds) marks, see SwarmNode.marks
    marks: dict[str, tuple[tuple[str, int, float], ...]] = field(default_factory=dict, compare=False)

    @property
    def complete(self) -> bool:
        return all(r.done < float("inf") for r in self.rows)


# ---------------------------------------------------------------- the one run: build the world, run it, stop it


@dataclass
class _World:
    """A finished run: the network, the nodes (live and crashed) and what the run recorded."""

    network: Network
    net: SimNet
    seed_node: SwarmNode
    nodes: dict[str, SwarmNode]  # host id -> its node at the end (its last life), in the order the peers were given
    retired: list[SwarmNode]  # crashed incarnations (their byte counters still count)
    published: dict[int, float]  # version -> virtual seconds when the head named it
    done: dict[tuple[str, int], float]  # (host, version) -> virtual seconds when the host first held it
    outages: list[Outage]
    events: int  # how often virtual time moved during the run
    end: float  # virtual seconds when the run stopped
    wall: float


async def _run(
    setup: SwarmSetup,
    seed_host: Host,
    peers: Sequence[Host],
    *,
    versions: Sequence[int],
    interval: float,
    publish: bool,
    regions: Sequence[Region],
    backbones: Sequence[Backbone],
    window: float | None,
    quantum: float,
    tcp: TcpModel | None,
    seed: int,
    churn: Churn | None,
    start_from: Held | None,
    deadline: float,
    membership: MembershipConfig | None,
    node_options: Mapping[str, Any],
    host_options: Mapping[str, Mapping[str, Any]],
    gossip_flows: bool,
    progress: Callable[[float, int, int], None] | None,
    warm_membership: bool,
) -> _World:
    """Build the world once (network, seed node, one node per peer), start it at virtual time 0, run it
    until every peer held every one of ``versions`` or the deadline passed, and stop it.

    ``publish``: move the seed's board to each version, one every ``interval`` (the first at 0), and
    count the deadline from the last publication; off: the board already names the versions (they
    count as published at 0) and the deadline counts from when every node has started."""
    wall0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    jumps0 = loop.jumps if isinstance(loop, VirtualTimeLoop) else 0
    kw: dict[str, Any] = {} if window is None else {"window": window}
    network = Network([seed_host, *peers], regions, backbones, quantum=quantum, tcp=tcp, **kw)
    net = SimNet(network, gossip_flows=gossip_flows)
    clock = SimClock(setup.epoch)
    t0 = clock.now()
    base = NodeConfig(
        "", setup.run_id, setup.cluster_secret, membership=membership or MembershipConfig(), **node_options
    )
    order = [h.id for h in peers]
    by_id = {h.id: h for h in peers}
    published: dict[int, float] = {} if publish else dict.fromkeys(versions, 0.0)
    done: dict[tuple[str, int], float] = {}
    total_rows = len(peers) * len(versions)
    everyone = asyncio.Event()
    if not total_rows:
        everyone.set()
    wanted = list(versions)
    last_at = t0 + max(0, len(versions) - 1) * interval  # the last publication

    def recorder(host: str) -> Callable[[Held], None]:
        def on_version(held: Held) -> None:
            now = clock.now() - t0
            for v in wanted:
                if v <= held.version and v in published and (host, v) not in done:
                    done[(host, v)] = now
            if progress is not None:
                progress(now, len(done), total_rows)
            if len(done) == total_rows:
                everyone.set()

        return on_version

    def addr(host_id: str) -> str:
        return f"sim://{host_id}"

    nodes: dict[str, SwarmNode] = {}
    lives: dict[str, int] = {}
    retired: list[SwarmNode] = []
    outages: list[Outage] = []
    down_since: dict[str, float] = {}
    pick = random.Random(f"{seed}:bootstrap")

    def clone(held: Held | None) -> Held | None:
        return None if held is None else Held(held.version, held.model.clone(), list(held.digests))

    def make(host_id: str, held: Held | None, bootstrap: list[str]) -> SwarmNode:
        h = by_id[host_id]
        life = lives.get(host_id, 0)
        lives[host_id] = life + 1
        cfg = replace(base, node_id=h.id, region=h.region, bootstrap=bootstrap, **host_options.get(h.id, {}))
        rng = random.Random(f"{seed}:{h.id}" if life == 0 else f"{seed}:{h.id}:{life}")
        node = SwarmNode(
            cfg,
            addr(h.id),
            net.transport(h.id),
            clock,
            setup.policy(),
            rng,
            chunks=MemoryChunkStore(cfg.cache_bytes),
            held=held,
            on_version=recorder(h.id),
            **setup.hooks(),
        )
        nodes[host_id] = node
        net.register(node.info.addr, host_id, node.handlers())
        return node

    with long_lived():  # the nodes live as long as the run: kept out of the collector's scans
        seed_node = SwarmNode(
            replace(
                base, node_id=seed_host.id, region=seed_host.region, is_seed=True, **host_options.get(seed_host.id, {})
            ),
            addr(seed_host.id),
            net.transport(seed_host.id),
            clock,
            setup.policy(),
            random.Random(f"{seed}:{seed_host.id}"),
            chunks=setup.seed_store(),
            board=setup.board,
            **setup.hooks(),
        )
        for i, hid in enumerate(order):
            make(hid, clone(start_from), [addr(seed_host.id), *(addr(p) for p in order[max(0, i - 2) : i])])
        net.register(seed_node.info.addr, seed_host.id, seed_node.handlers())
        if warm_membership:
            _warm([seed_node, *nodes.values()], clock.now(), random.Random(f"{seed}:warm"))
    tasks: list[asyncio.Task[None]] = []

    async def publisher() -> None:
        """Publish each version on time, and count the hosts already holding it as done."""
        assert setup.publish is not None
        for i, v in enumerate(versions):
            await asyncio.sleep(t0 + i * interval - clock.now())
            setup.publish(v)
            seed_node.board_changed()  # as a publisher's notification would: no wait for the seed's next board read
            published[v] = i * interval
            for hid, node in nodes.items():  # hosts already holding it (or newer) have it now
                if node.held is not None and node.held.version >= v:
                    done.setdefault((hid, v), published[v])
            if len(done) == total_rows:
                everyone.set()

    saved: dict[str, Held | None] = {}

    async def kill(hid: str) -> None:
        node = nodes.pop(hid, None)
        if node is None:
            return  # already down
        down_since[hid] = clock.now() - t0
        saved[hid] = node.held if churn is None or churn.persist else None
        retired.append(node)
        net.crash(hid)
        await node.stop(leave=False)
        await node.transport.close()

    async def revive(hid: str) -> None:
        if hid in nodes or hid not in down_since:
            return  # up already
        up = [p for p in order if p in nodes]
        bootstrap = [addr(seed_host.id), *(addr(p) for p in pick.sample(up, min(2, len(up))))]
        outages.append(Outage(hid, down_since.pop(hid), clock.now() - t0))
        await make(hid, saved.pop(hid, None), bootstrap).start()

    async def crash(hid: str, down_for: float) -> None:
        await kill(hid)
        await asyncio.sleep(down_for)
        await revive(hid)

    async def poisson(hid: str, c: Churn) -> None:
        rng = random.Random(f"{seed}:churn:{hid}")
        while True:
            await asyncio.sleep(rng.expovariate(c.rate))
            await crash(hid, rng.expovariate(1.0 / c.downtime))

    async def scheduled(at: float, hid: str, down_for: float) -> None:
        await asyncio.sleep(t0 + at - clock.now())
        await crash(hid, down_for)

    async def switch(at: float, hid: str, up: bool) -> None:
        await asyncio.sleep(t0 + at - clock.now())
        await (revive(hid) if up else kill(hid))

    if publish:  # the head starts at what the hosts hold (a board reused from an earlier run may be further on)
        assert setup.publish is not None
        setup.publish(start_from.version if start_from is not None else versions[0])
    try:
        await seed_node.start()
        for hid in order:
            await nodes[hid].start()
        if publish:
            tasks.append(asyncio.create_task(publisher()))
        if churn is not None:
            for at, hid, down_for in churn.schedule:
                if hid not in by_id:
                    raise ValueError(f"churn schedule names unknown host {hid!r}")
                tasks.append(asyncio.create_task(scheduled(at, hid, down_for)))
            for at, hid, up in churn.events:
                if hid not in by_id:
                    raise ValueError(f"churn events name unknown host {hid!r}")
                tasks.append(asyncio.create_task(switch(at, hid, up)))
            if churn.rate > 0:
                tasks.extend(asyncio.create_task(poisson(hid, churn)) for hid in order)
        try:
            async with asyncio.timeout_at((last_at if publish else clock.now()) + deadline):
                await everyone.wait()
        except TimeoutError:
            pass
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for node in [seed_node, *nodes.values()]:
            await node.stop(leave=False)
            await node.transport.close()
        net.close()
    end = clock.now() - t0
    outages.extend(Outage(hid, at, float("inf")) for hid, at in down_since.items())  # still down at the end
    events = (loop.jumps if isinstance(loop, VirtualTimeLoop) else 0) - jumps0
    return _World(
        network, net, seed_node, nodes, retired, published, done, outages, events, end, time.perf_counter() - wall0
    )


# ---------------------------------------------------------------- one version to every peer


async def run_swarm(
    setup: SwarmSetup,
    seed_host: Host,
    peers: Sequence[Host],
    version: int,
    *,
    regions: Sequence[Region] = (),
    backbones: Sequence[Backbone] = (),
    window: float | None = None,
    tcp: TcpModel | None = None,
    seed: int = 0,
    deadline: float = 600.0,
    membership: MembershipConfig | None = None,
    node_options: dict[str, Any] | None = None,
    host_options: Mapping[str, dict[str, Any]] | None = None,
    gossip_flows: bool = False,
    start_from: Held | None = None,
) -> SwarmResult:
    """Simulate on the running (virtual-time) loop; see ``simulate_swarm`` for the synchronous entry.

    The board already names ``version``; the run ends when every peer holds it.  ``start_from``: the
    version every peer holds at the start (None: nothing).  ``node_options``: NodeConfig fields for
    every node; ``host_options``: more, per host id (e.g. a node-enforced ``upload_rate`` per host, as
    loopback daemons have).  ``deadline``: virtual seconds, from when every node has started, before
    giving up.
    """
    w = await _run(
        setup,
        seed_host,
        peers,
        versions=[version],
        interval=0.0,
        publish=False,
        regions=regions,
        backbones=backbones,
        window=window,
        quantum=0.0,
        tcp=tcp,
        seed=seed,
        churn=None,
        start_from=start_from,
        deadline=deadline,
        membership=membership,
        node_options=node_options or {},
        host_options=host_options or {},
        gossip_flows=gossip_flows,
        progress=None,
        warm_membership=False,
    )
    reached = {hid: w.done[(hid, version)] for hid in (p.id for p in peers) if (hid, version) in w.done}
    size = payload_bytes(setup.board, setup.run_id, version, start_from.version if start_from else None)
    nodes = [w.seed_node, *w.nodes.values()]
    return SwarmResult(
        version=version,
        seed=seed,
        payload_bytes=size,
        reached=dict(sorted(reached.items())),
        time_to_all=max(reached.values()) if len(reached) == len(peers) and peers else float("inf"),
        lower_bound=kumar_ross(size, seed_host.up, [p.up for p in peers], [p.down for p in peers]),
        sent=dict(sorted(w.network.traffic.sent.items())),
        from_seed={n.config.node_id: n.metrics.bytes_from_seed for n in nodes[1:]},
        from_peers={n.config.node_id: n.metrics.bytes_from_peers for n in nodes[1:]},
        seed_uploaded=w.seed_node.metrics.bytes_uploaded,
        messages=w.net.stats,
        errors={n.config.node_id: n.error for n in nodes if n.error},
        roots={n.config.node_id: state_root(n.held.model.specs, n.held.digests) for n in nodes[1:] if n.held},
        loop_jumps=w.events,
    )


def simulate_swarm(setup: SwarmSetup, seed_host: Host, peers: Sequence[Host], version: int, **kw: Any) -> SwarmResult:
    """Run ``run_swarm`` on a fresh virtual-time loop (no wall-clock waiting) and return its result."""
    return run_virtual(run_swarm(setup, seed_host, peers, version, **kw))


# ---------------------------------------------------------------- a stream of versions, with churn


async def run_stream(
    setup: SwarmSetup,
    seed_host: Host,
    peers: Sequence[Host],
    *,
    versions: Sequence[int],
    interval: float,
    regions: Sequence[Region] = (),
    backbones: Sequence[Backbone] = (),
    window: float | None = None,
    quantum: float = 0.0,
    tcp: TcpModel | None = None,
    seed: int = 0,
    churn: Churn | None = None,
    start_from: Held | None = None,
    deadline: float = 600.0,
    membership: MembershipConfig | None = None,
    node_options: dict[str, Any] | None = None,
    host_options: Mapping[str, dict[str, Any]] | None = None,
    gossip_flows: bool = False,
    progress: Callable[[float, int, int], None] | None = None,
    pace_seed: bool = True,
    warm_membership: bool = True,
) -> StreamResult:
    """Publish ``versions`` one every ``interval`` virtual seconds (the first at 0) on the seed's
    board (its head first moved to ``start_from``'s version, or to ``versions[0]``), and run the
    seed plus ``peers`` until every peer held every version or ``deadline`` virtual seconds passed
    after the last publication.  See ``simulate_stream``.

    ``warm_membership``: the hosts were up before the first publication, so each node starts knowing
    every member, as after the anti-entropy syncs of a running swarm (``_warm``).  Off: every node
    joins at 0 through the seed and the two hosts before it, and the first version spreads while
    the membership still does (a cold start: at 1,000 hosts some hosts were still unknown to 95% of
    the others when the rest had the version)."""
    if setup.publish is None:
        raise ValueError("a stream needs a setup that can move its head (SwarmSetup.publish)")
    if interval < 0:
        raise ValueError("interval must be >= 0")
    per_host = dict(host_options or {})
    if pace_seed and math.isfinite(seed_host.up):
        # The seed sends one chunk after another at its link rate (its token bucket holds the upload slot
        # meanwhile) instead of starting every requested chunk at once: under max-min sharing those would
        # all finish together at the end, and no peer could relay any of them before.
        per_host[seed_host.id] = {"upload_rate": seed_host.up, "upload_burst": 0.0, **per_host.get(seed_host.id, {})}
    w = await _run(
        setup,
        seed_host,
        peers,
        versions=versions,
        interval=interval,
        publish=True,
        regions=regions,
        backbones=backbones,
        window=window,
        quantum=quantum,
        tcp=tcp,
        seed=seed,
        churn=churn,
        start_from=start_from,
        deadline=deadline,
        membership=membership,
        node_options={**SIM_NODE_DEFAULTS, **(node_options or {})},
        host_options=per_host,
        gossip_flows=gossip_flows,
        progress=progress,
        warm_membership=warm_membership,
    )
    return _stream_result(setup, seed_host, peers, versions, w)


def _stream_result(
    setup: SwarmSetup, seed_host: Host, peers: Sequence[Host], versions: Sequence[int], w: _World
) -> StreamResult:
    head = Head.from_bytes(Envelope.from_bytes(setup.board.read(head_rel(setup.run_id)) or b"", HEAD_TAG).body)
    entries = {e.version: e for e in head.catalog}
    from_seed: dict[tuple[str, int], int] = {}
    from_peers: dict[tuple[str, int], int] = {}
    mids = {e.manifest_id: e.version for e in head.catalog}
    nodes = [*w.nodes.values(), *w.retired]
    for node in nodes:
        hid = node.config.node_id
        for counts, into in (
            (node.seed_bytes_by_manifest, from_seed),
            (node.peer_bytes_by_manifest, from_peers),
        ):
            for mid, n in counts.items():
                v = mids.get(mid)
                if v is not None:
                    into[(hid, v)] = into.get((hid, v), 0) + n
    inf = float("inf")
    rows: list[HostVersion] = []
    stats: list[VersionStats] = []
    ups, downs = [p.up for p in peers], [p.down for p in peers]
    for v in versions:
        at = w.published.get(v, inf)
        vrows = [
            HostVersion(
                p.id, v, at, w.done.get((p.id, v), inf), from_seed.get((p.id, v), 0), from_peers.get((p.id, v), 0)
            )
            for p in peers
        ]
        rows.extend(vrows)
        size = entries[v].size if v in entries else 0
        latencies = [r.latency for r in vrows]
        stats.append(
            VersionStats(
                version=v,
                published=at,
                payload_bytes=size,
                time_to_all=max(latencies, default=0.0) if all(r.done < inf for r in vrows) else inf,
                lower_bound=kumar_ross(size, seed_host.up, ups, downs),
                seed_egress=sum(r.from_seed for r in vrows),
                peer_bytes=sum(r.from_peers for r in vrows),
                hosts_done=sum(1 for r in vrows if r.done < inf),
            )
        )
    errors = {n.config.node_id: n.error for n in nodes if n.error}
    t0 = w.seed_node.clock.now() - w.end
    marks = {n.config.node_id: tuple((step, v, t - t0) for step, v, t in n.marks) for n in nodes}
    return StreamResult(
        rows=tuple(rows),
        versions=tuple(stats),
        seed_uploaded=w.seed_node.metrics.bytes_uploaded,
        sent=dict(sorted(w.network.traffic.sent.items())),
        messages=w.net.stats,
        errors=dict(sorted(errors.items())),
        outages=tuple(sorted(w.outages, key=lambda o: (o.down, o.host))),
        events=w.events,
        end=w.end,
        wall_seconds=w.wall,
        marks=marks,
    )


def simulate_stream(setup: SwarmSetup, seed_host: Host, peers: Sequence[Host], **kw: Any) -> StreamResult:
    """Run ``run_stream`` on a fresh virtual-time loop and return its result.

    Keywords: ``versions`` (published in this order), ``interval`` (virtual seconds between
    publications; the first at 0), ``regions``, ``backbones``, ``window``, ``tcp`` (slow start, a
    ``TcpModel``), ``quantum`` (network event batching, seconds), ``seed`` (every random choice:
    nodes, churn, rejoin bootstrap),
    ``churn`` (a ``Churn``), ``start_from`` (what every peer holds at 0), ``deadline`` (virtual
    seconds after the last publication), ``membership``, ``node_options`` (NodeConfig fields),
    ``host_options`` (NodeConfig fields per host id, over node_options),
    ``gossip_flows``, ``progress(virtual_now, rows_done, rows_total)``.
    """
    return run_virtual(run_stream(setup, seed_host, peers, **kw))


WARM_HEARD_PER_MEMBER = 4  # a bounded view of k is warmed with this many x k members drawn at random


def _warm(nodes: Sequence[SwarmNode], now: float, rng: random.Random) -> None:
    """Give every node the membership of a running swarm, as one anti-entropy sync from an up-to-date
    member would (in-process: no frame limit), with nothing left to gossip about it.  ``nodes[0]``
    is the seed, every node's join contact.

    Full membership: every member.  A bounded view of k keeps the k lowest-ranked members it heard
    of, the rank a hash per pair of nodes, so a uniformly random k-subset however many it heard of:
    it is given the seed and ``WARM_HEARD_PER_MEMBER`` x k others drawn at random, the same kind of
    view for O(k) updates per node instead of O(N) (at 3,000 hosts the full warm-up was 24% of a
    run's CPU; at 10,000 it is 10^8 updates)."""
    updates = [n.membership.local() for n in nodes]
    by_id = sorted(range(len(nodes)), key=lambda j: updates[j].info.node_id)
    everyone = tuple(updates[j] for j in by_id)
    place = [0] * len(nodes)  # node -> its place in everyone (sorting a sample's places sorts it by id)
    for p, j in enumerate(by_id):
        place[j] = p
    for i, node in enumerate(nodes):
        sender = nodes[1 if i == 0 else 0].info
        k = node.config.membership.max_members
        picked: set[int] | None = None
        if k and WARM_HEARD_PER_MEMBER * k < len(nodes) - 1:
            picked = set(rng.sample(range(len(nodes)), WARM_HEARD_PER_MEMBER * k + 1)) | {0}  # (drawn for every node)
            picked.discard(i)
        heard = everyone if picked is None else tuple(everyone[p] for p in sorted(place[j] for j in picked))
        node.membership.receive(now, sender, Sync(heard, reply=False))
    for node in nodes:
        node.membership.settle()  # those joins are old news in a running swarm: nothing to gossip round
        node.settle_members()

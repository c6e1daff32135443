"""One simulated swarm run in several processes: the nodes split between children, the flow model in the parent.

Why: a large run is single-threaded Python (1,000 hosts x 500 MB: ~100 CPU-s, nine tenths of it in the
nodes), and the issue's budget is wall time on 2 cores.

How (conservative synchronous windows, as parallel discrete-event simulators do): the parent builds the
run as ``runner.run_stream`` does (network and nodes), then forks one child per partition.  Each child
warms and runs its share of the nodes on its copy of the virtual-time loop; the parent keeps the flow
model.  What a node does at t reaches another node at t + L at the earliest, L the smallest one-way
latency (a message after its latency, a flow after its latency and then its bytes).  So virtual time
advances in windows of L / 2, two in flight: what a partition sends in window j acts from window j + 2
on, and the parent computes the flow model's window j + 2 (its events depend only on flows started
before) while the children run window j + 1.  Per window the parent hands each child the events that
fall in it (messages from other partitions, finished flows); the children run their loops to the
window's end and hand back what they sent (messages, flows to start or stop).  Windows where nobody
acts are skipped.

The simulated nodes are the same objects; only their transport differs (``_PartTransport``, the same
exchanges as ``transport.SimTransport``).  One seed gives one result in this mode, as in the
sequential one, but not the same result as the sequential mode, which differs in three ways:

* a requester that gives up (a timeout, an endgame duplicate cancelled) stops the server's flow one
  latency later, when the reset reaches it, instead of at once;
* an error found at the server (a chunk longer than asked for, a handler raising) reaches the
  requester one latency later, as a refusal does;
* callbacks due at one virtual instant may run in another order.

Not supported (``supported`` says why; ``run_stream`` refuses): churn, gossip sent as flows, a zero
latency between some hosts, network quanta.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import math
import os
import pickle
import queue
import socket
import threading
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from patchswarm.simulations.network import Flow, Network
from patchswarm.simulations.transport import MessageStats, SimNet, is_placeholder, placeholder_bytes
from patchswarm.swarm.futures import fail, settle
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.transport import Busy, ChunkReply, Handlers, Missing, TransportError

# Event kinds on the wire between processes (one letter: there are millions of them).
_GOSSIP = "g"  # (addr, data): a datagram reaches its node
_REQUEST = "q"  # (rid, addr, chunk hash, size, requester, held, requester's host): a chunk request reaches its server
_OBJECT_REQUEST = "o"  # (rid, addr, path, limit, requester, insist, requester's host)
_ANSWER = "r"  # (rid, Busy | Missing | None): a refusal or an object's absence reaches the requester
_ERROR = "e"  # (rid, message): the exchange failed at the server
_ABANDON = "a"  # rid: the requester gave up (its reset reaches the server)
_SENT = "d"  # rid: the server's flow finished (its send returns)
_CHUNK = "k"  # (rid, payload): a chunk's bytes reached the requester
_BYTES = "b"  # (rid, payload): an object's bytes reached the requester


def supported(network: Network, *, churn: object, gossip_flows: bool, quantum: float) -> str | None:
    """None when a run can be partitioned, else why not."""
    if churn is not None:
        return "churn (crashes stop flows at once, across partitions)"
    if gossip_flows:
        return "gossip sent as flows"
    if quantum:
        return "network quanta"
    if lookahead(network) <= 0:
        return "a zero latency between some hosts"
    return None


def lookahead(network: Network) -> float:
    """The smallest one-way latency between two hosts: how far partitions may run apart."""
    reps = list({h.region: h.id for h in network.hosts.values()}.values())  # a host per region
    return min((network.latency(a, b) for a in reps for b in reps), default=0.0)


SOCKET_BUFFER = 0  # bytes each way between parent and child (0: the system's); tests make it small

SEED_WEIGHT = 0.02  # the seed's work, in hosts per host of the run (measured: 1.6-11% at 1,000 hosts, 500-100 MB)


def assign(seed: str, hosts: Sequence[str], partitions: int) -> dict[str, int]:
    """host -> partition: the seed in 0, the hosts in turn to whichever partition has the least work so far
    (the seed counting as ``SEED_WEIGHT`` x len(hosts) hosts), the lowest index on ties."""
    load = [0.0] * partitions
    load[0] = SEED_WEIGHT * len(hosts)
    owner = {seed: 0}
    for host in hosts:
        part = min(range(partitions), key=lambda p: (load[p], p))
        owner[host] = part
        load[part] += 1
    return owner


def _pack(data: bytes) -> bytes | int:
    """A placeholder payload travels as its size (simulations/placeholder.py: one shared object per size)."""
    return len(data) if is_placeholder(data) else data


def _unpack(payload: bytes | int) -> bytes:
    return placeholder_bytes(payload) if isinstance(payload, int) else payload


@dataclass
class _Outbox:
    """What a partition did in one window, for the parent."""

    messages: list[tuple[float, int, str, Any]] = field(default_factory=list)  # (at, host's partition, kind, payload)
    flows: list[tuple[float, int, str, str, int, int, int, str, bytes | int]] = field(default_factory=list)
    cancels: list[tuple[float, int]] = field(default_factory=list)  # (effective at, rid)


class _Serving:
    """A chunk request being answered on this partition: the server's ``send``."""

    __slots__ = ("client", "done", "gone", "oversized", "part", "rid", "sent", "server", "size")

    def __init__(self, part: _Partition, rid: int, server: str, client: str, size: int) -> None:
        self.part = part
        self.rid = rid
        self.server = server
        self.client = client
        self.size = size
        self.done: asyncio.Future[None] | None = None
        self.gone = False
        self.sent = False
        self.oversized = 0

    async def send(self, data: bytes) -> None:
        if self.gone or self.sent:
            return
        if len(data) > self.size:
            self.oversized = len(data)  # the requester stops reading past its limit: nothing moves
            return
        self.sent = True
        part = self.part
        self.done = done = part.loop.create_future()
        part.start_flow(self.rid, self.server, self.client, data, _CHUNK, server_side=True)
        try:
            await done
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                part.stop_flow(self.rid, self.server, self.client)
                raise  # the handler itself is being cancelled
            # the requester gave up (_ABANDON): its reset stopped the flow


class _PartTransport:
    """``swarm.transport.Transport`` for a node of a partition (the exchanges of ``SimTransport``)."""

    def __init__(self, part: _Partition, host: str) -> None:
        self.part = part
        self.host = host
        self.closed = False

    async def send(self, addr: str, data: bytes) -> None:
        host = self.part.hosts.get(addr)
        if self.closed or host is None:
            raise TransportError(f"{addr}: connection refused")
        self.post(addr, data)
        await asyncio.sleep(self.part.latency(self.host, host))

    def post(self, addr: str, data: bytes) -> None:
        part = self.part
        host = part.hosts.get(addr)
        if self.closed or host is None:
            return
        part.stats.count_gossip(self.host, len(data))
        part.deliver(part.latency(self.host, host), host, _GOSSIP, (addr, data))

    async def get_chunk(
        self, addr: str, chunk_hash: bytes, size: int, timeout: float, requester: str, held: int = -1
    ) -> ChunkReply:
        part = self.part
        part.stats.chunk_requests += 1
        host, rid, reply = self._ask(addr, _REQUEST, chunk_hash, size, requester, held)
        deadline = part.loop.call_later(max(timeout, 0.0), _time_out, addr, reply)
        try:
            answer: ChunkReply = await reply
            return answer
        except (asyncio.CancelledError, TransportError) as e:
            if part.waiting.pop(rid, None) is not None:  # no answer yet: the server is still at it
                part.give_up(rid, self.host, host)
            if isinstance(e, TransportError):
                part.stats.failures += 1
            raise
        finally:
            deadline.cancel()

    async def get_object(
        self, addr: str, path: str, limit: int, timeout: float, requester: str = "", insist: bool = False
    ) -> bytes | Missing | None:
        part = self.part
        part.stats.object_requests += 1
        host, rid, reply = self._ask(addr, _OBJECT_REQUEST, path, limit, requester, insist)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                answer = await reply
        except TimeoutError:
            part.stats.failures += 1
            if part.waiting.pop(rid, None) is not None:
                part.give_up(rid, self.host, host)
            raise TransportError(f"{addr}: timed out") from None
        except TransportError:
            part.stats.failures += 1
            raise
        except asyncio.CancelledError:
            if part.waiting.pop(rid, None) is not None:
                part.give_up(rid, self.host, host)
            raise
        assert not isinstance(answer, Busy)
        result: bytes | Missing | None = answer
        return result

    def _ask(self, addr: str, kind: str, *args: Any) -> tuple[str, int, asyncio.Future[Any]]:
        """Send a request of ``kind`` (``(rid, addr, *args, this host)``) to ``addr``: (its host, the request's
        id, the future its answer settles)."""
        part = self.part
        if self.closed:
            raise TransportError("transport closed")
        host = part.hosts.get(addr)
        if host is None:
            part.stats.failures += 1
            raise TransportError(f"{addr}: connection refused")
        rid, reply = part.expect()
        part.deliver(part.latency(self.host, host), host, kind, (rid, addr, *args, self.host))
        return host, rid, reply

    async def close(self) -> None:
        self.closed = True


def _time_out(addr: str, reply: asyncio.Future[Any]) -> None:
    fail(reply, TransportError(f"{addr}: timed out"))


class _Partition:
    """A child's side: its nodes' endpoints, requests in flight both ways, and the window's outbox."""

    def __init__(
        self,
        index: int,
        network: Network,
        owner: dict[str, int],
        hosts: dict[str, str],
        handlers: dict[str, Handlers],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.index = index
        self.network = network
        self.owner = owner  # host -> partition
        self.hosts = hosts  # addr -> host (every node's)
        self.handlers = handlers  # addr -> handlers (this partition's nodes)
        self.loop = loop
        self.stats = MessageStats()
        self.out = _Outbox()
        self.waiting: dict[int, asyncio.Future[Any]] = {}  # rid -> the requester's answer
        self.serving: dict[int, _Serving] = {}
        self._next = 0
        # One-way latencies by region (the network's are): a host's region index, then a table lookup,
        # where a cache keyed by host pairs built and hashed a tuple per message.
        reps = {h.region: h.id for h in network.hosts.values()}  # a host per region
        numbers = {region: i for i, region in enumerate(reps)}
        self._region = {h.id: numbers[h.region] for h in network.hosts.values()}
        self._latency = [[network.latency(a, b) for b in reps.values()] for a in reps.values()]

    def latency(self, a: str, b: str) -> float:
        return self._latency[self._region[a]][self._region[b]]

    def expect(self) -> tuple[int, asyncio.Future[Any]]:
        """A request id unique across partitions, and the future its answer settles."""
        self._next += 1
        rid = self._next * 64 + self.index
        reply: asyncio.Future[Any] = self.loop.create_future()
        self.waiting[rid] = reply
        return rid, reply

    def deliver(self, delay: float, host: str, kind: str, payload: Any) -> None:
        """An event for ``host``'s partition ``delay`` seconds from now."""
        part = self.owner[host]
        if part == self.index:
            self.loop.call_later(delay, self.handle, kind, payload)
        else:
            self.out.messages.append((self.loop.time() + delay, part, kind, payload))

    def start_flow(self, rid: int, src: str, dst: str, data: bytes, kind: str, *, server_side: bool) -> None:
        self.out.flows.append(
            (
                self.loop.time(),
                rid,
                src,
                dst,
                len(data),
                self.index if server_side else -1,
                self.owner[dst],
                kind,
                _pack(data),
            )
        )

    def stop_flow(self, rid: int, src: str, dst: str) -> None:
        self.out.cancels.append((self.loop.time() + self.latency(src, dst), rid))

    def give_up(self, rid: int, client: str, server: str) -> None:
        """The requester gave up: its reset reaches the server (and stops the flow there) one latency later."""
        self.deliver(self.latency(client, server), server, _ABANDON, rid)
        self.out.cancels.append((self.loop.time() + self.latency(client, server), rid))

    # ------------------------------------------------------------ events

    def handle(self, kind: str, payload: Any) -> None:
        if kind == _GOSSIP:
            addr, data = payload
            h = self.handlers.get(addr)
            if h is not None:
                h.gossip(data)
        elif kind == _REQUEST:
            self._request(*payload)
        elif kind == _OBJECT_REQUEST:
            self.loop.create_task(self._object(*payload))
        elif kind == _ANSWER:
            rid, answer = payload
            reply = self.waiting.pop(rid, None)
            if reply is not None:
                settle(reply, answer)
        elif kind == _ERROR:
            rid, message = payload
            reply = self.waiting.pop(rid, None)
            if reply is not None:
                fail(reply, TransportError(message))
        elif kind == _ABANDON:
            serving = self.serving.get(payload)
            if serving is not None:
                serving.gone = True
                if serving.done is not None and not serving.done.done():
                    serving.done.cancel()
        elif kind == _SENT:
            serving = self.serving.get(payload)
            if serving is not None and serving.done is not None:
                settle(serving.done, None)
        elif kind in (_CHUNK, _BYTES):
            rid, packed = payload
            reply = self.waiting.pop(rid, None)
            if reply is not None and not reply.done():
                data = _unpack(packed)
                if kind == _CHUNK:
                    self.stats.chunk_bytes += len(data)
                else:
                    self.stats.object_bytes += len(data)
                reply.set_result(data)
        else:
            raise AssertionError(f"unknown event {kind!r}")

    def _served(self, rid: int, addr: str, client: str) -> tuple[Handlers, str, float] | None:
        """The handlers at ``addr``, its host and the latency back to ``client``; None (and the requester
        told) when nobody is there."""
        server = self.hosts[addr]
        back = self.latency(server, client)
        h = self.handlers.get(addr)
        if h is None:
            self.deliver(back, client, _ERROR, (rid, f"{addr}: connection refused"))
            return None
        return h, server, back

    def _request(
        self, rid: int, addr: str, chunk_hash: bytes, size: int, requester: str, held: int, client: str
    ) -> None:
        if (served := self._served(rid, addr, client)) is None:
            return
        h, server, back = served
        if h.refuse is not None and (refusal := h.refuse(chunk_hash, requester, held)) is not None:
            self.deliver(back, client, _ANSWER, (rid, refusal))
            return
        serving = self.serving[rid] = _Serving(self, rid, server, client, size)
        self.loop.create_task(self._answer(addr, h.chunk(chunk_hash, requester, held, serving.send), serving))

    async def _answer(self, addr: str, handler: Awaitable[Busy | Missing | None], serving: _Serving) -> None:
        back = self.latency(serving.server, serving.client)
        try:
            result = await handler
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the requester sees the handler's error
            if not serving.gone:
                self.deliver(back, serving.client, _ERROR, (serving.rid, f"{addr}: {type(e).__name__}: {e}"))
            return
        finally:
            self.serving.pop(serving.rid, None)
        if serving.gone:
            return
        if isinstance(result, Busy | Missing):
            self.deliver(back, serving.client, _ANSWER, (serving.rid, result))
        elif not serving.sent:
            why = f"chunk of {serving.oversized} bytes" if serving.oversized else "connection reset"
            self.deliver(back, serving.client, _ERROR, (serving.rid, f"{addr}: {why}"))
        # else: its bytes reach the requester when the flow finishes (_CHUNK from the parent)

    async def _object(
        self, rid: int, addr: str, path: str, limit: int, requester: str, insist: bool, client: str
    ) -> None:
        if (served := self._served(rid, addr, client)) is None:
            return
        h, server, back = served
        try:
            data = await h.object(path, requester, insist)
        except Exception as e:
            self.deliver(back, client, _ERROR, (rid, f"{addr}: {type(e).__name__}: {e}"))
            return
        if data is None or isinstance(data, Missing):
            self.deliver(back, client, _ANSWER, (rid, data))
        elif len(data) > limit:
            self.deliver(back, client, _ERROR, (rid, f"{addr}: object of {len(data)} bytes, expected at most {limit}"))
        else:
            self.start_flow(rid, server, client, data, _BYTES, server_side=False)

    def take_outbox(self) -> _Outbox:
        out, self.out = self.out, _Outbox()
        return out


def _next_timer(loop: asyncio.AbstractEventLoop) -> float:
    """When a virtual-time loop next has work: now if callbacks are ready, else its earliest timer (a
    cancelled one may make it early: harmless)."""
    core = loop._core  # type: ignore[attr-defined]
    if core.ready:
        return loop.time()
    return core.timers[0][0] if core.timers else math.inf


# ---------------------------------------------------------------- the child


@dataclass
class ChildResult:
    """What a child hands back at the end: per node what ``runner._stream_result`` reads, and its counters."""

    nodes: dict[str, NodeTally]
    done: dict[tuple[str, int], float]
    published: dict[int, float]
    stats: MessageStats
    jumps: int
    end: float


@dataclass
class NodeTally:
    seed_bytes_by_manifest: dict[bytes, int]
    peer_bytes_by_manifest: dict[bytes, int]
    error: str | None
    marks: list[tuple[str, int, float]]
    bytes_uploaded: int

    @classmethod
    def of(cls, node: SwarmNode) -> NodeTally:
        return cls(
            node.seed_bytes_by_manifest,
            node.peer_bytes_by_manifest,
            node.error,
            list(node.marks),
            node.metrics.bytes_uploaded,
        )

    def onto(self, node: SwarmNode) -> None:
        node.seed_bytes_by_manifest = self.seed_bytes_by_manifest
        node.peer_bytes_by_manifest = self.peer_bytes_by_manifest
        node.error = self.error
        node.marks = collections.deque(self.marks, maxlen=node.marks.maxlen)
        node.metrics.bytes_uploaded = self.bytes_uploaded


async def run_child(conn: Connection, part: _Partition, nodes: Sequence[SwarmNode], rows: Callable[[], int]) -> None:
    """A child's windows, its nodes started: run each to its end, report, until the parent says stop; then
    stop the nodes."""
    loop = part.loop
    inbox = _reader(conn)
    out = part.take_outbox()  # what starting the nodes sent
    conn.send((out.messages, out.flows, out.cancels, _next_timer(loop), rows()))
    while True:
        msg = inbox.get()
        if msg[0] == "stop":
            break
        _, end, events = msg
        for at, kind, payload in events:
            loop.call_at(at, part.handle, kind, payload)
        await asyncio.sleep(max(0.0, end - loop.time()))
        out = part.take_outbox()
        conn.send((out.messages, out.flows, out.cancels, _next_timer(loop), rows()))
    for node in nodes:
        await node.stop(leave=False)
        await node.transport.close()


def _reader(conn: Connection) -> queue.SimpleQueue[tuple[Any, ...]]:
    """The parent's messages, read by a thread as they come: the parent sends window j + 2 while this
    process may still be sending its report on window j + 1, and with both larger than a socket's
    buffer, two blocking sends would wait for each other forever."""
    inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                msg = conn.recv()
                inbox.put(msg)
                if msg[0] == "stop":
                    return
        except (EOFError, OSError):
            inbox.put(("stop",))  # the parent is gone

    threading.Thread(target=read, name="partition-inbox", daemon=True).start()
    return inbox


def use_partition(part: _Partition, nodes: Sequence[SwarmNode]) -> None:
    """Give ``nodes`` (this partition's) their partitioned transport."""
    for node in nodes:
        node.transport = _PartTransport(part, part.hosts[node.info.addr])


# ---------------------------------------------------------------- the parent


class Coordinator:
    """The parent's side: the flow model, and the events in transit between partitions."""

    def __init__(self, net: SimNet, conns: Sequence[Connection], start: float) -> None:
        self.network = net.network
        self.conns = conns
        self.step = lookahead(self.network)
        self.now = start
        self._messages: list[tuple[float, int, int, str, Any]] = []  # (at, seq, partition, kind, payload)
        self._cancels: list[tuple[float, int, int]] = []  # (at, seq, rid)
        self._seq = 0
        self._flows: dict[
            int, tuple[Flow, int, int, str, bytes | int]
        ] = {}  # rid -> (flow, server part, client part, kind, payload)
        self._dead: set[int] = set()  # rids cancelled before their flow was reported
        self._by_flow: dict[int, int] = {}  # flow id -> rid
        self.windows = 0

    def run(self, until: Callable[[int], bool], deadline: float) -> None:
        """Windows until ``until(rows done)`` or ``deadline`` (virtual seconds).

        Windows are half the lookahead, two in flight: a flow or message sent in window j takes
        effect from window j + 2 on, so window j + 2 is computed here (the flow model) while the
        children run window j + 1, and neither side waits for the other's work."""
        conns = self.conns
        half = self.step / 2
        nxt = [self.now] * len(conns)  # when each child next has work, as of its last report
        for i, conn in enumerate(conns):  # what the children did starting their nodes
            nxt[i] = self._take(conn.recv())[0]
        flight: collections.deque[tuple[float, bool]] = collections.deque()  # (end, any events) per window
        for _ in range(2):
            flight.append(self._launch(self.now, self.now + half))
        while flight:
            rows = 0
            for i, conn in enumerate(conns):
                nxt[i], done = self._take(conn.recv())
                rows += done
            flight.popleft()
            self.windows += 1
            if until(rows):
                break
            start = self.now
            if flight and not flight[0][1] and min(nxt) >= flight[0][0]:
                # The window in flight gives the children nothing to do, and they had nothing before its
                # end: nobody acts before the next event, so the windows up to it can be skipped.
                start = max(start, min(self._next_event(), *nxt))
            if start < deadline:
                flight.append(self._launch(start, start + half))
        while flight:  # collect the windows still in flight before the children stop
            for conn in conns:
                self._take(conn.recv())
            flight.popleft()

    def _launch(self, start: float, end: float) -> tuple[float, bool]:
        """Send the children window [start, end): the flow model's events in it, and the messages due."""
        inbound: list[list[tuple[float, str, Any]]] = [[] for _ in self.conns]
        self._advance(end, inbound)
        while self._messages and self._messages[0][0] < end:
            at, _, part, kind, payload = heapq.heappop(self._messages)
            inbound[part].append((at, kind, payload))
        for conn, events in zip(self.conns, inbound, strict=True):
            events.sort(key=lambda e: e[0])
            conn.send(("run", end, events))
        self.now = end
        return end, any(inbound)

    def _take(self, report: tuple[Any, ...]) -> tuple[float, int]:
        """A child's report on a window: its messages, flows and stops into the queues; (when it next
        has work, rows done)."""
        messages, flows, cancels, next_timer, done = report
        for at, part, kind, payload in messages:
            self._seq += 1
            heapq.heappush(self._messages, (at, self._seq, part, kind, payload))
        for sent, rid, src, dst, nbytes, server, client, kind, payload in flows:
            if rid in self._dead:
                self._dead.discard(rid)
                continue
            flow = self.network.add_flow(sent, src, dst, nbytes, tag=kind)
            self._flows[rid] = (flow, server, client, kind, payload)
            self._by_flow[flow.id] = rid
        for at, rid in cancels:
            self._seq += 1
            heapq.heappush(self._cancels, (at, self._seq, rid))
        return next_timer, done

    def _next_event(self) -> float:
        t = self.network.next_event_time()
        if self._messages:
            t = min(t, self._messages[0][0])
        if self._cancels:
            t = min(t, self._cancels[0][0])
        return max(t, self.now)

    def _advance(self, end: float, inbound: list[list[tuple[float, str, Any]]]) -> None:
        """The flow model through [now, end): finished flows become events, cancels are applied on time."""
        net = self.network
        while True:
            te = net.next_event_time()
            tc = self._cancels[0][0] if self._cancels else math.inf
            if min(te, tc) >= end:
                break
            if tc <= te:
                _, _, rid = heapq.heappop(self._cancels)
                self._finish(net.advance(tc), inbound)
                entry = self._flows.pop(rid, None)
                if entry is None:
                    self._dead.add(rid)
                else:
                    self._by_flow.pop(entry[0].id, None)
                    net.cancel(tc, entry[0])
            else:
                self._finish(net.advance(te), inbound)

    def _finish(self, flows: list[Flow], inbound: list[list[tuple[float, str, Any]]]) -> None:
        for flow in flows:
            rid = self._by_flow.pop(flow.id, None)
            if rid is None:
                continue
            _, server, client, kind, payload = self._flows.pop(rid)
            if server >= 0:
                inbound[server].append((flow.done_at, _SENT, rid))
            inbound[client].append((flow.done_at, kind, (rid, payload)))

    def stop(self) -> list[ChildResult]:
        for conn in self.conns:
            conn.send(("stop",))
        return [pickle.loads(conn.recv_bytes()) for conn in self.conns]


@dataclass
class Tally:
    """A partitioned run's outcome, merged from its children."""

    done: dict[tuple[str, int], float]
    published: dict[int, float]
    jumps: int
    end: float


async def run_partitioned(
    net: SimNet,
    nodes: dict[str, SwarmNode],
    owner: dict[str, int],
    start: Callable[[int], Awaitable[None]],
    done: Callable[[], dict[tuple[str, int], float]],
    published: Callable[[], dict[int, float]],
    rows_total: int,
    t0: float,
    deadline: float,
    progress: Callable[[float, int, int], None] | None = None,
) -> Tally:
    """Fork one child per partition (``owner``: host -> partition) and coordinate their windows until
    ``rows_total`` (host, version) rows are done or ``deadline``; the children's node counters are copied
    onto this process's ``nodes`` (host -> node), their message counters added to ``net.stats``.

    Called inside the run's coroutine, with the nodes built (not started): each child goes on from
    here on its copy of the loop, starts its nodes with ``start(index)`` and never returns."""
    loop = net.loop()
    count = max(owner.values()) + 1
    hosts = {node.info.addr: hid for hid, node in nodes.items()}
    conns: list[Connection] = []
    pids: list[int] = []
    for index in range(count):
        parent_end, child_end = Pipe()
        if SOCKET_BUFFER:
            for end in (parent_end, child_end):
                with socket.fromfd(end.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # (a dup of the fd)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.events._set_running_loop(loop)  # asyncio ties the running loop to the pid that set it
                for c in conns:
                    c.close()
                parent_end.close()
                await _child(index, child_end, net, nodes, owner, hosts, start, done, published, loop)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # not back into the parent's stack
        child_end.close()
        conns.append(parent_end)
        pids.append(pid)
    failed = 0
    try:
        coordinator = Coordinator(net, conns, t0)

        def until(rows: int) -> bool:
            if progress is not None:
                progress(coordinator.now - t0, rows, rows_total)
            return rows >= rows_total

        coordinator.run(until, deadline)
        results = coordinator.stop()
    except (EOFError, OSError) as e:  # a child died: its traceback is on stderr
        raise RuntimeError(f"a partition's process failed ({type(e).__name__}); see its traceback above") from None
    finally:
        for c in conns:
            c.close()  # (a child still waiting reads EOF and exits)
        for pid in pids:
            failed += os.waitpid(pid, 0)[1] != 0
    if failed:
        raise RuntimeError(f"{failed} partition process(es) failed; see the traceback above")
    tally = Tally({}, {}, 0, t0)
    stats = net.stats
    for r in results:
        for hid, node_tally in r.nodes.items():
            node_tally.onto(nodes[hid])
        tally.done.update(r.done)
        tally.published.update(r.published)
        tally.jumps += r.jumps
        tally.end = max(tally.end, r.end)
        stats.add(r.stats)
    return tally


async def _child(
    index: int,
    conn: Connection,
    net: SimNet,
    nodes: dict[str, SwarmNode],
    owner: dict[str, int],
    hosts: dict[str, str],
    start: Callable[[int], Awaitable[None]],
    done: Callable[[], dict[tuple[str, int], float]],
    published: Callable[[], dict[int, float]],
    loop: asyncio.AbstractEventLoop,
) -> None:
    mine = [node for hid, node in nodes.items() if owner[hid] == index]
    handlers = {node.info.addr: net.endpoints[node.info.addr].handlers for node in mine}
    part = _Partition(index, net.network, owner, hosts, handlers, loop)
    use_partition(part, mine)
    jumps0 = loop._core.jumps  # type: ignore[attr-defined]
    await start(index)

    def rows() -> int:
        return len(done())  # (a child's recorders and publisher note only its own hosts)

    await run_child(conn, part, mine, rows)
    result = ChildResult(
        {node.config.node_id: NodeTally.of(node) for node in mine},
        dict(done()),
        dict(published()),
        part.stats,
        loop._core.jumps - jumps0,  # type: ignore[attr-defined]
        loop.time(),
    )
    conn.send_bytes(pickle.dumps(result))

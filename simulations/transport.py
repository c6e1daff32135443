"""The swarm Transport over the flow-level network model, in virtual time.

``SimNet`` drives a ``simulations.network.Network`` from an asyncio loop (normally a
``VirtualTimeLoop``): one loop timer sits at the network's next event; ``transfer`` adds a
flow and waits for it.  ``SimTransport`` is one host's ``swarm.transport.Transport``:

* ``send`` (gossip): the datagram reaches the peer's handler one one-way latency later.  It
  uses no bandwidth unless ``SimNet(gossip_flows=True)``, which sends it as a flow.
* ``get_chunk`` / ``get_object``: the request takes one one-way latency; the peer's handler
  runs (in its own task, as an HTTP server's would, so a requester giving up does not cancel
  it); a bytes reply then travels back as a flow (latency, then max-min shared bandwidth),
  a Busy/Missing reply as a one-way message.  The whole exchange obeys ``timeout``.

``SimNet.crash(host)`` kills a host: its endpoints go and its flows stop with a TransportError
(used for churn).  Chunk replies carry the serving node's bytes; ``placeholder_bytes`` gives
shared, sized stand-ins for studies where payloads are not materialised (simulations/placeholder.py).

With ``Network(tcp=TcpModel(...))`` chunk requests go over keep-alive connections with a TCP
congestion window (simulations/tcp_window.py): a new connection first pays a handshake round trip,
and a reply moves in slow-start rounds while its window, not its share of the path, bounds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from patchswarm.simulations.network import Flow, Network
from patchswarm.simulations.tcp_window import Connection, Connections
from patchswarm.swarm.futures import drain, fail, settle
from patchswarm.swarm.transport import Busy, ChunkReply, Handlers, Missing, TransportError

T = TypeVar("T")

REQUEST_BYTES = 300  # an HTTP GET with its headers: used when gossip and requests go as flows


@dataclass(slots=True)
class Endpoint:
    addr: str
    host: str
    handlers: Handlers


@dataclass
class MessageStats:
    gossip_messages: int = 0
    gossip_bytes: int = 0
    chunk_requests: int = 0
    chunk_bytes: int = 0
    object_requests: int = 0
    object_bytes: int = 0
    failures: int = 0
    per_host_gossip_bytes: dict[str, int] = field(default_factory=dict)

    def count_gossip(self, host: str, nbytes: int) -> None:
        """A datagram of ``nbytes`` sent by ``host``."""
        self.gossip_messages += 1
        self.gossip_bytes += nbytes
        self.per_host_gossip_bytes[host] = self.per_host_gossip_bytes.get(host, 0) + nbytes


class SimNet:
    """The asyncio side of a Network: endpoints by address, flows as awaitables."""

    def __init__(self, network: Network, *, gossip_flows: bool = False) -> None:
        self.network = network
        self.gossip_flows = gossip_flows
        self.endpoints: dict[str, Endpoint] = {}
        self.stats = MessageStats()
        # keep-alive connections with their windows (None: no slow start, the plain flow model)
        self.connections = Connections(network.tcp) if network.tcp is not None else None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._waiters: dict[int, tuple[Flow, asyncio.Future[None]]] = {}
        # The loop of the run, taken on first use (a SimNet serves one run): asyncio.get_running_loop()
        # makes a getpid() system call each time (Python 3.11), several per simulated message.
        self._io_loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._io_loop
        if loop is None:
            loop = self._io_loop = asyncio.get_running_loop()
        return loop

    # ------------------------------------------------------------ endpoints

    def register(self, addr: str, host: str, handlers: Handlers) -> None:
        if addr in self.endpoints:
            raise ValueError(f"address {addr!r} is taken")
        self.network.latency(host, host)  # an unknown host fails here, not at the first request
        self.endpoints[addr] = Endpoint(addr, host, handlers)

    def unregister(self, addr: str) -> None:
        """The host at ``addr`` goes away: later requests to it fail (flows under way still finish)."""
        self.endpoints.pop(addr, None)

    def crash(self, host: str) -> None:
        """``host`` dies: its addresses stop answering and every flow to or from it stops now (the
        bytes moved so far count as sent); whoever waits on such a flow gets a TransportError."""
        for addr in [a for a, ep in self.endpoints.items() if ep.host == host]:
            del self.endpoints[addr]
        if self.connections is not None:
            self.connections.forget_host(host)
        now = self._net_now()
        self._advance(now)
        for fid, (flow, waiter) in list(self._waiters.items()):
            if flow.src == host or flow.dst == host:
                del self._waiters[fid]
                if flow.state in ("pending", "active"):
                    self.network.cancel(now, flow)
                if not waiter.done():
                    waiter.set_exception(TransportError(f"{host}: connection reset"))
        self._arm()

    def endpoint(self, addr: str) -> Endpoint:
        ep = self.endpoints.get(addr)
        if ep is None:
            raise TransportError(f"{addr}: connection refused")
        return ep

    # ------------------------------------------------------------ time and flows

    def now(self) -> float:
        return self.loop().time()

    async def message(self, src: str, dst: str) -> None:
        """A small message: one one-way latency, no bandwidth."""
        await asyncio.sleep(self.network.latency(src, dst))

    async def transfer(self, src: str, dst: str, nbytes: float, tag: object = None) -> Flow:
        """Move ``nbytes`` from host src to host dst through the network model; returns the finished flow."""
        flow, done = self.start_flow(src, dst, nbytes, tag)
        try:
            await done
        except asyncio.CancelledError:
            self.stop_flow(flow)
            raise
        return flow

    def start_flow(
        self,
        src: str,
        dst: str,
        nbytes: float,
        tag: object = None,
        *,
        latency: float | None = None,
        window: float | None = None,
    ) -> tuple[Flow, asyncio.Future[None]]:
        """``transfer`` without the coroutine: the flow, and a future done when it finishes (or failing
        with a TransportError if a host at either end crashes).  Whoever stops waiting calls ``stop_flow``.
        ``latency``, ``window``: as for ``Network.add_flow``."""
        now = self._net_now()
        self._advance(now)
        flow = self.network.add_flow(now, src, dst, nbytes, tag=tag, latency=latency, window=window)
        done: asyncio.Future[None] = self.loop().create_future()
        self._waiters[flow.id] = (flow, done)
        self._arm()
        return flow, done

    def stop_flow(self, flow: Flow) -> None:
        """Cancel ``flow`` if it has not finished (its bytes so far count as sent); idempotent."""
        self._waiters.pop(flow.id, None)
        if flow.state in ("pending", "active"):
            now = self._net_now()
            self._advance(now)
            self.network.cancel(now, flow)
            self._arm()

    def _net_now(self) -> float:
        """The loop's time, never behind the network's: asyncio runs a timer up to its clock resolution
        early, so the network, advanced to the timer's exact deadline, may be a nanosecond ahead."""
        return max(self.loop().time(), self.network.now)

    def _advance(self, t: float) -> None:
        for flow in self.network.advance(t):
            entry = self._waiters.pop(flow.id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(None)

    def _arm(self) -> None:
        t = self.network.next_event_time()
        if t == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = t
        if t < math.inf:
            self._timer = self.loop().call_at(t, self._fire)

    def _fire(self) -> None:
        t = self._timer_at
        self._timer = None
        self._timer_at = math.inf
        self._advance(t)
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def transport(self, host: str) -> SimTransport:
        return SimTransport(self, host)


class SimTransport:
    """``swarm.transport.Transport`` for the node on ``host``."""

    def __init__(self, net: SimNet, host: str) -> None:
        self.net = net
        self.host = host
        self.closed = False

    async def send(self, addr: str, data: bytes) -> None:
        net = self.net
        ep = net.endpoint(addr)
        net.stats.count_gossip(self.host, len(data))
        if net.gossip_flows:
            await net.transfer(self.host, ep.host, len(data), tag="gossip")
        else:
            await asyncio.sleep(net.network.latency(self.host, ep.host))  # net.message, inlined (hot path)
        ep = net.endpoint(addr)  # it may have gone meanwhile
        ep.handlers.gossip(data)

    def post(self, addr: str, data: bytes) -> None:
        # One timer per datagram, no task: gossip is half of a simulated swarm's messages.
        net = self.net
        ep = net.endpoints.get(addr)
        if self.closed or ep is None:
            return  # lost, as send's TransportError would have been
        if net.gossip_flows:  # the datagram as a flow: the general path (the task waits on the flow's future)
            asyncio.ensure_future(self._post_flow(addr, data))  # noqa: RUF006
            return
        net.stats.count_gossip(self.host, len(data))
        net.loop().call_later(net.network.latency(self.host, ep.host), self._deliver, addr, data)

    def _deliver(self, addr: str, data: bytes) -> None:
        ep = self.net.endpoints.get(addr)  # it may have gone meanwhile
        if ep is not None:
            ep.handlers.gossip(data)

    async def _post_flow(self, addr: str, data: bytes) -> None:
        with contextlib.suppress(TransportError):
            await self.send(addr, data)

    async def get_chunk(
        self, addr: str, chunk_hash: bytes, size: int, timeout: float, requester: str, held: int = -1
    ) -> ChunkReply:
        # The exchange of get_object, as timers and one future: the requester wakes once per request
        # (the hot path of large simulations).  The request reaches the server one latency later
        # (``_arrive``); its handler runs in its own task (``_answer``).
        net = self.net
        net.stats.chunk_requests += 1
        if self.closed:
            raise TransportError("transport closed")
        try:
            ep = net.endpoint(addr)
        except TransportError:
            net.stats.failures += 1
            raise
        loop = net.loop()
        reply: asyncio.Future[ChunkReply] = loop.create_future()
        out = _Delivery(net, ep.host, self.host, size)
        delay = net.network.latency(self.host, ep.host)
        conns = net.connections
        if conns is not None and delay > 0:
            out.conn = conn = conns.take(ep.host, self.host, loop.time(), 2.0 * delay)
            if conn.new:
                delay *= 3.0  # SYN, SYN-ACK, then the request: one round trip more
        arrival = loop.call_later(delay, self._arrive, addr, chunk_hash, requester, held, out, reply)
        deadline = loop.call_later(max(timeout, 0.0), _time_out, addr, reply)
        try:
            answer = await reply
        except asyncio.CancelledError:
            arrival.cancel()
            out.abandon()  # the requester gave up: its connection closes and the server's send ends
            raise
        except TransportError:
            arrival.cancel()
            out.abandon()
            net.stats.failures += 1
            raise
        finally:
            deadline.cancel()
        if out.conn is not None and conns is not None:
            conns.give_back(out.conn, loop.time())  # the exchange is over; the connection stays open
        return answer

    def _arrive(
        self, addr: str, chunk_hash: bytes, requester: str, held: int, out: _Delivery, reply: asyncio.Future[ChunkReply]
    ) -> None:
        ep = self.net.endpoints.get(addr)
        if ep is None:
            fail(reply, TransportError(f"{addr}: connection refused"))
            return
        out.src = ep.host
        refuse = ep.handlers.refuse
        if refuse is not None and (refusal := refuse(chunk_hash, requester, held)) is not None:
            self._refuse_back(ep, reply, refusal)  # no task for the handler: most requests of a large swarm end here
            return
        # No reference kept: while pending, the task waits on what the node or network holds (a line
        # turn, a timer, a flow's future), so it cannot be collected.
        handler = ep.handlers.chunk(chunk_hash, requester, held, out.send)
        self.net.loop().create_task(self._answer(addr, ep, handler, out, reply))

    async def _answer(
        self,
        addr: str,
        ep: Endpoint,
        handler: Awaitable[Busy | Missing | None],
        out: _Delivery,
        reply: asyncio.Future[ChunkReply],
    ) -> None:
        """The server's side: the handler, finishing even if the requester gives up (as an HTTP
        server's does), then the answer: the bytes (already moved as a flow by ``out``), or a
        refusal one latency later."""
        try:
            result = await handler
        except asyncio.CancelledError:
            if not reply.done():
                reply.cancel()
            raise
        except Exception as e:  # the requester sees what the handler raised
            fail(reply, e)
            return
        if out.behind is not None:
            await out.behind  # the reply's bytes, still moving after the handler (and its slot) let go
        if reply.done():
            return  # the requester gave up or timed out
        if self.net.endpoints.get(addr) is not ep:  # the server that handled it must still be there to answer
            reply.set_exception(TransportError(f"{addr}: connection reset"))
        elif isinstance(result, Busy | Missing):
            self._refuse_back(ep, reply, result)
        else:
            try:
                reply.set_result(out.received(addr))
            except TransportError as e:
                reply.set_exception(e)

    def _refuse_back(self, ep: Endpoint, reply: asyncio.Future[ChunkReply], refusal: Busy | Missing) -> None:
        """A refusal reaches the requester one one-way latency after the server gave it."""
        self.net.loop().call_later(self.net.network.latency(ep.host, self.host), settle, reply, refusal)

    async def get_object(
        self, addr: str, path: str, limit: int, timeout: float, requester: str = "", insist: bool = False
    ) -> bytes | Missing | None:
        net = self.net
        net.stats.object_requests += 1

        async def exchange() -> bytes | Missing | None:
            ep = await self._request(addr)
            data = await _serve(ep.handlers.object(path, requester, insist))
            self._still_there(addr, ep)
            if data is None or isinstance(data, Missing):
                await net.message(ep.host, self.host)
                return data
            if len(data) > limit:
                raise TransportError(f"{addr}: object of {len(data)} bytes, expected at most {limit}")
            await net.transfer(ep.host, self.host, len(data), tag="object")
            net.stats.object_bytes += len(data)
            return data

        return await self._bounded(addr, exchange, timeout)

    async def _request(self, addr: str) -> Endpoint:
        ep = self.net.endpoint(addr)
        await self.net.message(self.host, ep.host)
        return self.net.endpoint(addr)

    def _still_there(self, addr: str, ep: Endpoint) -> None:
        """The server that handled a request must still be the one at ``addr`` to answer it (not crashed)."""
        if self.net.endpoints.get(addr) is not ep:
            raise TransportError(f"{addr}: connection reset")

    async def _bounded(self, addr: str, work: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T:
        if self.closed:
            raise TransportError("transport closed")
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                return await work()
        except TimeoutError:
            self.net.stats.failures += 1
            raise TransportError(f"{addr}: timed out") from None
        except TransportError:
            self.net.stats.failures += 1
            raise

    async def close(self) -> None:
        self.closed = True


class _Delivery:
    """One chunk reply on its way from the serving host to the requester: the server's ``send``.

    The transfer runs inside the server's handler, so the handler's upload slot is held for it, as
    an HTTP server's is while it writes the body.  A requester that gives up cancels the flow, like
    a closed connection failing the server's next write."""

    __slots__ = ("behind", "conn", "data", "done", "dst", "flow", "gone", "net", "size", "src", "started")

    def __init__(self, net: SimNet, src: str, dst: str, size: int) -> None:
        self.net = net
        self.src = src
        self.dst = dst
        self.size = size
        self.data: bytes | None = None
        self.flow: Flow | None = None
        self.done: asyncio.Future[None] | None = None
        self.gone = False
        self.started = False
        self.conn: Connection | None = None  # the connection's window (None: no slow start)
        self.behind: asyncio.Task[None] | None = None  # the bytes still moving after the write returned

    async def send(self, data: bytes) -> None:
        if self.gone or self.started:
            return
        self.started = True
        if len(data) > self.size:
            self.data = data  # the requester stops reading past its limit: nothing more moves
            return
        conn = self.conn
        if conn is None:
            if await self._round(len(data), None, None):
                self.data = data
            return
        model = self.net.network.tcp
        if model is not None and len(data) <= model.send_buffer:
            # The socket takes the whole reply: the server's write returns now, its bytes still to move.
            self.behind = self.net.loop().create_task(self._rounds(conn, data))
            return
        await self._rounds(conn, data)

    async def _rounds(self, conn: Connection, data: bytes) -> None:
        """Move ``data`` over ``conn`` in slow-start rounds; ``self.data`` is set once it has arrived."""
        # Slow start (simulations/tcp_window.py): round k carries at most cwnd bytes in at least one
        # RTT; once a round took longer, the path's share bounds the connection, not its window, and
        # the rest goes as one flow.  The window grows by the bytes acknowledged, up to the network's.
        net = self.net.network
        rtt = 2.0 * net.latency(self.src, self.dst)
        most = net.window if net.window is not None else math.inf
        left, first, windowed = float(len(data)), True, conn.cwnd < most
        while left > 0:
            size = min(left, conn.cwnd) if windowed else left
            t0 = self.net.now()
            if not await self._round(size, None if first else 0.0, conn.cwnd if windowed else None):
                return
            took = self.net.now() - t0 - (rtt / 2.0 if first else 0.0)
            windowed = windowed and took <= rtt * 1.05 and conn.cwnd + size < most
            conn.cwnd = min(conn.cwnd + size, most)
            left -= size
            first = False
        self.data = data

    async def _round(self, size: float, latency: float | None, window: float | None) -> bool:
        """Move ``size`` bytes as one flow; False if it was stopped (a reset or a requester gone)."""
        # The flow's own future, awaited in the handler's task (no task per transfer: a chunk reply
        # is the hot path of large simulations).
        self.flow, self.done = flow, done = self.net.start_flow(
            self.src, self.dst, size, tag="chunk", latency=latency, window=window
        )
        try:
            await done
        except TransportError:
            return False  # a host died mid-transfer: a reset, as a socket write would see it
        except asyncio.CancelledError:
            self.net.stop_flow(flow)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the handler itself is being cancelled
            return False  # the requester gave up (``abandon``)
        return not self.gone

    def abandon(self) -> None:
        self.gone = True
        self.conn = None  # closed: never given back for reuse
        if self.flow is not None and self.done is not None:
            self.net.stop_flow(self.flow)  # the connection closes now
            self.done.cancel()

    def received(self, addr: str) -> bytes:
        data = self.data
        if data is None:
            raise TransportError(f"{addr}: connection reset")
        if len(data) > self.size:
            raise TransportError(f"{addr}: chunk of {len(data)} bytes, expected at most {self.size}")
        self.net.stats.chunk_bytes += len(data)
        return data


def _time_out(addr: str, reply: asyncio.Future[ChunkReply]) -> None:
    """The exchange's deadline (the error is built only when it fires: most requests end before)."""
    fail(reply, TransportError(f"{addr}: timed out"))


async def _serve(handler: Awaitable[T]) -> T:
    """Run a peer's handler as a server would: in its own task, finishing even if the requester gives up."""
    task = asyncio.ensure_future(handler)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(drain)
        raise


_PLACEHOLDERS: dict[int, bytes] = {}


def placeholder_bytes(size: int) -> bytes:
    """A shared all-zero ``bytes`` of ``size``: every holder of a same-sized chunk references one object."""
    data = _PLACEHOLDERS.get(size)
    if data is None:
        data = _PLACEHOLDERS[size] = bytes(size)
    return data

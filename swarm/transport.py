"""The two small interfaces a swarm node is driven through: a Transport and a Clock.

``swarm.http`` implements the transport over aiohttp on real sockets; ``simulations``
implements both over a virtual-time network model, so the same node code runs in either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Busy:
    """The peer refused for now (upload slots full, or a seed protecting its uplink).

    ``holders``: node ids the refusing peer recently gave this chunk to (a seed's hint of
    where to ask instead; unverified, so a wrong hint only costs a Missing reply).
    """

    retry_after: float
    holders: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Missing:
    """The peer does not hold what was asked for, or does not give it out now.

    ``holders``: where to ask instead (a seed withholding a chunk it handed out recently names who
    got it).  Unlike Busy, the peer stays free to ask for other chunks at once.
    """

    holders: tuple[str, ...] = ()


ChunkReply = bytes | Busy | Missing

SendChunk = Callable[[bytes], Awaitable[None]]
"""Sends a chunk's bytes to the requester; returns once they are on their way out (written to the
socket, or the simulated flow finished), or at once when the requester is gone (a real connection
closed by the requester: raises ConnectionError, the bytes not sent yet dropped).  A serving node
calls it while it holds an upload slot, so its slots bound the transfers under way, not only the
time to look the chunk up."""


class TransportError(Exception):
    """A request failed in transit (connection refused, reset, timed out)."""


class Transport(Protocol):
    async def send(self, addr: str, data: bytes) -> None:
        """Deliver one gossip datagram; raises TransportError when it cannot."""

    def post(self, addr: str, data: bytes) -> None:
        """Send one gossip datagram in the background and return at once; one that cannot be delivered
        is dropped (gossip tolerates loss: the next announcement or protocol period repeats it).  A node
        gossips several datagrams per chunk it receives, so this is its most frequent send; ``close``
        drops the ones still under way."""

    async def get_chunk(
        self, addr: str, chunk_hash: bytes, size: int, timeout: float, requester: str, held: int = -1
    ) -> ChunkReply:
        """Fetch a chunk by hash; never returns more than ``size`` bytes (longer replies fail).

        ``held``: how many chunks of this chunk's version the requester holds (-1: not said); a seed
        serves a requester near its end even a chunk it withholds."""

    async def get_object(
        self, addr: str, path: str, limit: int, timeout: float, requester: str = "", insist: bool = False
    ) -> bytes | Missing | None:
        """Fetch a board object (head, manifest, certificate, root document) a peer holds; None: not
        there.  A seed may withhold a manifest it gave enough requesters, naming their addresses
        (``Missing.holders``); ``insist``: the requester asked those, and the seed serves it."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Handlers:
    """What a node answers with: the server side of the transport calls these."""

    # (datagram): runs to completion at once (decoding, checks and bookkeeping: nothing to wait for)
    gossip: Callable[[bytes], None]
    # (chunk hash, requesting node id, chunks of that version it holds or -1, send): Busy or Missing,
    # or None once the bytes went through send
    chunk: Callable[[bytes, str, int, SendChunk], Awaitable[Busy | Missing | None]]
    # (path, requesting node id, insist): the bytes, None (not here) or Missing naming where to ask
    object: Callable[[str, str, bool], Awaitable[bytes | Missing | None]]
    # (chunk hash, requesting node id, chunks held): the refusal ``chunk`` would answer at once, or None.
    # Optional: a transport may ask it first and spare a refused request the task ``chunk`` runs in.
    refuse: Callable[[bytes, str, int], Busy | Missing | None] | None = None
    # ``chunk`` with the request's origin as a fifth argument (the address it came from: the node id is
    # unverified), for per-requester limits.  Optional: a transport that knows the origin calls this.
    chunk_from: Callable[[bytes, str, int, SendChunk, str], Awaitable[Busy | Missing | None]] | None = None


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds: timers, deadlines, rates."""

    def wall(self) -> float:
        """Unix seconds: expiry of signed documents (a simulated clock supplies its own epoch)."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

"""Over real HTTP on loopback: with ``upload_notsent_lowat`` a node's upload slot is held until the
chunk has left the process and the kernel's unsent queue (not only until an autotuned send buffer
took it), and a requester that closes its connection mid-chunk frees the slot at once, the bytes not
yet sent dropped (swarm/http.py ``_hold_until_sent``, swarm/uploads.py ``_send_within``)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket

import pytest
from aiohttp import web

from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.trust import TrustState
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.transport import SimNet
from patchswarm.swarm.http import NODE_HEADER, PREFIX, add_routes
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.serving import HardenedRunner
from patchswarm.swarm.transport import SystemClock
from tests.support.swarmkit import RUN, SECRET

HASH = b"\x01" * 32
SIZE = 1 << 20  # one chunk: loopback's send buffer takes it whole when nothing bounds the unsent bytes


async def _until(cond: object, what: str) -> None:
    for _ in range(3000):  # a bound, not a timing: 30 s
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _serve(lowat: int | None = None) -> tuple[SwarmNode, HardenedRunner, int, SimNet]:
    """A node serving one chunk over real HTTP; ``lowat`` None: the node's default."""
    cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_queue=0)
    if lowat is not None:
        cfg = dataclasses.replace(cfg, upload_notsent_lowat=lowat)
    lowat = cfg.upload_notsent_lowat
    net = SimNet(Network([Host("a", "r")], [Region("r", 0.001)]))  # (gossip only: unused here)
    node = SwarmNode(cfg, "http://a", net.transport("a"), SystemClock(), TrustState(b"k" * 32), random.Random(0))
    node.chunks.put(HASH, b"x" * SIZE)
    app = web.Application()
    add_routes(app, node.handlers(), notsent_lowat=lowat)
    runner = HardenedRunner(app)  # as a node serves: a handler whose client left is cancelled
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return node, runner, port, net


def _ask(port: int) -> socket.socket:
    """A requester that asks for the chunk and reads nothing yet (a small receive buffer: a slow link)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {PREFIX}/chunks/{HASH.hex()} HTTP/1.1\r\nHost: x\r\n{NODE_HEADER}: b\r\n\r\n".encode())
    return s


@pytest.mark.asyncio
async def test_the_slot_is_held_until_the_chunk_has_left() -> None:
    """(Without the option, on this machine's loopback the kernel takes the whole 1 MiB at once and
    the slot is free while the requester has read nothing; not asserted: it depends on the kernel's
    buffer sizes.)  The node's default does it."""
    node, runner, port, net = await _serve()
    s = _ask(port)
    try:
        await _until(lambda: node.metrics.chunks_uploaded == 1, "the upload began")
        await asyncio.sleep(0.3)  # (a write the kernel took whole would have returned by now)
        assert node.upload_slots.in_use == 1  # nothing read: the chunk has not left, and the slot says so
        # The requester reads it all: the slot is free and nothing counts as abandoned.
        got = bytearray()
        loop = asyncio.get_running_loop()
        s.setblocking(False)
        while not got.endswith(b"x" * 64) or len(got) < SIZE:
            got += await loop.sock_recv(s, 1 << 16)
        assert got.count(b"x") == SIZE
        await _until(lambda: node.upload_slots.in_use == 0, "the slot was freed")
        assert node.metrics.uploads_abandoned == 0
    finally:
        s.close()
        await runner.cleanup()
        net.close()


@pytest.mark.asyncio
async def test_a_requester_that_closes_mid_chunk_frees_the_slot_and_stops_the_bytes() -> None:
    node, runner, port, net = await _serve(16384)
    s = _ask(port)
    try:
        await _until(lambda: node.metrics.chunks_uploaded == 1, "the upload began")
        await asyncio.sleep(0.3)
        assert node.upload_slots.in_use == 1
        s.close()  # gives up (its deadline), unread bytes in its buffer: a reset
        await _until(lambda: node.upload_slots.in_use == 0, "the slot was freed")
        assert node.metrics.uploads_abandoned == 1
        assert node.metrics.bytes_abandoned == SIZE
        assert node.metrics.upload_stalls == 0  # giving up is not a stall: the requester does not rest
        # The next requester gets the chunk whole.
        s2 = _ask(port)
        s2.setblocking(False)
        got = bytearray()
        loop = asyncio.get_running_loop()
        while got.count(b"x") < SIZE:
            piece = await loop.sock_recv(s2, 1 << 16)
            assert piece
            got += piece
        s2.close()
    finally:
        s.close()
        await runner.cleanup()
        net.close()

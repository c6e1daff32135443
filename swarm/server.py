"""Running a swarm node on real sockets: an aiohttp server for its endpoints plus HttpTransport."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.swarm.board_files import BoardFiles
from patchswarm.swarm.board_http import board_app
from patchswarm.swarm.http import HttpTransport, add_routes
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.serving import HardenedRunner, ServerLimits, serve_tcp
from patchswarm.swarm.staging import ApplyVersion, StagedApply
from patchswarm.swarm.stores import BoardChunkStore, ChunkStore
from patchswarm.swarm.tls import TlsReloader, require_https
from patchswarm.swarm.transport import Busy, Handlers, Missing, SendChunk, SystemClock


@dataclass
class RunningNode:
    node: SwarmNode
    runner: HardenedRunner
    transport: HttpTransport
    url: str

    async def stop(self, *, leave: bool = True) -> None:
        await self.node.stop(leave=leave)
        await self.node.source.close()
        await self.transport.close()
        await self.runner.cleanup()


async def start_http_node(
    config: NodeConfig,
    policy: KeyPolicy,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise: str | None = None,
    board: BoardFiles | None = None,
    held: Held | None = None,
    rng: random.Random | None = None,
    on_version: Callable[[Held], Awaitable[None] | None] | None = None,
    apply: ApplyVersion | None = None,  # default: swarm.staging.StagedApply (one per node)
    limits: ServerLimits | None = None,  # default: ServerLimits.from_env()
    tls: TlsReloader | None = None,  # mutual TLS for the endpoints and every request (swarm/tls.py)
    chunks: ChunkStore | None = None,  # default: the board's (a seed), else a MemoryChunkStore
) -> RunningNode:
    """Bind, then build the node with its real address, then start it.  A seed also serves its board."""
    box: list[SwarmNode] = []

    def gossip(data: bytes) -> None:
        box[0].handle_gossip(data)

    async def chunk(h: bytes, requester: str, held: int, send: SendChunk, origin: str = "") -> Busy | Missing | None:
        return await box[0].handle_chunk(h, requester, held, send, origin)

    async def obj(path: str, requester: str, insist: bool) -> bytes | Missing | None:
        return await box[0].handle_object(path, requester, insist, off_loop=True)

    app = board_app(board.root) if board is not None else web.Application()
    # chunk_from: per-requester upload limits
    add_routes(app, Handlers(gossip, chunk, obj, chunk_from=chunk), notsent_lowat=config.upload_notsent_lowat)
    if tls is not None:  # (TlsError) nothing reached, nor reaching us, over plain HTTP: checked before binding
        from patchswarm.swarm.board_store import is_store_url

        # (A store URL is read through its SDK over the provider's HTTPS, not the cluster's TLS.)
        seeds = [url for url in config.seed_urls if not is_store_url(url)]
        for url in [*([advertise] if advertise else []), *config.bootstrap, *seeds]:
            require_https(url, "advertised URL" if url == advertise else "bootstrap or seed URL")
    runner, bound = await serve_tcp(app, host, port, limits, tls.server_context() if tls is not None else None)
    scheme = "https" if tls is not None else "http"
    url = advertise or f"{scheme}://{f'[{host}]' if ':' in host else host}:{bound}"  # IPv6 literals in brackets
    transport = HttpTransport(tls=tls)
    node = SwarmNode(
        config,
        url,
        transport,
        SystemClock(),
        policy,
        rng or random.Random(),
        chunks=BoardChunkStore(board) if board is not None else chunks,
        board=board,
        held=held,
        on_version=on_version,
        apply=apply if apply is not None else StagedApply(),
    )
    box.append(node)
    await node.start()
    return RunningNode(node, runner, transport, url)

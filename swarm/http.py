"""The swarm transport over HTTP (aiohttp): peers' endpoints and a pooled client.

POST /swarm/v1/gossip            one authenticated gossip datagram (msgpack), answered 204
GET  /swarm/v1/chunks/<hash>     a chunk by its BLAKE3 hash; 503 + Retry-After when busy; 404 if absent
GET  /swarm/v1/board/<path>      a board object the node holds (head, manifest, certificate, root); 404 if
                                 absent, or with X-Patchswarm-Holders when a seed withholds a manifest.
                                 Never a chunk: chunks go out only through /chunks, under the upload slots,
                                 the per-requester share and the rate limit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import aiohttp
from aiohttp import web

from patchswarm.protocol.board_names import TOP_LEVEL
from patchswarm.protocol.errors import LimitExceededError
from patchswarm.swarm.client_errors import describe
from patchswarm.swarm.serving import address_key, is_loopback, read_body
from patchswarm.swarm.tls import TlsError, TlsReloader, require_https
from patchswarm.swarm.transport import Busy, ChunkReply, Handlers, Missing, TransportError

log = logging.getLogger(__name__)

MAX_GOSSIP_BYTES = 1 << 20
PREFIX = "/swarm/v1"
NODE_HEADER = "X-Patchswarm-Node"
HOLDERS_HEADER = "X-Patchswarm-Holders"
HELD_HEADER = "X-Patchswarm-Held"  # chunks of the version the requester holds (a seed serves one near its end)
INSIST_HEADER = "X-Patchswarm-Insist"  # "1": the holders a seed named for this object did not have it
MAX_HOLDERS = 16
BOARD_READS = 4  # board objects read at once (a manifest is up to 64 MiB: bounded, off the event loop)
PIECE = 1 << 16  # a board object goes out this much at a time, each once the socket has taken the last


def add_routes(app: web.Application, handlers: Handlers, *, notsent_lowat: int = 0) -> None:
    """The peer endpoints; ``notsent_lowat`` > 0: a chunk reply's socket holds at most that many unsent
    bytes (``NodeConfig.upload_notsent_lowat``, see ``_hold_until_sent``)."""

    async def gossip(request: web.Request) -> web.Response:
        handlers.gossip(await read_body(request, MAX_GOSSIP_BYTES))
        return web.Response(status=204)

    async def chunk(request: web.Request) -> web.StreamResponse:
        try:
            chunk_hash = bytes.fromhex(request.match_info["hash"])
        except ValueError:
            raise web.HTTPBadRequest(text="chunk hash must be hex\n") from None
        resp: web.StreamResponse | None = None

        async def send(data: bytes) -> None:
            # Headers go out on their own, then the chunk as it is: a plain Response joins headers and body
            # into a new buffer, a copy (and fresh pages) for every chunk served.  The write returns once
            # the socket has taken nearly all of it, so the node's upload slot covers the transfer.
            nonlocal resp
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = len(data)
            if notsent_lowat:
                _hold_until_sent(request, notsent_lowat)
            try:
                await resp.prepare(request)
                await resp.write(data)
            except ConnectionError:
                # The requester gave up (an endgame duplicate that lost, a deadline) and closed the
                # connection (aiohttp: ConnectionResetError, or a bare ConnectionError("Connection lost")
                # from a drain under way): drop what is not sent yet, and tell the node (its slot).
                if request.transport is not None:
                    request.transport.abort()
                raise
            except asyncio.CancelledError:
                # Cut mid-reply (the node's deadline for the transfer: the requester stopped reading; or a
                # shutdown): the connection can carry nothing more, and its buffers hold up to a chunk.
                if request.transport is not None:
                    request.transport.abort()
                raise

        if handlers.chunk_from is not None:
            reply = await handlers.chunk_from(chunk_hash, _requester(request), _held(request), send, _origin(request))
        else:
            reply = await handlers.chunk(chunk_hash, _requester(request), _held(request), send)
        if isinstance(reply, Busy):
            headers = {"Retry-After": f"{reply.retry_after:.3f}"}
            if reply.holders:
                headers[HOLDERS_HEADER] = ",".join(reply.holders)
            return web.Response(status=503, headers=headers)
        if isinstance(reply, Missing):
            raise web.HTTPNotFound(headers={HOLDERS_HEADER: ",".join(reply.holders)} if reply.holders else None)
        if resp is None:
            raise web.HTTPInternalServerError(text="chunk handler sent nothing\n")
        return resp

    reads = asyncio.Semaphore(BOARD_READS)
    sending: dict[str, _Sending] = {}  # the objects being sent now, by path

    async def board_object(request: web.Request) -> web.StreamResponse:
        insist = request.headers.get(INSIST_HEADER) == "1"
        path = request.match_info["path"]  # (percent-decoded: %2F is a "/" here, %2E%2E a "..")
        if not _board_path(path):
            raise web.HTTPNotFound()
        try:
            async with reads:
                data = await handlers.object(path, _requester(request), insist)
        except (IsADirectoryError, NotADirectoryError, PermissionError):
            raise web.HTTPNotFound() from None  # a folder, or nothing a peer may have
        except OSError as e:  # out of descriptors, a disk error: the peer may come back
            log.warning("board object %s: %s", path[:100], e.strerror or type(e).__name__)
            raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}) from None
        if isinstance(data, Missing):
            raise web.HTTPNotFound(headers={HOLDERS_HEADER: ",".join(data.holders)} if data.holders else None)
        if data is None:
            raise web.HTTPNotFound()
        # Every reply of the same bytes sends the one copy (a cold start asks for one manifest from every
        # host at once), a piece at a time: a client that reads nothing holds a socket buffer, no copy.
        shared = sending.get(path)
        if shared is None or shared.data != data:
            shared = sending[path] = _Sending(data)
        shared.replies += 1
        del data
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = len(shared.data)
            await resp.prepare(request)
            view = memoryview(shared.data) if request.method != "HEAD" else memoryview(b"")
            for at in range(0, len(view), PIECE):
                await resp.write(view[at : at + PIECE])
            await resp.write_eof()
            return resp
        finally:
            shared.replies -= 1
            if shared.replies == 0 and sending.get(path) is shared:
                del sending[path]

    app.router.add_post(f"{PREFIX}/gossip", gossip)
    # No HEAD: the chunk handler writes its body whatever the method (a HEAD got a whole chunk after its
    # headers, which a keep-alive client reads as the next response), and nothing asks for headers only.
    app.router.add_get(PREFIX + "/chunks/{hash:[0-9a-fA-F]+}", chunk, allow_head=False)
    app.router.add_get(PREFIX + "/board/{path:.+}", board_object)


def _hold_until_sent(request: web.Request, lowat: int) -> None:
    """Let the kernel hold at most ``lowat`` unsent bytes of this connection (TCP_NOTSENT_LOWAT): the
    socket reads as writable, and takes more, only below it, so the rest of a chunk waits in the event
    loop's buffer and ``drain`` returns when it has left.  Without it an autotuned send buffer takes a
    whole 1 MiB chunk at once: the slot is free while the bytes still queue behind other uploads on the
    uplink, and a requester that gives up leaves them to go out anyway (on the real-latency testbed
    the seed counted 4.3 copies sent for 1.1 received: docs/bandwidth-study.md section 7).  Set on
    every chunk reply (a connection is reused); a socket that is not TCP (a test's unix socket) is left."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, lowat)
    except OSError:
        pass  # (a kernel without it: the send buffer's behaviour, as before)


class _Sending:
    __slots__ = ("data", "replies")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.replies = 0


class HttpTransport:
    def __init__(
        self, *, connections_per_host: int = 8, connect_timeout: float = 3.0, tls: TlsReloader | None = None
    ) -> None:
        self._per_host = connections_per_host
        self._connect_timeout = connect_timeout
        # With TLS every request presents this host's certificate and checks the peer's (swarm/tls.py),
        # and a plain http:// peer is refused, never used.
        self.tls = tls
        self._refused: set[str] = set()  # plain http:// peers refused (logged once each)
        self._session: aiohttp.ClientSession | None = None
        self._posts: set[asyncio.Task[None]] = set()  # gossip under way (post): close cancels it
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=self._per_host)
            )
        return self._session

    def _ssl(self, addr: str) -> ssl.SSLContext | bool:
        """The ``ssl`` argument of a request to ``addr``: the newest client context with TLS (a new one
        after a rotation opens new connections: aiohttp pools by context), else aiohttp's default."""
        if self.tls is None:
            return True
        try:
            require_https(addr, "peer")
        except TlsError as e:
            if addr not in self._refused and len(self._refused) < MAX_HOLDERS * 64:
                self._refused.add(addr)  # one line per address (a plain peer in a TLS cluster: misconfigured)
                log.warning("%s", e)
            raise TransportError(str(e)) from None
        return self.tls.client_context()

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=max(total, 0.05), sock_connect=self._connect_timeout)

    async def send(self, addr: str, data: bytes) -> None:
        try:
            async with self._client().post(
                f"{addr}{PREFIX}/gossip", data=data, timeout=self._timeout(5.0), ssl=self._ssl(addr)
            ) as r:
                if r.status >= 400:
                    raise TransportError(f"gossip to {addr}: HTTP {r.status}")
        except (TimeoutError, aiohttp.ClientError) as e:
            raise TransportError(f"gossip to {addr}: {describe(e)}") from None

    def post(self, addr: str, data: bytes) -> None:
        if self._closed:
            return  # (a post now would open a session nobody closes)
        task = asyncio.get_running_loop().create_task(self._post(addr, data))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _post(self, addr: str, data: bytes) -> None:
        try:
            await self.send(addr, data)
        except TransportError as e:
            log.debug("%s", e)  # lost, as gossip may be

    async def get_chunk(
        self, addr: str, chunk_hash: bytes, size: int, timeout: float, requester: str, held: int = -1
    ) -> ChunkReply:
        url = f"{addr}{PREFIX}/chunks/{chunk_hash.hex()}"
        headers = {NODE_HEADER: requester}
        if held >= 0:
            headers[HELD_HEADER] = str(held)
        try:
            async with self._client().get(
                url, timeout=self._timeout(timeout), headers=headers, ssl=self._ssl(addr)
            ) as r:
                if r.status in (503, 404):
                    holders = _holders(r)
                    if r.status == 404:
                        return Missing(holders)
                    retry = min(max(float(r.headers.get("Retry-After", "1")), 0.0), 60.0)
                    return Busy(retry, holders)
                if r.status != 200:
                    raise TransportError(f"GET {url}: HTTP {r.status}")
                return await read_chunk(r, size)
        except (TimeoutError, aiohttp.ClientError, ValueError, LimitExceededError) as e:
            raise TransportError(f"GET {url}: {describe(e)}") from None

    async def get_object(
        self, addr: str, path: str, limit: int, timeout: float, requester: str = "", insist: bool = False
    ) -> bytes | Missing | None:
        url = f"{addr}{PREFIX}/board/{path}"
        headers = {NODE_HEADER: requester} if requester else {}
        if insist:
            headers[INSIST_HEADER] = "1"
        try:
            async with self._client().get(
                url, timeout=self._timeout(timeout), headers=headers, ssl=self._ssl(addr)
            ) as r:
                if r.status == 404:
                    holders = _holders(r)
                    return Missing(holders) if holders else None
                if r.status != 200:
                    raise TransportError(f"GET {url}: HTTP {r.status}")
                return await read_bounded(r, limit, url)
        except (TimeoutError, aiohttp.ClientError, LimitExceededError) as e:
            raise TransportError(f"GET {url}: {describe(e)}") from None

    async def close(self) -> None:
        self._closed = True
        posts, self._posts = self._posts, set()
        for task in posts:
            task.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None


def _holders(r: aiohttp.ClientResponse) -> tuple[str, ...]:
    """The holders a refusal names (node ids for a chunk, addresses for an object), at most MAX_HOLDERS."""
    return tuple(h for h in r.headers.get(HOLDERS_HEADER, "").split(",") if h)[:MAX_HOLDERS]


async def _read_at_most(r: aiohttp.ClientResponse, n: int) -> bytes:
    """The body's first ``n`` bytes at most; of whatever the peer sends past them, at most the one piece
    the socket delivered with byte ``n`` is ever buffered."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        piece = await r.content.readany()  # what the socket delivered, as it came: no re-chunking
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    data = b"".join(parts)  # the one copy
    return data[:n] if got > n else data


async def read_chunk(r: aiohttp.ClientResponse, size: int) -> bytes:
    """A chunk reply, cut at ``size + 1`` bytes whatever the peer sends (an endless stream, a body that
    inflates without end): the caller's size check then refuses it like any wrong-size chunk and bans
    the peer, where a transport error would only rest it."""
    return await _read_at_most(r, size + 1)


async def read_bounded(r: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """Read at most ``limit`` bytes: a server sending more is cut off, never buffered."""
    if r.content_length is not None and r.content_length > limit:
        raise LimitExceededError(f"{what}: {r.content_length} bytes, more than the {limit} expected")
    data = await _read_at_most(r, limit + 1)
    if len(data) > limit:
        raise LimitExceededError(f"{what}: response runs past the {limit} bytes expected")
    return data


# No "chunks": a chunk read whole per request, past the upload slots and the rate limit, let clients that
# never read a reply hold a chunk each in memory (/swarm/v1/chunks serves them; the plain board server's
# /chunks/<hash> sends the file with sendfile).
BOARD_FOLDERS = TOP_LEVEL - {"chunks"}


def _board_path(path: str) -> bool:
    """Whether ``path`` (decoded) can name a board object: a top-level board folder, then names that
    are not empty, hidden, "." or "..", with no NUL or backslash, each short enough for a file name.
    (The board's own reader confines what it opens; this turns the rest away before any lookup.)"""
    parts = path.split("/")
    return (
        len(path) <= 1024
        and len(parts) >= 2
        and parts[0] in BOARD_FOLDERS
        and all(p and not p.startswith(".") and len(p.encode()) <= 255 for p in parts)
        and "\x00" not in path
        and "\\" not in path
    )


def _requester(request: web.Request) -> str:
    """The requester's X-Patchswarm-Node (unverified: a name to count and to name to others), capped."""
    return request.headers.get(NODE_HEADER, "")[:256]


def _origin(request: web.Request) -> str:
    """Who a request counts against for per-requester upload limits: the address it came from (the node
    id it sends is unverified, and costs nothing to change).  Loopback peers are this machine's own
    processes (a test swarm, or a proxy in front of the port), told apart by the node id they send.
    An IPv6 requester counts by its /64 (:func:`swarm.serving.address_key`): one host, one share."""
    key = address_key(request.remote or "")  # (not an IP address, a unix socket: counted as one)
    return f"{key} {_requester(request)}" if is_loopback(key) else key


def _held(request: web.Request) -> int:
    """The requester's X-Patchswarm-Held, or -1 when absent or not a plain count."""
    value = request.headers.get(HELD_HEADER, "")
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        return -1
    return int(value)

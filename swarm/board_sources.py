"""Where a host reads a board from: a local directory, any static HTTP server (the object store's
HTTPS endpoint, a CDN) or an object store through its SDK (swarm/board_store.py).

Every read is bounded: a source never returns more than ``limit`` bytes (an endless or
oversized response is cut off with LimitExceededError), and a missing file is ``None``.  Over
HTTP a 403 is missing too: S3 answers 403 instead of 404 for a missing key when the reader may
not list the bucket (a public board without public listing, the usual setting).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import aiohttp

from patchswarm.protocol.errors import LimitExceededError
from patchswarm.protocol.files import FileTooLargeError
from patchswarm.swarm.board_files import BoardFiles
from patchswarm.swarm.client_errors import SourceError, describe, shown_url
from patchswarm.swarm.http import read_bounded
from patchswarm.swarm.tls import TlsReloader, require_https

DEFAULT_TIMEOUT_S = 30.0


class BoardSource(Protocol):
    async def get(self, rel: str, limit: int) -> bytes | None: ...

    async def close(self) -> None: ...


class DirSource:
    """A board in a local directory, read with the board's path rules (swarm/board_files.py): a name
    outside its layout, a symlink out of it, a FIFO or a device is a missing file, never a wait."""

    def __init__(self, root: str | Path) -> None:
        self.files = BoardFiles(root)

    @property
    def root(self) -> Path:
        return self.files.root

    async def get(self, rel: str, limit: int) -> bytes | None:
        try:
            return self.files.read(rel, limit)
        except FileTooLargeError:
            raise LimitExceededError(f"{rel}: larger than the {limit} bytes expected") from None

    async def close(self) -> None:
        return None


class HttpSource:
    """Plain HTTP GETs against a board URL (nginx, object store, CDN or ``patchswarm seed``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connections: int = 16,
        tls: TlsReloader | None = None,
    ) -> None:
        if tls is not None:
            require_https(base_url, "board URL")  # TlsError: with TLS, never a plain seed
        self.base_url = base_url.rstrip("/") + "/"
        self._shown = shown_url(self.base_url)  # what error lines say (never the URL's credentials)
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._connections = connections

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._connections)
            )
        return self._session

    async def get(self, rel: str, limit: int) -> bytes | None:
        url = self.base_url + rel
        try:
            async with self._client().get(
                url,
                headers={"Cache-Control": "no-cache"} if rel.endswith("head") else None,
                ssl=self._tls.client_context() if self._tls is not None else True,
            ) as r:
                if r.status in (403, 404):
                    return None
                if r.status != 200:
                    raise SourceError(f"GET {self._shown}{rel}: HTTP {r.status}")
                return await read_bounded(r, limit, rel)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise SourceError(f"GET {self._shown}{rel}: {describe(e)}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def source_for(location: str, *, tls: TlsReloader | None = None) -> BoardSource:
    """The source for a board location: an http(s) URL, a store URL (``s3://``, ``gs://``, ``az://``),
    a ``file://`` URL or a directory; ``tls``: mutual TLS for an https URL.  ValueError for a
    malformed store URL; StoreError when the store cannot be configured from the environment (no
    credentials)."""
    from patchswarm.swarm.board_store import StoreSource, local_path, parse_store_url

    if location.startswith(("http://", "https://")):
        return HttpSource(location, tls=tls)
    store = parse_store_url(location)
    if store is not None:
        return StoreSource(store)
    return DirSource(local_path(location) or location)

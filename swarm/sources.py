"""Board objects (heads, manifests, certificates, root documents) fetched from the swarm.

A node asks, in order: what it already holds, the peer that announced the object, peers
likely to hold it, then the boards (``seed_urls``: http(s), or an object store's s3:// gs:// az://
URL).  Root documents are asked of the boards and then a seed first: the usual question is
whether root N+1 exists, and only a board can say it does not (a peer's "not here" settles
nothing, so asking peers first cost every head a round trip per peer).
Manifests are named by the hash of their body, so a peer's wrong answer is discarded here and
the next source is tried; everything else is verified by the caller (signatures).  What is fetched
here is never served: the node re-serves only the bytes that verified (a manifest as the puller
returns it, ``take_trusted`` for what the trust state accepted), so a retried or raced fetch can
never put other bytes (an empty or stale answer) in their place.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

import blake3

from patchswarm.protocol.board_names import (
    MANIFEST_TAG,
    ROOT_TAG,
    CertName,
    HeadName,
    ManifestName,
    RootName,
    chunk_rel,
    parse_rel,
)
from patchswarm.protocol.chunks import ChunkRef
from patchswarm.protocol.errors import LimitExceededError, PatchswarmError
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import TrustState
from patchswarm.protocol.wire import Announcement
from patchswarm.swarm.board_sources import BoardSource, source_for
from patchswarm.swarm.client_errors import SourceError
from patchswarm.swarm.transport import Missing, Transport, TransportError

log = logging.getLogger(__name__)


class PeerLike(Protocol):
    """What a source reads of a peer the node knows: its address and its announcement."""

    @property
    def info(self) -> NodeInfo: ...

    @property
    def ann(self) -> Announcement: ...


class SourceNode(Protocol):
    """What a source needs of its node (swarm/node.py ``SwarmNode``): who it is, how it reaches
    peers, whom it knows, what it holds, its trust and its random draws."""

    @property
    def info(self) -> NodeInfo: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def policy(self) -> KeyPolicy: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def objects(self) -> Mapping[str, bytes]: ...

    @property
    def peers(self) -> Mapping[str, PeerLike]: ...


PEER_TRIES = 3
NAMED_TRIES = 4  # holders a seed names for a manifest it withholds, asked before insisting
OBJECT_TIMEOUT = 5.0
UNCLAIMED = 64  # fetched objects never verified (a peer's junk) kept at most: the oldest go


class _Unreachable(enum.Enum):
    """A source that did not answer (unlike one that answered "not here")."""

    UNREACHABLE = enum.auto()


_UNREACHABLE = _Unreachable.UNREACHABLE


def _accepted(trust: TrustState, name: CertName | RootName, data: bytes) -> bool:
    """Whether ``data`` is the document ``trust`` accepted under ``name``."""
    try:
        if isinstance(name, CertName):
            cert, signer = trust.read_certificate(data)
            return (cert, signer) in trust.certificates.get(cert.key, [])
        return Envelope.from_bytes(data, ROOT_TAG).body == trust.root_bodies.get(name.version)
    except PatchswarmError:
        return False


class SwarmSource:
    def __init__(self, node: SourceNode, seed_urls: Sequence[str]) -> None:
        self.node = node
        self.fetched: dict[str, bytes] = {}  # fetched, not yet verified and taken by the node
        self.refused = 0  # answers that were not the object asked for (a lying peer or mirror)
        # Who served the last head: it verified it, so holds its certificate, and fetched the manifest
        # it names while we fetched the head (so the seed is not every host's manifest source at once).
        self._head_from: str | None = None
        tls = getattr(node.transport, "tls", None)  # (HttpTransport's: seeds are reached as peers are)
        self._boards = [source_for(url, tls=tls) for url in seed_urls]
        self._board_errors: dict[int, str] = {}  # the last failure of each board, logged once

    def forget(self, rel: str) -> None:
        """Drop the fetched copy of an object the caller verified (and now holds itself)."""
        self.fetched.pop(rel, None)

    def take_trusted(self, trust: TrustState) -> dict[str, bytes]:
        """The certificates and root documents fetched that ``trust`` has since accepted, to re-serve.

        Only the very document accepted counts: a certificate the trust state holds for its key, a
        root document whose body is the one trusted at its version.  Anything else fetched under the
        same name (another answer to a concurrent fetch) is dropped once its name is settled."""
        out: dict[str, bytes] = {}
        for rel in list(self.fetched):
            name = parse_rel(rel)
            if isinstance(name, CertName):
                settled = name.key_id in trust.certificates
            elif isinstance(name, RootName):
                settled = name.version <= trust.root_version
            else:
                continue
            if not settled:
                continue
            data = self.fetched.pop(rel)
            if _accepted(trust, name, data):
                out[rel] = data
        return out

    def _candidates(self, rel: str, prefer: str | None) -> list[str]:
        """``prefer`` (for a certificate or a manifest: who served the last head), then random peers
        (holders of a manifest first), then one seed.

        O(peers) filtering and O(PEER_TRIES) random draws per object, not a sort of every peer view."""
        node = self.node
        name = parse_rel(rel)
        if prefer is None and isinstance(name, (CertName, ManifestName)):
            prefer = self._head_from
        addrs: list[str] = [prefer] if prefer else []
        views = list(node.peers.values())
        if isinstance(name, ManifestName):
            mid = name.manifest_id
            holders = [v for v in views if mid in v.ann.complete or any(m == mid for m, _ in v.ann.partial)]
            views = holders or views
        others = [v.info.addr for v in views if v.info.addr not in addrs]
        want = max(0, PEER_TRIES - len(addrs))
        picked = node.rng.sample(others, min(want, len(others)))
        seeds = sorted(v.info.addr for v in views if v.ann.seed and v.info.addr not in addrs)
        return addrs + picked + seeds[:1]

    def _acceptable(self, rel: str, data: bytes) -> bool:
        """Whether an answer can be the object asked for; one that cannot is counted in ``refused``
        and the next source is tried (a lying peer does not get the head it came with refused)."""
        name = parse_rel(rel)
        if isinstance(name, ManifestName):
            ok = self._is_manifest(name, data)
        elif isinstance(name, CertName):
            ok = self._is_certificate(name, data)
        elif rel.startswith(("manifests/", "certs/")):
            ok = False  # a name no manifest or certificate can have (a forged head's odd-length key id)
        else:
            return True
        if not ok:
            self.refused += 1
        return ok

    @staticmethod
    def _is_manifest(name: ManifestName, data: bytes) -> bool:
        """The manifest ``name`` names: the BLAKE3 of its body."""
        try:
            return blake3.blake3(Envelope.from_bytes(data, MANIFEST_TAG).body).digest() == name.manifest_id
        except PatchswarmError:
            return False

    def _is_certificate(self, name: CertName, data: bytes) -> bool:
        """A certificate for the key ``name`` names, validly signed by a current root key (the trust
        state checks it again, with expiry and run, before it counts)."""
        trust = self.node.policy
        if not isinstance(trust, TrustState):
            return True  # (such a node never asks for certificates)
        try:
            cert, _ = trust.read_certificate(data)
        except PatchswarmError:
            return False
        return cert.key == name.key_id

    async def get(self, rel: str, limit: int, prefer: str | None = None) -> bytes | None:
        node = self.node
        name = parse_rel(rel)
        held = node.objects.get(rel)
        if held and not isinstance(name, HeadName):  # (only verified bytes are held: never empty)
            return held
        if isinstance(name, RootName):
            return await self._get_root(rel, limit)
        if isinstance(name, HeadName) and prefer is None and self._boards and not self._knows_a_seed():
            # A head poll in a swarm without a seed: nobody announces new heads, so peers hold only
            # what they polled themselves; the board is the one that knows.
            for board in self._boards:
                found = await self._ask_board(board, rel, limit)
                if isinstance(found, bytes):
                    return found
        for addr in self._candidates(rel, prefer):
            found = await self._ask(addr, rel, limit)
            if isinstance(found, bytes):
                if isinstance(name, HeadName):
                    self._head_from = addr
                return found
        for board in self._boards:
            found = await self._ask_board(board, rel, limit)
            if isinstance(found, bytes):
                return found
        return None

    async def board_chunk(self, ref: ChunkRef) -> bytes | None:
        """A chunk from the boards (``seed_urls``), for a node that knows no seed; None if none has it.
        The caller verifies it (a board is a relay like any other)."""
        for board in self._boards:
            found = await self._ask_board_raw(board, chunk_rel(ref.hash), ref.size)
            if isinstance(found, bytes):
                return found
        return None

    async def _get_root(self, rel: str, limit: int) -> bytes | None:
        """A root document: the boards, then a seed; either's "not here" is the answer (see the module
        docstring).  Peers only while neither can be reached (a peer's "not here" settles nothing)."""
        for board in self._boards:
            found = await self._ask_board(board, rel, limit)
            if found is not _UNREACHABLE:
                return found if isinstance(found, bytes) else None
        seed = min((v.info.addr for v in self.node.peers.values() if v.ann.seed), default=None)
        if seed is not None:
            found = await self._ask(seed, rel, limit)
            if found is not _UNREACHABLE:
                return found if isinstance(found, bytes) else None
        for addr in self._candidates(rel, None):
            if addr == seed:
                continue  # it did not answer just now
            found = await self._ask(addr, rel, limit)
            if isinstance(found, bytes):
                return found
        return None

    async def _ask(self, addr: str, rel: str, limit: int, *, insist: bool = False) -> bytes | _Unreachable | None:
        """The object from a peer; None if it says it has not got it (or sent something else);
        ``_UNREACHABLE`` if it did not answer.  A seed withholding it names who has it: see ``_ask_named``."""
        node = self.node
        try:
            data = await node.transport.get_object(addr, rel, limit, OBJECT_TIMEOUT, node.info.node_id, insist)
        except TransportError:
            return _UNREACHABLE
        if isinstance(data, Missing):
            if insist or not self._is_seed(addr):
                return None  # (only a seed withholds; names from anyone else are not followed)
            return await self._ask_named(addr, data.holders, rel, limit)
        return self._keep_if_acceptable(rel, data)

    async def _ask_named(
        self, seed: str, holders: tuple[str, ...], rel: str, limit: int
    ) -> bytes | _Unreachable | None:
        """A seed that gave a manifest to enough requesters names some of them instead (on a
        simulated cold start all 1,000 hosts took it from the seed at once).  Ask them (they hold it,
        or are about to; it is named by its hash, so a wrong one is refused), then the seed again,
        insisting."""
        for addr in holders[:NAMED_TRIES]:
            if addr == self.node.info.addr:
                continue
            if isinstance(found := await self._ask(addr, rel, limit, insist=True), bytes):
                return found
        return await self._ask(seed, rel, limit, insist=True)

    def _knows_a_seed(self) -> bool:
        return any(v.ann.seed for v in self.node.peers.values())

    def _is_seed(self, addr: str) -> bool:
        return any(v.ann.seed and v.info.addr == addr for v in self.node.peers.values())

    async def _ask_board(self, board: BoardSource, rel: str, limit: int) -> bytes | _Unreachable | None:
        data = await self._ask_board_raw(board, rel, limit)
        return data if isinstance(data, _Unreachable) else self._keep_if_acceptable(rel, data)

    async def _ask_board_raw(self, board: BoardSource, rel: str, limit: int) -> bytes | _Unreachable | None:
        try:
            data = await board.get(rel, limit)
        except (SourceError, LimitExceededError) as e:
            if self._board_errors.get(id(board)) != (text := str(e)):  # (bad credentials: once, not per poll)
                log.warning("board: %s", text)
            self._board_errors[id(board)] = text
            return _UNREACHABLE
        self._board_errors.pop(id(board), None)
        return data

    def _keep_if_acceptable(self, rel: str, data: bytes | None) -> bytes | None:
        if data is None or not self._acceptable(rel, data):
            return None
        self._hold(rel, data)
        return data

    def _hold(self, rel: str, data: bytes) -> None:
        fetched = self.fetched
        fetched.pop(rel, None)  # (re-inserted last: the oldest unclaimed go first)
        fetched[rel] = data
        while len(fetched) > UNCLAIMED:
            del fetched[next(iter(fetched))]

    async def close(self) -> None:
        for b in self._boards:
            await b.close()

"""The membership protocol's messages (protocol/membership.py): a node's identity, a member's state,
the facts gossiped about members, the six message kinds, and a message to send.  protocol/wire.py
encodes them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node's identity, locality labels and address (the address is opaque to this module)."""

    node_id: str
    addr: str
    zone: str = ""
    region: str = ""


class MemberState(IntEnum):
    """Ordered by precedence at equal incarnation (a larger state wins)."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass(frozen=True, slots=True)
class Update:
    """A gossiped fact about one member.  ``origin``: the node that asserted it (counts suspicions)."""

    info: NodeInfo
    incarnation: int
    state: MemberState
    origin: str = ""


@dataclass(frozen=True, slots=True)
class Ping:
    """Direct probe; the target answers ``Ack`` to the sender."""

    seq: int
    target_id: str
    piggyback: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class PingReq:
    """ "Probe ``target`` for me": the helper pings it and relays the ``Ack`` (or sends a ``Nack``)."""

    seq: int
    target: NodeInfo
    piggyback: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    """Answer to a probe; ``target_id`` is the node that was probed."""

    seq: int
    target_id: str
    piggyback: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Nack:
    """Lifeguard: a ``PingReq`` helper got no answer from the target (the helper itself is fine)."""

    seq: int
    target_id: str
    piggyback: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Sync:
    """Anti-entropy push of the sender's full state; ``reply=True`` asks for the receiver's back."""

    members: tuple[Update, ...]
    reply: bool
    piggyback: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Gossip:
    """A gossip round's message: nothing but piggybacked updates."""

    piggyback: tuple[Update, ...] = ()


Message = Ping | PingReq | Ack | Nack | Sync | Gossip


@dataclass(frozen=True, slots=True)
class Send:
    to: NodeInfo
    message: Message


# A Sync lists at most this many members (protocol/wire.py refuses longer lists: MAX_UPDATES); a full
# membership larger than that sends a random sample (the rest spreads by gossip and later syncs).
MAX_SYNC_MEMBERS = 4000

"""What the membership state machine (protocol/membership.py) records: a member, a suspicion, this
node's probe, a probe relayed for another node, a queued broadcast.  Internal to the membership's
modules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from patchswarm.protocol.membership_messages import MemberState, NodeInfo, Update


@dataclass(slots=True, init=False)
class _Member:
    info: NodeInfo
    incarnation: int
    state: MemberState
    origin: str
    since: float  # when state last changed
    told_at: float  # when we last told it that we consider it DEAD/LEFT
    rank: int  # bounded view: its rank from this node (lower stays)
    fact: Update | None  # the Update equal to (info, incarnation, state, origin), kept for known()

    def __init__(
        self, info: NodeInfo, incarnation: int, state: MemberState, origin: str, since: float, fact: Update | None
    ) -> None:
        self.info = info
        self.incarnation = incarnation
        self.state = state
        self.origin = origin
        self.since = since
        self.told_at = -math.inf
        self.rank = 0
        self.fact = fact


@dataclass(slots=True)
class _Suspicion:
    incarnation: int
    start: float
    expected: int
    shortest: float
    longest: float
    confirmers: set[str]
    deadline: float


@dataclass(slots=True)
class _Probe:
    seq: int
    target: NodeInfo
    timeout_at: float
    deadline: float
    indirect: bool = False
    nackers: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Relay:  # a PingReq we are serving as helper
    requester: NodeInfo
    seq: int
    target_id: str
    nack_at: float


@dataclass(slots=True, init=False)
class _Broadcast:
    update: Update
    transmits: int
    order: int

    def __init__(self, update: Update, transmits: int, order: int) -> None:
        self.update = update
        self.transmits = transmits
        self.order = order

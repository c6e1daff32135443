"""What a node knows of the other nodes of its run: their last announcements, and who is alive.

Sans-IO bookkeeping shared by the node's rules (protocol/announce.py, seeding.py, download.py):
``PeerView`` is a peer's latest announcement, ``LiveMembers`` the live members the membership
reported, kept in step with its events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.wire import Announcement


@dataclass
class PeerView:
    info: NodeInfo
    ann: Announcement
    seen: float
    seq: int = 0  # bumps with every announcement or hint about this peer (refresh only what changed)


class LiveMembers:
    """The live members (what ``Membership.alive()`` lists, unsorted), kept from its events without an
    O(members) walk, and when the list last changed (stripe trees wait for it to settle: ``tree_settle``)."""

    def __init__(self) -> None:
        self.members: list[NodeInfo] = []  # live members, in no particular order (for sampled announcements)
        self.index: dict[str, int] = {}  # node id -> index in members
        self.changed_at = -math.inf  # when a member last joined the list or left it
        self.settled_until = -math.inf  # changes up to then are old news (``settle``)

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.index

    def get(self, node_id: str) -> NodeInfo | None:
        at = self.index.get(node_id)
        return None if at is None else self.members[at]

    def settle(self, now: float) -> None:
        """Take the changes so far as old news (a node given the view of a running swarm has known them long)."""
        self.settled_until = now

    def track(self, info: NodeInfo, state: MemberState, now: float) -> None:
        """A membership event: ``info`` is now in ``state``."""
        at = self.index.get(info.node_id)
        if state in (MemberState.ALIVE, MemberState.SUSPECT):
            if at is None:
                self._changed(now)
                self.index[info.node_id] = len(self.members)
                self.members.append(info)
            else:
                self.members[at] = info  # its address may have changed
        elif at is not None:  # swap-remove
            self._changed(now)
            last = self.members.pop()
            del self.index[info.node_id]
            if last.node_id != info.node_id:
                self.members[at] = last
                self.index[last.node_id] = at

    def _changed(self, now: float) -> None:
        if now > self.settled_until:
            self.changed_at = now

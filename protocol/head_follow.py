"""Following a run's head, sans-IO: which head a node holds, which fetch is worth starting, and
which refusals to warn of.

A node hears of newer heads in announcements (and a seed reads its board's); fetching and
verifying one is the driver's work (swarm/node.py with the puller), this object keeps the state
the decisions need: the head held, the fetch under way (one per newer counter: every peer pushing
the same head would otherwise cost a fetch and a signature check each), why the last head was
refused, and when each refusal was last warned of (a refusal that repeats at every poll is one
warning a minute, not one per poll).
"""

from __future__ import annotations

from patchswarm.protocol.head import Head

HEAD_WARN_INTERVAL = 60.0  # seconds between two warnings of the same head refusal
WARNED_MAX = 64  # refusals remembered (refusals from many sources: only the recent ones are kept)


class HeadFollower:
    def __init__(self) -> None:
        self.head: Head | None = None
        self.counter = -1  # the held head's counter (-1: none)
        self.fetching = -1  # the highest head counter a fetch is under way for (one fetch at a time)
        self.error: str | None = None  # why the last head this node checked was refused
        self.warned: dict[str, float] = {}  # refusal message -> time of its last warning

    def fetch_for(self, counter: int) -> bool:
        """An announcement names head ``counter``: True if a fetch of it should start now (it is then
        under way until ``fetch_ended``).  If it fails, the next announcement retries."""
        if counter > max(self.counter, self.fetching):
            self.fetching = counter
            return True
        return False

    def fetch_ended(self, counter: int) -> None:
        if self.fetching == counter:
            self.fetching = -1

    def accept(self, head: Head | None, before: int) -> bool:
        """A fetch that started when the held counter was ``before`` verified ``head`` (None: nothing
        newer): True if it is now the head held.  Not if another fetch accepted this head, or a newer
        one, while this one was verifying."""
        if head is None or (self.counter != before and head.counter <= self.counter):
            return False
        self.head, self.counter = head, head.counter
        return True

    def board_head(self, head: Head) -> bool:
        """A seed read ``head`` from its board: True if it moved (the seed takes it as it is)."""
        if head.counter == self.counter:
            return False
        self.head, self.counter = head, head.counter
        return True

    def warn(self, what: str, now: float) -> bool:
        """A head was refused for ``what``: True to warn of it, False to only log it quietly (the same
        refusal was warned of within ``HEAD_WARN_INTERVAL``; the status and metrics say it meanwhile).
        A new refusal is always warned of."""
        last = self.warned.get(what)
        if last is not None and now - last < HEAD_WARN_INTERVAL:
            return False
        if len(self.warned) >= WARNED_MAX:
            self.warned = {k: t for k, t in self.warned.items() if now - t < HEAD_WARN_INTERVAL}
        if len(self.warned) < WARNED_MAX:
            self.warned[what] = now
        return True

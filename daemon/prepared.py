"""An activation prepared (staged, journal durable) but not yet written: the part of an activation
that needs no pause.

The daemon prepares before it drains the sidecar or pauses the engine, so only the fenced write
(and the commit, the resume) sits inside the pause.  A prepared activation ends one of two ways,
decided once under a lock: ``claim`` (the fenced write begins; its journal is then the store's to
finish, roll back or remove) or ``abandon`` (a drain that timed out, a stop, a pause that failed:
the journal is removed, memory was never touched).  A journal left by a kill between the two is the
one the "journaled" crash point always left: recovery rolls it forward (docs/weightstore.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from patchswarm.daemon import journal
from patchswarm.daemon.store_format import JournalError, StoreError

log = logging.getLogger("patchswarm.daemon")


class Prepared:
    """The claim-or-abandon state of one prepared activation (its journal in ``journal_dir``)."""

    def __init__(self, journal_dir: Path, journal_s: float, journal_bytes: int, *, journaled: bool = True) -> None:
        self.journal_dir = journal_dir
        self.journaled = journaled  # (False: nothing is written in place, so no journal to remove)
        self.journal_s = journal_s
        self.journal_bytes = journal_bytes
        self._lock = threading.Lock()
        self._state = "prepared"  # -> "claimed" | "abandoned"

    @property
    def state(self) -> str:
        return self._state

    def claim(self) -> None:
        """The fenced write begins; StoreError if the activation was abandoned or claimed already."""
        with self._lock:
            if self._state != "prepared":
                raise StoreError(f"this prepared activation was {self._state} already")
            self._state = "claimed"

    def abandon(self) -> bool:
        """Give the activation up before its write: its journal removed (True), or nothing to do
        (claimed: the write owns the journal; abandoned already).  A journal that cannot be removed
        is harmless: its base is what the store holds, and the next activation's journal replaces it."""
        with self._lock:
            if self._state != "prepared":
                return False
            self._state = "abandoned"
        if not self.journaled:
            return True
        try:
            journal.remove_journal(self.journal_dir)
        except JournalError as e:
            log.warning("abandoned activation: %s", e)
        return True


@contextlib.contextmanager
def abandon_on_error(prepared: Prepared | None) -> Iterator[None]:
    """Abandon ``prepared`` when the block raises before its write was claimed (a drain timeout, a
    stop, a failed pause); once claimed, the write's own error handling owns the journal."""
    try:
        yield
    except BaseException:
        if prepared is not None:
            prepared.abandon()
        raise

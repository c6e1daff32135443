"""Which process exported an engine buffer, and whether it still lives.

An engine buffer is the engine's memory (CUDA memory dies with its process; a CUDA allocation an
engine frees goes back to its allocator): writing into it after the engine died is undefined.  The
daemon records the exporter when the engine registers (``peer_pid``: SO_PEERCRED of the API's
unix-socket connection, so the pid is the kernel's word, translated into the daemon's pid
namespace) and checks it before every load and activation and at every status refresh.

A pid alone can be reused: the exporter is (pid, start time), the start time being field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), which a reused pid does not repeat; it is stored
with the handle, so a restarted daemon checks it before re-importing.  While the daemon runs it
also holds a pidfd (Linux >= 5.3), which becomes readable when that very process exits.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")


def proc_start(pid: int, proc: Path = PROC) -> int | None:
    """Start time (field 22 of /proc/<pid>/stat) of a live process; None if gone or a zombie."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    return parse_stat(text)


def parse_stat(text: str) -> int | None:
    """The start time in a /proc/<pid>/stat line; None for a zombie or dead task, or a malformed line.

    The command name (field 2) is in parentheses and may hold spaces and parentheses: the fields
    after it start past its last ')'."""
    tail = text[text.rfind(")") + 1 :].split()
    if len(tail) < 20 or tail[0] in ("Z", "X", "x"):
        return None
    try:
        return int(tail[19])  # field 22: the 20th after the name (state is field 3)
    except ValueError:
        return None


def peer_pid(sock: Any) -> int | None:
    """The pid of the process at the other end of a unix-socket connection (SO_PEERCRED); ``sock``
    is a socket, or the transport's socket wrapper aiohttp hands out."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else None


@dataclass(slots=True)
class Exporter:
    """The engine process that exported a buffer: (pid, start time), and a pidfd while we watch it."""

    pid: int
    start: int
    _pidfd: int | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_pid(cls, pid: int, proc: Path = PROC) -> Exporter | None:
        """The live process ``pid`` (None if it is gone already)."""
        start = proc_start(pid, proc)
        if start is None:
            return None
        pidfd = None
        with contextlib.suppress(OSError, AttributeError):
            pidfd = os.pidfd_open(pid)
        ex = cls(pid, start, pidfd)
        if proc_start(pid, proc) != start:  # it died (and the pid was reused) while the pidfd opened
            ex.close()
            return None
        return ex

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, obj: Any) -> Exporter | None:
        """From ``to_json`` (as stored in the control segment); None for anything malformed."""
        if not isinstance(obj, dict):
            return None
        pid, start = obj.get("pid"), obj.get("start")
        if type(pid) is not int or type(start) is not int or not 0 < pid < 1 << 31 or start < 0:
            return None
        return cls(pid, start)

    def alive(self, proc: Path = PROC) -> bool:
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], 0)
            if ready:  # a pidfd turns readable when its process exits
                return False
        return proc_start(self.pid, proc) == self.start

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

"""One daemon per data directory and per store: exclusive ``flock``s, held for the life of the process.

``<data.dir>/daemon.lock`` guards the journal and the state; ``/dev/shm/<store.name>.lock`` guards
the shared weight store (two daemons writing one store, each with its own journal, would corrupt
what the engine serves).  Both are taken before anything touches the store, the journal or the API
socket, and the kernel drops them when the process dies, however it dies: no stale lock to clean
up.  A second daemon finds one held, names the holder and leaves everything as it was.  The files
are never removed: unlinking a lock file lets two processes lock two different files of the same
name.  Engines never take these locks (they only map the store).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "daemon.lock"
MAX_PID_BYTES = 32


class InstanceLockedError(Exception):
    """Another live process holds the data directory or the store."""


class FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` that records the holder's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def refusal(self, holder: str) -> str:
        return f"{self.path} is held by {holder}"

    def acquire(self) -> None:
        """Lock, or raise InstanceLockedError naming the holder; OSError if the lock file is unusable."""
        # O_NOFOLLOW: a symlink planted at the lock's name is not followed to truncate another file.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise InstanceLockedError(self.refusal(f"pid {holder}" if holder else "another process")) from None
        self._fd = fd
        with contextlib.suppress(OSError):  # (a full disk: the lock holds all the same, the pid goes unnamed)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # (closing drops the flock)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    """The holder's pid as it wrote it (bounded read; anything else: unknown)."""
    try:
        text = os.pread(fd, MAX_PID_BYTES, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and 0 < len(text) < 12 else None


class InstanceLock(FileLock):
    """One daemon per data directory."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir / LOCK_NAME)

    def refusal(self, holder: str) -> str:
        return (
            f"data.dir: {self.path.parent} is in use by another daemon ({holder}); "
            "stop it, or give this one its own data.dir"
        )

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().acquire()


class StoreLock(FileLock):
    """One daemon per weight store (``path``: the store's lock file, daemon.engine.store_lock_path)."""

    def __init__(self, name: str, path: Path) -> None:
        super().__init__(path)
        self.name = name

    def refusal(self, holder: str) -> str:
        return (
            f"store.name: {self.name} is in use by another daemon ({holder}, lock {self.path}); "
            "stop it, or give this one its own store.name"
        )

"""One daemon per data directory: an exclusive ``flock`` on ``<data.dir>/daemon.lock``.

Taken before anything touches the store, the journal or the API socket, and held for the life of
the process (the kernel drops it when the process dies, however it dies: no stale lock to clean up).
A second daemon started with the same config finds it held, names the holder and leaves everything
as it was.  The file is never removed: unlinking a lock file lets two processes lock two different
files of the same name.
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
    """Another live process holds the data directory."""


class InstanceLock:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Lock, or raise InstanceLockedError naming the holder; OSError if the directory is unusable."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted at the lock's name is not followed to truncate another file.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            who = f"pid {holder}" if holder else "another process"
            raise InstanceLockedError(
                f"data.dir: {self.path.parent} is in use by another daemon ({who}); "
                "stop it, or give this one its own data.dir"
            ) from None
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

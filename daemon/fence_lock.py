"""The handshake between the weight store's writer and its readers: a lock file per store.

The seqlock (daemon/store_format.py) only tells a reader, after the fact, that a write overlapped
its read; and an engine's reads may still run on a GPU after its Python code returned.  This
handshake keeps the daemon from starting a write while a reader's launched work may still read:

- reader (``ReadGate``, inside ``FenceReader.consistent``): unless a writer is pending, a shared
  ``flock(2)`` on ``<shm_dir>/<store>.readers`` from before reading the stable sequence number
  until after its asynchronous work is synchronized (one lock/unlock pair per read);
- writer (``WriteGate``, taken by ``ControlBlock.begin``): set the control block's "write pending"
  word (its deadline), take the exclusive lock with non-blocking tries and backoff, clear the
  word; past the deadline ``ReadersStalled`` names the holders and nothing is written.
  ``ControlBlock.publish`` lets go once the sequence number is even again.

The kernel drops a flock when its process dies, however it dies: a killed engine never blocks the
writer, a killed daemon never blocks readers (a pending word it left expires at its deadline, and
the next daemon clears it when it opens the store).  Locks belong to open file descriptions, so a
reader and a writer in one process (tests, benchmarks) exclude each other as two processes do.
docs/weightstore.md section 5 describes the protocol and its cost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from pathlib import Path

from patchswarm.daemon.store_format import OFF_WRITE_PENDING, ControlBlock, StoreError

LOCK_SUFFIX = ".readers"
LOCK_MODE = 0o660  # as the store's segment: the daemon and the engines of api.group
DEFAULT_WAIT_S = 10.0  # how long a write waits for the readers in flight (a forward pass or so)
MAX_WAIT_S = 600.0  # a pending word further ahead than this is not a deadline of this host's clock
_PROC_LOCKS_LIMIT = 1 << 20


class ReadersStalled(StoreError):
    """A write could not begin: readers still held the store past the writer's bound (nothing written)."""


def readers_lock_path(segment_path: Path) -> Path:
    """The lock file of the store whose control segment is at ``segment_path``."""
    return segment_path.with_name(segment_path.name + LOCK_SUFFIX)


def writer_pending(control: ControlBlock) -> bool:
    """True while a writer waits for the readers in flight (its deadline not passed)."""
    deadline = control.get(OFF_WRITE_PENDING)
    if not deadline:
        return False
    now = time.monotonic_ns()
    return now < deadline <= now + int(MAX_WAIT_S * 1e9)


def lock_holders(path: Path) -> list[int]:
    """The pids holding or waiting on a flock of ``path`` (from /proc/locks; [] where it cannot tell)."""
    try:
        st = os.stat(path)
        with open("/proc/locks", "rb") as f:
            text = f.read(_PROC_LOCKS_LIMIT).decode("ascii", "replace")
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    for line in text.splitlines():
        parts = line.split()
        if "FLOCK" in parts and key in parts:
            i = parts.index(key) - 1
            with contextlib.suppress(ValueError):
                pids.append(int(parts[i]))
    return sorted(set(pids))


def _check_lock_file(fd: int, path: Path) -> None:
    """The writer's lock must be a regular file of this process's user: one another user planted in
    /dev/shm before the store existed (sticky: the daemon could never remove it) would let that user
    hold it, or be chmod-ed by a root daemon and stay theirs."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"the readers' lock {path} is not a regular file: remove it")
    if st.st_uid != os.geteuid():
        raise StoreError(
            f"the readers' lock {path} belongs to uid {st.st_uid}, not this daemon's ({os.geteuid()}): "
            "another user made it; remove it"
        )


class _Held:
    """One process's exclusive side of one lock file, shared by every handle on the store there:
    the process that owns a store (daemon.instance_lock) is its one writer, however many handles
    it opens (a restart's recovery in tests re-opens the store in the same process)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.held = False
        self.refs = 1


_WRITERS: dict[tuple[int, int], _Held] = {}
_WRITERS_MU = threading.Lock()


class WriteGate:
    """The writer's side: wait (bounded) for the readers in flight, then hold them off while writing."""

    def __init__(self, path: Path, *, gid: int = -1, wait_s: float = DEFAULT_WAIT_S) -> None:
        try:
            # O_NOFOLLOW: a symlink planted at the lock's name is not followed.
            # O_NONBLOCK: a FIFO planted there does not hang the open (it is then refused).
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, LOCK_MODE)
        except OSError as e:
            raise StoreError(f"cannot open the readers' lock {path}: {e}") from e
        try:
            _check_lock_file(fd, path)
            os.fchmod(fd, LOCK_MODE)
            st = os.fstat(fd)
            if gid != -1 and st.st_gid != gid:
                os.fchown(fd, -1, gid)
        except StoreError:
            os.close(fd)
            raise
        except OSError as e:
            os.close(fd)
            raise StoreError(f"cannot give the readers' lock {path} the store's mode and group: {e}") from e
        self.path = path
        self.wait_s = wait_s
        self._key: tuple[int, int] | None = (st.st_dev, st.st_ino)
        with _WRITERS_MU:
            shared = _WRITERS.get(self._key)
            if shared is not None and os.fstat(shared.fd).st_nlink == 0:
                shared = None  # (a removed lock file whose inode number came back: not this one)
            if shared is None:
                self._lock = _WRITERS[self._key] = _Held(fd)
                fd = -1
            else:
                shared.refs += 1
                self._lock = shared
        if fd != -1:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._lock.held

    def acquire(self, control: ControlBlock) -> None:
        lock = self._lock
        if lock.held:
            return
        if self._key is None:
            raise StoreError(f"the readers' lock {self.path} is closed")
        wait_s = min(max(self.wait_s, 0.0), MAX_WAIT_S)
        deadline = time.monotonic_ns() + int(wait_s * 1e9)
        control.set(OFF_WRITE_PENDING, deadline)  # new readers wait from now on
        delay = 20e-6
        try:
            while True:
                try:
                    fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic_ns()
                    if left <= 0:
                        raise self._stalled(wait_s) from None
                    time.sleep(min(delay, left / 1e9))
                    delay = min(delay * 2, 2e-3)  # (a reader's pass ends at most 2 ms before the write starts)
                except OSError as e:
                    raise StoreError(f"cannot lock the readers' lock {self.path}: {e}") from e
        finally:
            control.set(OFF_WRITE_PENDING, 0)  # held (readers then wait on the lock) or given up
        lock.held = True

    def _stalled(self, wait_s: float) -> ReadersStalled:
        pids = [p for p in lock_holders(self.path) if p != os.getpid()] or lock_holders(self.path)
        who = f"pid {', '.join(map(str, pids))}" if pids else "an engine"
        return ReadersStalled(
            f"the store's readers ({who}) still held {self.path.name} after {wait_s:g} s: a forward pass "
            "still running, or an engine stuck inside FenceReader.consistent; nothing was written "
            "(the activation is retried)"
        )

    def release(self, control: ControlBlock) -> None:
        lock = self._lock
        if lock.held and self._key is not None:
            fcntl.flock(lock.fd, fcntl.LOCK_UN)
            lock.held = False

    def close(self) -> None:
        """Drop this handle; the last one of the process closes the file (and so drops the flock)."""
        with _WRITERS_MU:
            if self._key is None:
                return
            self._lock.refs -= 1
            if self._lock.refs == 0:
                if _WRITERS.get(self._key) is self._lock:
                    del _WRITERS[self._key]
                with contextlib.suppress(OSError):
                    os.close(self._lock.fd)
            self._key = None


class ReadGate:
    """The reader's side: a shared flock, counted so that threads of one engine share it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.path = path
        self._fd: int | None = fd
        self._count = 0
        self._mu = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> ReadGate | None:
        """The lock of a store; None when there is none (a store made before the handshake existed)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot open the readers' lock {path}: {e}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"the readers' lock {path} is not a regular file")
        except (OSError, StoreError):
            os.close(fd)
            raise
        return cls(fd, path)

    def try_enter(self, control: ControlBlock) -> bool:
        """Take (or share) the read lock unless a writer is pending or writing; False: try again later."""
        with self._mu:
            if self._fd is None:
                raise StoreError(f"the readers' lock {self.path} is closed")
            if writer_pending(control):
                return False  # (even while this process holds it: the writer must get its turn)
            if self._count == 0:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            self._count += 1
            return True

    @property
    def count(self) -> int:
        """Reads of this process in flight under the lock."""
        return self._count

    def exit(self) -> None:
        with self._mu:
            self._count -= 1
            if self._count == 0 and self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._mu:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd, self._count = None, 0

"""The one way a local file enters patchswarm (bounded, regular files only, confined where a peer names
it) and the one way one leaves it (``write_atomic``: whole or not at all).

Every file a server serves and every file named on a command line or in a config goes through
``read_file`` (or ``read_confined`` when the name came from the network).  The checks happen on the
open descriptor, not on the name, so a name swapped between check and read changes nothing:

- the file is opened with O_NONBLOCK (a FIFO's open does not wait for a writer) and O_NOCTTY;
- ``fstat`` must say regular file: FIFOs, sockets, character and block devices (/dev/zero) are refused;
- its size must be at most ``limit``, and at most ``limit`` bytes are ever read (a file that grows
  while it is read is cut off, never buffered past the bound);
- a name from a peer (``read_confined``) must be a relative path of plain components under one of
  the allowed top-level folders, and is opened component by component with O_NOFOLLOW below the
  root (openat), so no ``..``, absolute path, percent-decoded ``/`` or symlink leads outside it.

Every file patchswarm writes for others to read (board objects, patch files, models, state) goes
through ``write_atomic``: a temporary name in the same directory, fsynced, renamed over the target,
and the directory fsynced, so a reader (or a restart after a crash) sees the old file or the whole
new one, never a partial one.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

from patchswarm.protocol.errors import LimitExceededError, PatchswarmError


class InputFileError(PatchswarmError):
    """A named file that cannot be used: missing, not a regular file, unreadable or too large."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.reason = reason


class MissingFileError(InputFileError):
    """A named file that does not exist (a reader may treat it as "nothing yet")."""


class FileTooLargeError(InputFileError, LimitExceededError):
    """A file larger than the bound its reader allows."""


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_READ_MAX = 0x7FFFF000  # the most one read() returns on Linux
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _check_fd(fd: int, path: str | os.PathLike[str], limit: int) -> os.stat_result:
    """The descriptor's stat, once it is known to be a regular file of at most ``limit`` bytes (now blocking)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(path, f"not a regular file ({_kind(st.st_mode)})")
    if st.st_size > limit:
        raise FileTooLargeError(path, f"{st.st_size} bytes, more than the {limit} allowed")
    os.set_blocking(fd, True)
    return st


def _read_fd(fd: int, path: str | os.PathLike[str], limit: int) -> bytes:
    st = _check_fd(fd, path, limit)
    parts: list[bytes] = []
    got = 0
    # The first read asks for the whole file: one buffer, no join (for a file up to the ~2 GiB one
    # read returns).  Then pieces until EOF or past the bound: a file that grows, a /proc file
    # whose size says 0.
    ask = min(st.st_size + 1, _READ_MAX)
    while got <= limit:
        piece = os.read(fd, min(limit + 1 - got, ask))
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
        ask = 1 << 24
    if got > limit:
        raise FileTooLargeError(path, f"grew past the {limit} bytes allowed while being read")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def open_regular(path: str | os.PathLike[str], limit: int) -> int:
    """An open, blocking descriptor of the regular file at ``path`` of at most ``limit`` bytes.

    For a reader that does not take the file whole (a model it maps, a patch file it reads in
    steps); InputFileError (one line) otherwise.  The caller closes the descriptor.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise MissingFileError(path, "no such file") from None
    except OSError as e:
        raise InputFileError(path, e.strerror or type(e).__name__) from None
    try:
        _check_fd(fd, path, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes; InputFileError (one line) otherwise."""
    fd = open_regular(path, limit)
    try:
        return _read_fd(fd, path, limit)
    except OSError as e:
        raise InputFileError(path, e.strerror or type(e).__name__) from None
    finally:
        os.close(fd)


def confined_parts(rel: str, top_level: Collection[str]) -> list[str] | None:
    """The components of a peer-named relative path, or None if it could leave the allowed folders.

    Refused: empty components, ``.``/``..``, hidden names, backslashes, NUL and other control
    characters, names longer than a file name may be (255 bytes), and a first component outside
    ``top_level``.
    """
    if not rel or len(rel) > 1024:
        return None
    parts = rel.split("/")
    for p in parts:
        if p in ("", ".", "..") or p.startswith(".") or "\\" in p or any(ord(c) < 0x20 or ord(c) == 0x7F for c in p):
            return None
        if len(p.encode("utf-8", "surrogateescape")) > 255:  # ENAMETOOLONG
            return None
    if parts[0] not in top_level or len(parts) < 2:
        return None
    return parts


def open_confined(root: str | os.PathLike[str], rel: str, top_level: Collection[str], limit: int) -> int | None:
    """An open descriptor of the regular file at ``rel`` below ``root`` (a peer-supplied name), or None.

    None for anything that is not a regular file reached without leaving ``root``: a refused name,
    a symlink on the way, a directory, FIFO or device.  FileTooLargeError past ``limit``.  The
    caller closes the descriptor; what it reads there is the file that was checked, whatever
    happens to the name afterwards.
    """
    parts = confined_parts(rel, top_level)
    if parts is None:
        return None
    try:
        dfd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    try:
        for p in parts[:-1]:
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=dfd)
            except OSError:
                return None
            os.close(dfd)
            dfd = nfd
        try:
            fd = os.open(parts[-1], _OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError as e:
            if e.errno in (
                errno.ENOENT,
                errno.ELOOP,
                errno.ENOTDIR,
                errno.EISDIR,
                errno.ENXIO,
                errno.EACCES,
                errno.ENAMETOOLONG,
            ):
                return None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        if st.st_size > limit:
            raise FileTooLargeError(Path(root, *parts), f"{st.st_size} bytes, more than the {limit} allowed")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_confined(root: str | os.PathLike[str], rel: str, top_level: Collection[str], limit: int) -> bytes | None:
    """A regular file at ``rel`` below ``root`` (a peer-supplied name), or None if it is not there.

    None for anything that is not a regular file reached without leaving ``root``: a refused name,
    a symlink on the way, a directory, FIFO or device.  FileTooLargeError past ``limit``.
    """
    fd = open_confined(root, rel, top_level, limit)
    if fd is None:
        return None
    try:
        return _read_fd(fd, Path(root, rel), limit)
    except OSError as e:
        raise InputFileError(Path(root, rel), e.strerror or type(e).__name__) from None
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes | memoryview | None = None,
    *,
    fill: Callable[[str], None] | None = None,
    mode: int = 0o644,
    sync_dir: bool = True,
    create_dir: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (or with what ``fill(tmp_path)`` writes at a temporary path) whole
    or not at all; the parent directory is created if missing (unless ``create_dir=False``: then a
    missing one is an OSError).  ``sync_dir=False`` leaves the directory's fsync to a caller writing
    many files into it, or fsyncing it its own way (then it calls ``fsync_dir`` once)."""
    if (data is None) == (fill is None):
        raise TypeError("write_atomic takes data or fill, not both or neither")
    target = Path(path)
    if create_dir:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        if data is not None:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        else:
            os.close(fd)
            assert fill is not None
            fill(tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(target.parent)

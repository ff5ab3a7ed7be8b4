"""One writer per output folder: an exclusive advisory lock on ``OUT/.genoctx.lock`` (``fcntl.flock``).

Used by every verb that writes a folder (``prepare --out``, the train loop's run folder, export), so that two
runs into the same folder cannot interleave their files::

    from genoctx.lock import output_lock

    with output_lock(out, wait=False, what="train"):
        ...  # write into out

Design choices:
- ``flock(LOCK_EX | LOCK_NB)`` on a lock file inside the folder. The kernel releases the lock when the holder's
  file is closed, so a process that dies (even by SIGKILL) never leaves a lock that blocks: a stale lock file
  only holds text. Locks are per open file, so a second ``output_lock`` on the same folder in the same process
  (another thread) is refused like another process.
- After acquiring, the holder writes one line ``PID HOST genoctx WHAT`` into the lock file; a refused writer
  reads it to name the holder in its message. On release the file is truncated, not deleted: it stays in the
  folder (name :data:`LOCK_NAME`; readers and listings of a folder should skip it).
- A lock file may still be removed while held (:meth:`OutputLock.discard`, used by a failed ``prepare`` to
  leave nothing it created): every acquirer checks, once it holds the lock, that the file it locked is still
  the one at the path (same inode), and starts over if not. So a waiter never ends up holding a lock on an
  unlinked file while a third writer locks a new one.
- The file descriptor is opened close-on-exec, so programs started by the holder do not inherit the lock
  (a ``fork`` without ``exec`` does share it until the child closes it or exits).
- Advisory only: it excludes genoctx writers, not other programs. ``flock`` works on local file systems and
  on NFS (Linux emulates it with POSIX locks there); POSIX systems only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from genoctx.errors import GenoctxError

log = logging.getLogger(__name__)

LOCK_NAME = ".genoctx.lock"
"""Name of the lock file inside a locked folder (skip it when listing or comparing a folder's files)."""

_HOLDER_RETRIES = 40  # x 25 ms: how long a refused writer waits for the holder to write its PID line


class OutputLock:
    """A held :func:`output_lock`: ``folder`` (the locked folder), ``path`` (its lock file), ``created`` (True when
    this acquisition created the lock file)."""

    def __init__(self, folder: Path, path: Path, fd: int, created: bool):
        self.folder, self.path, self.created = folder, path, created
        self._fd = fd

    def discard(self) -> None:
        """Delete the lock file now, while still holding it (e.g. to remove a folder this run created).

        Safe for other writers waiting on it: they notice and lock a new file. The lock is still held until
        the ``with`` block ends.
        """
        with contextlib.suppress(FileNotFoundError):
            if _same_file(self._fd, self.path):
                self.path.unlink()


@contextlib.contextmanager
def output_lock(out_dir: str | Path, *, wait: bool = False, what: str = "prepare") -> Iterator[OutputLock]:
    """Hold the exclusive write lock of folder ``out_dir`` for the ``with`` block (one writer per folder).

    Args:
        out_dir: the output folder; created (with its parents) if missing. The lock file is
            ``out_dir/.genoctx.lock`` (:data:`LOCK_NAME`).
        wait: if the folder is locked, block until it is free (logs one INFO line ``... waiting for PID n``)
            instead of raising. There is no time limit; Ctrl-C interrupts the wait. The lock is not
            re-entrant: a nested ``output_lock`` of the same folder in the same thread raises (or, with
            ``wait=True``, never returns).
        what: the verb written into the lock file as ``genoctx WHAT`` (``prepare``, ``train``, ``export``), so
            that a refused writer can say what holds the folder.

    Yields:
        An :class:`OutputLock` (``folder``, ``path``, ``created``, ``discard()``). On exit the lock file is
        truncated (not deleted) and the lock released. A process that dies releases its lock too.

    Raises:
        GenoctxError: the folder is locked by another writer and ``wait`` is False; the message names the
            folder and the holder, e.g. ``prepared is being written by PID 1234 (genoctx prepare); wait for it
            or pass --wait``. Also: ``out_dir`` exists and is not a folder, or the lock file cannot be
            created (permission denied, read-only file system).
    """
    folder = Path(out_dir)
    path = folder / LOCK_NAME
    fd, created = _acquire(folder, path, wait)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} genoctx {what}\n".encode(), 0)
        yield OutputLock(folder, path, fd, created)
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


def _acquire(folder: Path, path: Path, wait: bool) -> tuple[int, bool]:
    """Open, lock and check the lock file; returns ``(fd, created)``. See :func:`output_lock` for errors."""
    announced = False
    while True:
        fd, created = _open(folder, path)
        try:
            if not _try_lock(fd):
                holder = _holder(fd, path)
                if holder is not None:  # the holder let go while we read its line
                    message = f"{folder} is being written by {holder}"
                    if not wait:
                        raise GenoctxError(f"{message}; wait for it or pass --wait")
                    if not announced:
                        log.info("%s; waiting for %s", message, holder.split(" (", 1)[0])
                        announced = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                return fd, created
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the file was discarded while we waited for it: lock the new one


def _open(folder: Path, path: Path) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    for _ in range(100):  # a folder removed between mkdir and open (a failed run's cleanup): make it again
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise GenoctxError(f"{folder}: exists and is not a folder") from None
        except OSError as e:
            raise GenoctxError(f"{folder}: cannot create the output folder: {e.strerror or e}") from None
        try:
            try:
                return os.open(path, flags | os.O_EXCL, 0o644), True
            except FileExistsError:
                return os.open(path, flags, 0o644), False
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise GenoctxError(f"{folder}: exists and is not a folder") from None
            raise GenoctxError(f"{folder}: cannot create the lock file {LOCK_NAME}: {e.strerror or e}") from None
    raise GenoctxError(f"{folder}: the folder keeps disappearing; cannot create the lock file {LOCK_NAME}")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int, path: Path) -> str | None:
    """``"PID n (genoctx verb)"`` (``on HOST`` added for another machine) of a held lock file, or None if the
    lock became free meanwhile (then ``fd`` holds it). Waits up to 1 s for a new holder to write its line."""
    text = ""
    for _ in range(_HOLDER_RETRIES):
        with contextlib.suppress(OSError):
            text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.025)
        if _try_lock(fd):
            return None
    parts = text.split(" ", 2)
    if len(parts) < 3 or not parts[0].isdigit():
        return "another process (its PID is not recorded)"
    pid, host, command = parts
    where = "" if host == socket.gethostname() else f" on {host}"
    return f"PID {pid}{where} ({command.splitlines()[0]})"


def _same_file(fd: int, path: Path) -> bool:
    """True if ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (fst.st_ino, fst.st_dev)


def share_like_umask(folder: Path) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``: 0700) and everything in it the modes a plain ``mkdir`` and
    ``open`` would have under the process umask (0755 / 0644 under 022), so that collaborators on a shared
    cluster can read a finished checkpoint or export. Call before renaming a temporary folder into place."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p) and name != LOCK_NAME:
                os.chmod(p, 0o666 & ~umask)

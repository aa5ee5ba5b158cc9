"""Segment ownership: creating a segment's file, or reclaiming the name from a dead owner.

A name in ``/dev/shm`` may still hold the segment of a previous instance that
died without unlinking it.  Such a segment is replaced only when its header
proves it is ours and its owner is gone: a regular file of our uid, with the
ring magic, whose owner pid names no live process; or one its creator died
writing. A creator holds an exclusive ``flock`` on its new file from creation
until the magic is written (:func:`ringstream.ipc.ring.segment.create_segment`),
so a file without the magic that nobody holds locked was left by a creator
that was killed before finishing its header (a SIGKILL between ``open`` and
the magic), and is reclaimed too instead of blocking the name forever.
"""

from __future__ import annotations

import fcntl
import os
import stat

from ringstream.ipc.ring.errors import RingExistsError
from ringstream.ipc.ring.layout import (
    HEADER_OWNER_PID_INDEX,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    MAGIC_SIZE,
)

_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_INSPECT_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RECLAIM_ATTEMPTS = 3


def create_or_reclaim(path: str, mode: int, reclaim_stale: bool) -> int:
    """Create the empty file ``path`` (mode ``mode``) and return its descriptor, holding its exclusive ``flock``.

    The caller keeps the descriptor (and so the lock) until the segment's
    magic is written, then closes it.

    If the name exists and ``reclaim_stale`` is true, a stale segment of a
    dead owner there is replaced (see :func:`_reclaim`).

    Raises:
        RingExistsError: the name exists and was not reclaimed.
        OSError: any other failure of the underlying system calls.
    """
    for _attempt in range(_RECLAIM_ATTEMPTS):
        try:
            fd = _create_file(path, mode)
        except FileExistsError as exc:
            if not reclaim_stale:
                raise RingExistsError(f"{path} already exists") from exc
            fd = _reclaim(path, mode)
        if fd is not None:
            return fd
    raise RingExistsError(f"{path} keeps changing under us; giving up")


def _create_file(path: str, mode: int) -> int | None:
    """The new file at ``path``, locked; None if a reclaimer took the name between the open and the lock.

    Raises FileExistsError if the name exists.
    """
    fd = os.open(path, _CREATE_FLAGS, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        mine = os.fstat(fd)
        current = os.stat(path, follow_symlinks=False)
        if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def _reclaim(path: str, mode: int) -> int | None:
    """Replace a stale segment at ``path`` with a fresh, empty file.

    Returns the new file descriptor, or ``None`` if the path changed while it
    was being inspected (the caller retries).  Reclaimers serialise on an
    exclusive ``flock`` of the stale inode and re-check that the path still
    names that inode before unlinking it, so two owners racing to reclaim the
    same name cannot delete each other's fresh segment.
    """
    try:
        fd = os.open(path, _INSPECT_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RingExistsError(f"{path} exists and cannot be inspected: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RingExistsError(f"{path} exists and is not a regular file; not touching it")
        if st.st_uid != os.geteuid():
            raise RingExistsError(
                f"{path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}); "
                "not touching it"
            )
        header = os.pread(fd, HEADER_SIZE, 0)
        if len(header) == HEADER_SIZE and header[:MAGIC_SIZE] == MAGIC:
            owner_pid = HEADER_STRUCT.unpack_from(header)[HEADER_OWNER_PID_INDEX]
            if _pid_is_alive(owner_pid):
                raise RingExistsError(f"{path} is in use: its owner pid {owner_pid} is alive")
        elif any(header):
            raise RingExistsError(
                f"{path} exists and is not a ringstream ring segment; if it is stale, remove it by hand"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RingExistsError(f"{path} is being reclaimed (or created) by another process") from exc
        if not header[:MAGIC_SIZE] == MAGIC:
            header = os.pread(fd, HEADER_SIZE, 0)  # under the lock: a creator that finished meanwhile wrote it
            if any(header):
                return None  # changed under us: the caller looks again
        # A dead owner's segment, or an empty one nobody holds locked (its creator died before the header).
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
            return None
        os.unlink(path)
        try:
            return _create_file(path, mode)
        except FileExistsError as exc:
            raise RingExistsError(f"{path} was recreated by another process") from exc
    finally:
        os.close(fd)


def _pid_is_alive(pid: int) -> bool:
    """True unless ``pid`` provably names no process, or a zombie (conservative otherwise).

    A zombie has exited and can never touch the ring again (its pid cannot be
    reused until it is reaped), so it counts as dead: a daemon killed by
    SIGKILL stays a zombie until its parent reaps it, and a restart must not
    wait for that. A process of another user and a reused pid count as alive;
    so does a pid that cannot be a real process, since a header carrying one
    cannot be trusted.  All processes sharing a ring must share a pid
    namespace.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Whether ``/proc/<pid>/stat`` shows state ``Z`` (exited, not yet reaped); False when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except OSError:
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, so the state follows the last ')'.
    return data[data.rfind(b")") + 2:data.rfind(b")") + 3] == b"Z"

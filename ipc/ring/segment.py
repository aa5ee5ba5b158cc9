"""Segment lifecycle: names, creation, mapping and unlinking of ``/dev/shm/<name>``.

Segments are opened with :func:`os.open` plus :mod:`mmap`.
:mod:`multiprocessing.shared_memory` is deliberately not used: on Python 3.11
its resource tracker unlinks a segment when any process that merely attached
to it exits (cpython #82300).  Only the owner (the consumer) creates and
unlinks; producers and observers map an existing segment.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import time

from ringstream.ipc.ring.errors import RingError, RingSpaceError
from ringstream.ipc.ring.layout import (
    HEADER_SIZE,
    HEADER_STRUCT,
    I_CONSUMER_WAITING,
    I_HEADER_SIZE,
    I_PRODUCER_WAITING,
    I_VERSION,
    MAGIC,
    MAGIC_SIZE,
    Q_CAPACITY,
    Q_CREATED_NS,
    Q_INSTANCE_ID,
    Q_OWNER_PID,
    Q_PRODUCER_PID,
    Q_READ_POS,
    Q_WRITE_POS,
    SHM_DIR,
    VERSION,
    valid_capacity,
)
from ringstream.ipc.ring.ordering import header_views
from ringstream.ipc.ring.owner import create_or_reclaim

MAX_NAME_LENGTH = 200
DEFAULT_MODE = 0o600

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG))


def validate_name(name: str) -> None:
    """Check that ``name`` is a usable segment name.

    Names are 1 to 200 characters of ``[A-Za-z0-9._-]`` and start with a
    letter or digit (e.g. ``ringstream-3f2a-w0``), so they can neither escape
    ``/dev/shm`` nor be hidden files.

    Raises:
        TypeError: ``name`` is not a ``str``.
        ValueError: ``name`` is empty, too long or has other characters.
    """
    if not isinstance(name, str):
        raise TypeError(f"ring name must be str, not {type(name).__name__}")
    if not name:
        raise ValueError("ring name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"ring name is {len(name)} characters; the limit is {MAX_NAME_LENGTH}")
    if _NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid ring name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )


def segment_path(name: str) -> str:
    """Return the file system path of segment ``name`` (``/dev/shm/<name>``).

    Raises:
        TypeError, ValueError: as :func:`validate_name`.
    """
    validate_name(name)
    return os.path.join(SHM_DIR, name)


def create_segment(
    path: str, capacity: int, mode: int, instance_id: int, reclaim_stale: bool
) -> tuple[mmap.mmap, tuple[int, int]]:
    """Create the segment at ``path``, write its header and map it read-write.

    The arguments are checked by the caller (:meth:`RingConsumer.create`).
    Returns the mapping and the file's ``(st_dev, st_ino)``, which
    :func:`unlink_segment` compares before removing the name.

    Raises:
        RingSpaceError: ``/dev/shm`` lacks room for the segment.
        RingExistsError: the name exists and was not reclaimed.
        OSError: any other failure of the underlying system calls.
    """
    total = HEADER_SIZE + capacity
    _check_free_space(total)
    fd = create_or_reclaim(path, mode, reclaim_stale)
    try:
        os.fchmod(fd, mode)
        _reserve(fd, total, path)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    try:
        _write_header(mm, capacity, instance_id)
    finally:
        os.close(fd)  # releases the creator's flock: the segment is complete (see ringstream.ipc.ring.owner)
    return mm, (st.st_dev, st.st_ino)


def _write_header(mm: mmap.mmap, capacity: int, instance_id: int) -> None:
    q, i = header_views(mm)
    try:
        q[Q_CAPACITY] = capacity
        q[Q_OWNER_PID] = os.getpid()
        q[Q_PRODUCER_PID] = 0
        q[Q_CREATED_NS] = time.time_ns()
        q[Q_INSTANCE_ID] = instance_id
        q[Q_WRITE_POS] = 0
        q[Q_READ_POS] = 0
        i[I_CONSUMER_WAITING] = 0
        i[I_PRODUCER_WAITING] = 0
        i[I_VERSION] = VERSION
        i[I_HEADER_SIZE] = HEADER_SIZE
    finally:
        q.release()
        i.release()
    # The magic goes last (x86 keeps stores in order): a process that
    # sees it also sees a complete header.
    mm[:MAGIC_SIZE] = MAGIC


def open_segment(path: str, flags: int, access: int) -> tuple[mmap.mmap, int]:
    """Open and map an existing segment after validating its header.

    ``flags`` are the :func:`os.open` access flags, ``access`` the
    :mod:`mmap` protection.  Returns the mapping and the capacity.

    Raises:
        RingError: the file is missing or cannot be opened, is not a ring
            segment of this version, or has a size that does not match its
            header.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise RingError(f"no ring segment at {path}") from exc
    except OSError as exc:
        raise RingError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RingError(f"{path} is not a regular file")
        header = os.pread(fd, HEADER_SIZE, 0)
        if len(header) < HEADER_SIZE or header[:MAGIC_SIZE] != MAGIC:
            raise RingError(f"{path} is not a ringstream ring segment (bad magic)")
        _magic, version, header_size, capacity = HEADER_STRUCT.unpack_from(header)[:4]
        if version != VERSION:
            raise RingError(f"{path} has layout version {version}; expected {VERSION}")
        if header_size != HEADER_SIZE:
            raise RingError(f"{path} has header size {header_size}; expected {HEADER_SIZE}")
        if not valid_capacity(capacity):
            raise RingError(f"{path} has an invalid capacity {capacity}")
        if st.st_size != HEADER_SIZE + capacity:
            raise RingError(
                f"{path} is {st.st_size} bytes; its header says {HEADER_SIZE + capacity}"
            )
        mm = mmap.mmap(fd, HEADER_SIZE + capacity, flags=mmap.MAP_SHARED, prot=access)
    finally:
        os.close(fd)
    return mm, capacity


def unlink_segment(path: str, identity: tuple[int, int]) -> None:
    """Remove ``path`` if it still names the file ``identity`` (``(st_dev, st_ino)``).

    Idempotent; a name removed and reused by someone else is left alone.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        _unlink_quietly(path)


def _check_free_space(total: int) -> None:
    st = os.statvfs(SHM_DIR)
    available = st.f_bavail * st.f_frsize
    if available < total:
        raise RingSpaceError(
            f"{SHM_DIR} has {available} bytes free; the ring needs {total}"
        )


def _reserve(fd: int, total: int, path: str) -> None:
    """Allocate every page of the segment now (tmpfs reserves nothing on
    ftruncate, and touching an unbacked page later raises SIGBUS)."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS:
            raise RingSpaceError(
                f"cannot reserve {total} bytes for {path}: {exc.strerror}"
            ) from exc
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MappedSegment:
    """Owns a segment's mapping and its u64/u32 header views; the base of
    the consumer, producer and observer."""

    _mm: mmap.mmap
    _q: memoryview
    _i: memoryview

    def _init_mapping(self, name: str, path: str, mm: mmap.mmap, capacity: int) -> None:
        self._name = name
        self._path = path
        self._mm = mm
        self._q, self._i = header_views(mm)
        self._capacity = capacity
        self._mask = capacity - 1

    @property
    def name(self) -> str:
        """The segment name."""
        return self._name

    @property
    def path(self) -> str:
        """The segment's path under ``/dev/shm``."""
        return self._path

    @property
    def capacity(self) -> int:
        """Size of the data area in bytes (a power of two)."""
        return self._capacity

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._mm.closed

    def close(self) -> None:
        """Unmap the segment.  Idempotent.  Other methods then raise
        ``ValueError``."""
        if self._mm.closed:
            return
        self._q.release()
        self._i.release()
        self._mm.close()

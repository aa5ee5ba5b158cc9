"""Single-producer/single-consumer byte ring in a POSIX shared-memory segment.

The front process (consumer and owner) creates one ring per worker process;
the worker (producer) appends one record per generated token; observers such
as ``ringstream-top`` map the segment read-only.  This module deals in bytes
and records only: it knows nothing about requests, models or sockets, and it
imports nothing but the standard library.

Segments live in ``/dev/shm/<name>`` and are opened with :func:`os.open` plus
:mod:`mmap`.  :mod:`multiprocessing.shared_memory` is deliberately not used:
on Python 3.11 its resource tracker unlinks a segment when any process that
merely attached to it exits (cpython #82300).

Layout, version 1 (all integers little-endian, offsets in bytes)::

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     8  magic  b"RSRING\\0\\1"
         8     4  version          u32  (= 1)
        12     4  header_size      u32  (= 256)
        16     8  capacity         u64  data bytes, a power of two
        24     8  owner pid        u64
        32     8  producer pid     u64  (0 until a producer attaches)
        40     8  created          u64  time.time_ns() at creation
        48     8  instance id      u64  random, chosen by the owner
        56     8  (reserved, zero)
        64     8  write_pos        u64  own cache line (64..127)
       128     8  read_pos         u64  own cache line (128..191)
       192     4  consumer_waiting u32
       196     4  producer_waiting u32
       200    56  (reserved, zero)
       256   cap  data area

    Record (8-byte aligned, never straddles the end of the data area):

    +0  u32 len       record bytes including this header, before padding
    +4  u16 kind      1 TOKEN, 2 FINISH, 3 ERROR, 0xFFFF PAD
    +6  u16 flags
    +8  u64 handle
    +16 u32 seq
    +20 u32 token_id
    +24 payload       len - 24 bytes, then zero to seven bytes of padding

``write_pos`` and ``read_pos`` are monotonic byte counts, never reduced
modulo the capacity; a position ``p`` lives at data offset
``p & (capacity - 1)``.  Both are always record boundaries.  The free space
seen by the producer is ``capacity - (write_pos - read_pos)``.

When a record does not fit between its position and the end of the data area
the producer first fills that tail with a PAD record (kind 0xFFFF, ``len`` =
tail bytes) and writes the record at offset 0.  A tail shorter than
:data:`RECORD_HEADER_SIZE` holds only the first eight bytes of the PAD header
(``len``, ``kind``, ``flags``); the consumer skips any tail that short without
reading it.

Who writes what::

    field                      written by
    -------------------------  ---------------------------------------------
    magic .. instance id       owner, once, in RingConsumer.create
    producer pid               producer, in RingProducer.attach
    write_pos, data area       producer only (RingProducer.try_write/publish)
    read_pos                   consumer only (RingConsumer.commit)
    consumer_waiting           consumer only (RingConsumer.arm/disarm)
    producer_waiting           producer only (RingProducer.arm_space/disarm_space)
    everything                 never written by RingObserver (PROT_READ map)

Observers.  :meth:`RingObserver.tail` shows the records the consumer has
not committed yet; :meth:`RingObserver.follow` shows every record published
after a cursor, including those the consumer has already committed, as long
as the observer keeps up with the producer (their bytes stay in the data
area until the producer reuses them one lap later).  Neither ever stores to
the segment or makes the producer or consumer wait.

Memory ordering.  The module targets x86-64 (total store order), where a
store is never reordered with an earlier store, a load never with an earlier
load, and a store never moves before an earlier load.  The only reordering
x86 allows, a store followed by a load of a different location, matters for
the doorbell handshake, which therefore uses an explicit full fence (see
:func:`_full_fence`).  Every u64 header field is read and written through an
element of ``memoryview(mm).cast("Q")``: CPython copies such an element with
a fixed-size 8-byte ``memcpy``, which compiles to a single aligned 8-byte
move, so a reader in another process never sees a torn position.
``struct.pack_into`` gives no such guarantee and is used for record bytes
only, which are never read before they are published.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import deque
from typing import NamedTuple

__all__ = [
    "HEADER_SIZE",
    "KIND_ERROR",
    "KIND_FINISH",
    "KIND_PAD",
    "KIND_TOKEN",
    "MAGIC",
    "MAX_CAPACITY",
    "MAX_PAYLOAD",
    "MIN_CAPACITY",
    "RECORD_HEADER_SIZE",
    "SHM_DIR",
    "VERSION",
    "Record",
    "RingConsumer",
    "RingError",
    "RingExistsError",
    "RingObserver",
    "RingProducer",
    "RingSpaceError",
    "segment_path",
    "validate_name",
]

SHM_DIR = "/dev/shm"
MAGIC = b"RSRING\x00\x01"
VERSION = 1
HEADER_SIZE = 256
RECORD_HEADER_SIZE = 24
RECORD_ALIGN = 8
MIN_CAPACITY = 4096
MAX_CAPACITY = 1 << 56
MAX_PAYLOAD = 1 << 16
MAX_NAME_LENGTH = 200
DEFAULT_MODE = 0o600

KIND_TOKEN = 1
KIND_FINISH = 2
KIND_ERROR = 3
KIND_PAD = 0xFFFF
DATA_KINDS = frozenset((KIND_TOKEN, KIND_FINISH, KIND_ERROR))

_U64_LIMIT = 1 << 64
_ALIGN_MASK = RECORD_ALIGN - 1
_MAGIC_SIZE = len(MAGIC)

# Header field indices.  _Q_* index the u64 view, _I_* the u32 view.
_I_VERSION = 8 // 4
_I_HEADER_SIZE = 12 // 4
_Q_CAPACITY = 16 // 8
_Q_OWNER_PID = 24 // 8
_Q_PRODUCER_PID = 32 // 8
_Q_CREATED_NS = 40 // 8
_Q_INSTANCE_ID = 48 // 8
_Q_WRITE_POS = 64 // 8
_Q_READ_POS = 128 // 8
_I_CONSUMER_WAITING = 192 // 4
_I_PRODUCER_WAITING = 196 // 4

# Whole-header decoding for validation before mapping and for observers.
_HEADER_STRUCT = struct.Struct("<8sIIQQQQQ")

_RECORD_STRUCT = struct.Struct("<IHHQII")
_PAD_PREFIX_STRUCT = struct.Struct("<IHH")
assert _RECORD_STRUCT.size == RECORD_HEADER_SIZE

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG))
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_INSPECT_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RECLAIM_ATTEMPTS = 3
_TAIL_ATTEMPTS = 4
_FOLLOW_ATTEMPTS = 4
_UNPUBLISHED_SHARE_DIVISOR = 2
"""RingObserver.follow assumes by default that the producer never holds
more than ``capacity // 2`` bytes written but not yet published."""

_tuple_new = tuple.__new__

# A lock acquire is a locked read-modify-write instruction, which on x86-64 is
# a full memory barrier (the same trick as vLLM's shm_broadcast memory_fence).
_FENCE_LOCK = threading.Lock()


def _full_fence() -> None:
    """Order every earlier load and store before every later one.

    Needed only for the Dekker-style doorbell handshake: one side stores its
    waiting flag (or position) and then loads the other side's position (or
    flag).  Without the fence x86 may perform the load before the store
    becomes visible, both sides would miss each other and both would sleep.
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


class RingError(Exception):
    """A ring segment is missing, malformed, corrupt or used incorrectly."""


class RingSpaceError(RingError):
    """``/dev/shm`` cannot hold the requested segment."""


class RingExistsError(RingError):
    """The segment name is taken and may not be reclaimed.

    Raised when the name is held by a live owner, by another user, by a file
    that is not a ring segment, or by a segment that another process is
    reclaiming at the same moment.
    """


class Record(NamedTuple):
    """One record as returned by :meth:`RingConsumer.read` (and by
    :meth:`RingObserver.tail` and :meth:`RingObserver.follow`).

    ``kind`` is one of :data:`KIND_TOKEN`, :data:`KIND_FINISH` or
    :data:`KIND_ERROR`; ``flags`` is a u16, ``handle`` a u64, ``seq`` and
    ``token_id`` are u32; ``payload`` is a copy of the record's payload.
    """

    kind: int
    flags: int
    handle: int
    seq: int
    token_id: int
    payload: bytes


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


def _record_size(payload_len: int) -> int:
    return (RECORD_HEADER_SIZE + payload_len + _ALIGN_MASK) & ~_ALIGN_MASK


def _validate_capacity(capacity: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be int, not {type(capacity).__name__}")
    if capacity < MIN_CAPACITY or capacity > MAX_CAPACITY or capacity & (capacity - 1):
        raise ValueError(
            f"capacity must be a power of two between {MIN_CAPACITY} and "
            f"{MAX_CAPACITY} bytes, got {capacity}"
        )


def _validate_u64(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be int, not {type(value).__name__}")
    if not 0 <= value < _U64_LIMIT:
        raise ValueError(f"{what} must fit in an unsigned 64-bit integer, got {value}")


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


def _check_free_space(total: int) -> None:
    st = os.statvfs(SHM_DIR)
    available = st.f_bavail * st.f_frsize
    if available < total:
        raise RingSpaceError(
            f"{SHM_DIR} has {available} bytes free; the ring needs {total}"
        )


def _create_file(path: str, mode: int) -> int:
    return os.open(path, _CREATE_FLAGS, mode)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
        if len(header) < HEADER_SIZE or header[:_MAGIC_SIZE] != MAGIC:
            raise RingExistsError(
                f"{path} exists and is not a ringstream ring segment (or another process "
                "is creating it right now); if it is stale, remove it by hand"
            )
        owner_pid = _HEADER_STRUCT.unpack_from(header)[4]
        if _pid_is_alive(owner_pid):
            raise RingExistsError(f"{path} is in use: its owner pid {owner_pid} is alive")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RingExistsError(f"{path} is being reclaimed by another process") from exc
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


def _open_segment(path: str, flags: int, access: int) -> tuple[mmap.mmap, int]:
    """Open and map an existing segment after validating its header.

    Returns the mapping and the capacity.  Raises :class:`RingError` if the
    file is missing, is not a ring segment of this version, or has a size
    that does not match its header.
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
        if len(header) < HEADER_SIZE or header[:_MAGIC_SIZE] != MAGIC:
            raise RingError(f"{path} is not a ringstream ring segment (bad magic)")
        _magic, version, header_size, capacity = _HEADER_STRUCT.unpack_from(header)[:4]
        if version != VERSION:
            raise RingError(f"{path} has layout version {version}; expected {VERSION}")
        if header_size != HEADER_SIZE:
            raise RingError(f"{path} has header size {header_size}; expected {HEADER_SIZE}")
        if capacity < MIN_CAPACITY or capacity > MAX_CAPACITY or capacity & (capacity - 1):
            raise RingError(f"{path} has an invalid capacity {capacity}")
        if st.st_size != HEADER_SIZE + capacity:
            raise RingError(
                f"{path} is {st.st_size} bytes; its header says {HEADER_SIZE + capacity}"
            )
        mm = mmap.mmap(fd, HEADER_SIZE + capacity, flags=mmap.MAP_SHARED, prot=access)
    finally:
        os.close(fd)
    return mm, capacity


def _header_views(mm: mmap.mmap) -> tuple[memoryview, memoryview]:
    with memoryview(mm) as whole:
        header = whole[:HEADER_SIZE]
        u64 = header.cast("Q")
        u32 = header.cast("I")
        header.release()
    return u64, u32


class _Mapped:
    """Owns a mapping and its u64/u32 header views."""

    _mm: mmap.mmap
    _q: memoryview
    _i: memoryview

    def _init_mapping(self, name: str, path: str, mm: mmap.mmap, capacity: int) -> None:
        self._name = name
        self._path = path
        self._mm = mm
        self._q, self._i = _header_views(mm)
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


class RingConsumer(_Mapped):
    """The owning, consuming end of a ring (one per worker, in the front).

    Create it with :meth:`create`.  Typical loop::

        records = ring.read()
        if records:
            handle(records)
            if ring.commit():
                wake_producer()
        elif ring.arm():
            wait_for_doorbell()
            ring.disarm()

    Always :meth:`commit` before :meth:`arm`: a consumer that sleeps on
    uncommitted reads can leave a waiting producer without space forever.
    Not thread-safe: one thread drives a consumer.
    """

    def __init__(
        self, name: str, path: str, mm: mmap.mmap, capacity: int, identity: tuple[int, int]
    ) -> None:
        """Internal; use :meth:`create`."""
        self._init_mapping(name, path, mm, capacity)
        self._identity = identity
        self._cursor = self._q[_Q_READ_POS]
        self._instance_id = self._q[_Q_INSTANCE_ID]

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int,
        *,
        mode: int = DEFAULT_MODE,
        instance_id: int | None = None,
        reclaim_stale: bool = True,
    ) -> RingConsumer:
        """Create segment ``/dev/shm/<name>`` and return its consumer.

        Args:
            name: segment name, see :func:`validate_name`.
            capacity: size of the data area in bytes; a power of two between
                :data:`MIN_CAPACITY` (4096) and :data:`MAX_CAPACITY`.  The
                segment occupies ``HEADER_SIZE + capacity`` bytes of tmpfs.
            mode: permission bits of the segment, applied with ``fchmod`` so
                the umask cannot narrow or widen them.  Observers need read
                permission, the producer read and write permission.
            instance_id: u64 identifying this ring instance; random if None.
            reclaim_stale: if the name already exists and is a ring segment
                of ours whose owner process is dead, delete and recreate it.

        Raises:
            TypeError, ValueError: a malformed argument.
            RingSpaceError: ``/dev/shm`` lacks room for the segment.
            RingExistsError: the name exists and was not reclaimed: a live
                owner holds it, another user owns it, it is not a ring
                segment, ``reclaim_stale`` is false, or another process is
                reclaiming it concurrently.
            OSError: any other failure of the underlying system calls.
        """
        path = segment_path(name)
        _validate_capacity(capacity)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits between 0 and 0o777, got {mode!r}")
        if instance_id is None:
            instance_id = secrets.randbits(64)
        _validate_u64(instance_id, "instance_id")
        total = HEADER_SIZE + capacity
        _check_free_space(total)
        fd = cls._create_or_reclaim(path, mode, reclaim_stale)
        try:
            os.fchmod(fd, mode)
            _reserve(fd, total, path)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        q, i = _header_views(mm)
        try:
            q[_Q_CAPACITY] = capacity
            q[_Q_OWNER_PID] = os.getpid()
            q[_Q_PRODUCER_PID] = 0
            q[_Q_CREATED_NS] = time.time_ns()
            q[_Q_INSTANCE_ID] = instance_id
            q[_Q_WRITE_POS] = 0
            q[_Q_READ_POS] = 0
            i[_I_CONSUMER_WAITING] = 0
            i[_I_PRODUCER_WAITING] = 0
            i[_I_VERSION] = VERSION
            i[_I_HEADER_SIZE] = HEADER_SIZE
        finally:
            q.release()
            i.release()
        # The magic goes last (x86 keeps stores in order): a process that
        # sees it also sees a complete header.
        mm[:_MAGIC_SIZE] = MAGIC
        return cls(name, path, mm, capacity, (st.st_dev, st.st_ino))

    @staticmethod
    def _create_or_reclaim(path: str, mode: int, reclaim_stale: bool) -> int:
        for _attempt in range(_RECLAIM_ATTEMPTS):
            try:
                return _create_file(path, mode)
            except FileExistsError as exc:
                if not reclaim_stale:
                    raise RingExistsError(f"{path} already exists") from exc
            fd = _reclaim(path, mode)
            if fd is not None:
                return fd
        raise RingExistsError(f"{path} keeps changing under us; giving up")

    @property
    def instance_id(self) -> int:
        """The u64 instance id stored in the header."""
        return self._instance_id

    def read(self, max_records: int | None = None) -> list[Record]:
        """Return records published since the previous read, oldest first.

        PAD records are skipped.  Only the consumer's local cursor advances;
        the space stays reserved until :meth:`commit`.

        Args:
            max_records: return at most this many records (None: all).

        Raises:
            ValueError: ``max_records`` is negative, or the ring is closed.
            RingError: the producer wrote something that is not a valid
                record or a position that is impossible (a protocol breach).
        """
        if max_records is None:
            limit = -1
        elif max_records > 0:
            limit = max_records
        elif max_records == 0:
            return []
        else:
            raise ValueError(f"max_records must be >= 0, got {max_records}")
        end = self._q[_Q_WRITE_POS]
        cursor = self._cursor
        if end == cursor:
            return []
        capacity = self._capacity
        if end < cursor or end - cursor > capacity:
            raise RingError(
                f"{self._path}: write_pos {end} is impossible for read cursor {cursor}"
            )
        mm = self._mm
        mask = self._mask
        unpack = _RECORD_STRUCT.unpack_from
        out: list[Record] = []
        append = out.append
        while cursor < end:
            offset = cursor & mask
            room = capacity - offset
            if room < RECORD_HEADER_SIZE:
                cursor += room
                continue
            start = HEADER_SIZE + offset
            length, kind, flags, handle, seq, token_id = unpack(mm, start)
            if kind == KIND_PAD:
                if length != room:
                    raise RingError(f"{self._path}: PAD record of {length} bytes at {cursor}")
                cursor += room
                continue
            size = (length + _ALIGN_MASK) & ~_ALIGN_MASK
            if (
                length < RECORD_HEADER_SIZE
                or size > room
                or cursor + size > end
                or kind not in DATA_KINDS
            ):
                raise RingError(
                    f"{self._path}: bad record (length {length}, kind {kind}) at {cursor}"
                )
            payload = mm[start + RECORD_HEADER_SIZE : start + length]
            append(_tuple_new(Record, (kind, flags, handle, seq, token_id, payload)))
            cursor += size
            if len(out) == limit:
                break
        self._cursor = cursor
        return out

    def commit(self) -> bool:
        """Release everything returned by :meth:`read` to the producer.

        Stores ``read_pos`` = the local cursor, issues a full fence and then
        loads ``producer_waiting``.

        Returns:
            True if the producer is waiting for space: the caller must then
            ring the producer's doorbell.
        """
        # x86: the loads that copied the records precede this store, so the
        # producer cannot reuse the space before those copies are complete.
        self._q[_Q_READ_POS] = self._cursor
        _full_fence()
        return self._i[_I_PRODUCER_WAITING] != 0

    def arm(self) -> bool:
        """Announce that the consumer is about to sleep on its doorbell.

        Sets ``consumer_waiting``, fences, then reloads ``write_pos``.  If
        records were published in between, clears the flag again.

        Returns:
            True if nothing is pending and the caller should sleep until the
            producer rings the doorbell (then call :meth:`disarm`); False if
            records are pending and the caller should :meth:`read` instead.
        """
        self._i[_I_CONSUMER_WAITING] = 1
        # Dekker handshake with RingProducer.publish: store flag, fence, load
        # write_pos here; store write_pos, fence, load flag there.  At least
        # one side sees the other's store, so a wake-up is never lost.
        _full_fence()
        if self._q[_Q_WRITE_POS] != self._cursor:
            self._i[_I_CONSUMER_WAITING] = 0
            return False
        return True

    def disarm(self) -> None:
        """Clear ``consumer_waiting`` (call after waking up)."""
        self._i[_I_CONSUMER_WAITING] = 0

    def pending_bytes(self) -> int:
        """Bytes published by the producer but not yet returned by
        :meth:`read` (record bytes, padding and PAD records included)."""
        return self._q[_Q_WRITE_POS] - self._cursor

    def fill(self) -> float:
        """Fraction (0..1) of the data area holding published records that
        have not been committed, i.e. space the producer cannot reuse."""
        return (self._q[_Q_WRITE_POS] - self._q[_Q_READ_POS]) / self._capacity

    def unlink(self) -> None:
        """Remove the segment from ``/dev/shm``.  Idempotent.

        Only the owner calls this.  Mapped processes keep their mapping; the
        memory is freed when the last one unmaps.  If the name no longer
        refers to the file this consumer created (it was removed and the name
        reused), nothing is removed.
        """
        try:
            st = os.stat(self._path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            _unlink_quietly(self._path)

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the mapping and unlink the segment (the owner is done)."""
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        return f"RingConsumer(name={self._name!r}, capacity={self._capacity})"


class RingProducer(_Mapped):
    """The writing end of a ring (the worker process).

    Attach with :meth:`attach`.  Records written with :meth:`try_write` stay
    invisible until :meth:`publish`.  Typical loop::

        while not ring.try_write(KIND_TOKEN, 0, handle, seq, token, payload):
            if ring.publish():
                wake_consumer()
            if ring.arm_space(ring.record_size(len(payload))):
                wait_for_doorbell()
            ring.disarm_space()
        ...
        if ring.publish():
            wake_consumer()

    Publish before waiting for space: the consumer can only free space it
    has seen.  Exactly one producer may be attached at a time; the owner
    enforces that.  Not thread-safe: one thread drives a producer.
    """

    def __init__(self, name: str, path: str, mm: mmap.mmap, capacity: int) -> None:
        """Internal; use :meth:`attach`."""
        self._init_mapping(name, path, mm, capacity)
        self._write_cursor = self._q[_Q_WRITE_POS]
        self._read_cache = self._q[_Q_READ_POS]
        self._max_payload = min(MAX_PAYLOAD, capacity - RECORD_HEADER_SIZE)
        if not 0 <= self._write_cursor - self._read_cache <= capacity:
            self.close()
            raise RingError(
                f"{path}: write_pos {self._write_cursor} and read_pos "
                f"{self._read_cache} are inconsistent"
            )

    @classmethod
    def attach(cls, name: str, *, instance_id: int | None = None) -> RingProducer:
        """Map an existing segment read-write and register as its producer.

        Writing continues at the published ``write_pos``; the caller's pid is
        stored in the header's producer pid field.

        Args:
            name: segment name, see :func:`validate_name`.
            instance_id: if given, the header's instance id must equal it.

        Raises:
            TypeError, ValueError: a malformed name or instance id.
            RingError: no such segment, no read-write access, a header that
                is not a version-1 ring header, a size that does not match
                the header, or a different instance id.
        """
        path = segment_path(name)
        if instance_id is not None:
            _validate_u64(instance_id, "instance_id")
        mm, capacity = _open_segment(path, os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE)
        ring = cls(name, path, mm, capacity)
        if instance_id is not None and ring._q[_Q_INSTANCE_ID] != instance_id:
            found = ring._q[_Q_INSTANCE_ID]
            ring.close()
            raise RingError(f"{path} has instance id {found:#x}; expected {instance_id:#x}")
        ring._q[_Q_PRODUCER_PID] = os.getpid()
        return ring

    @property
    def instance_id(self) -> int:
        """The u64 instance id stored in the header."""
        return self._q[_Q_INSTANCE_ID]

    @property
    def max_payload(self) -> int:
        """Largest payload :meth:`try_write` accepts on this ring, in bytes:
        ``min(MAX_PAYLOAD, capacity - RECORD_HEADER_SIZE)``."""
        return self._max_payload

    @staticmethod
    def record_size(payload_len: int) -> int:
        """Bytes a record with a ``payload_len``-byte payload occupies in the
        ring (header plus payload, rounded up to 8)."""
        return _record_size(payload_len)

    def _load_read_pos(self) -> int:
        read_pos = self._q[_Q_READ_POS]
        if read_pos > self._write_cursor or self._write_cursor - read_pos > self._capacity:
            raise RingError(
                f"{self._path}: read_pos {read_pos} is impossible for write cursor "
                f"{self._write_cursor}"
            )
        self._read_cache = read_pos
        return read_pos

    def try_write(
        self,
        kind: int,
        flags: int,
        handle: int,
        seq: int,
        token_id: int,
        payload: bytes = b"",
    ) -> bool:
        """Append one record if there is room; it becomes visible at the next
        :meth:`publish`.

        A record never straddles the end of the data area: if it does not
        fit in the tail, the tail is first filled with a PAD record.  The PAD
        is written as soon as the tail is free, even if the record itself
        must still wait; otherwise a record larger than the space before
        the wrap point plus the space after it could never be written.

        Args:
            kind: :data:`KIND_TOKEN`, :data:`KIND_FINISH` or :data:`KIND_ERROR`.
            flags: u16.  handle: u64.  seq: u32.  token_id: u32.
            payload: bytes-like, at most :attr:`max_payload` bytes.

        Returns:
            True if the record was written; False if there is not enough
            free space, in which case no record was written (only a PAD may
            have been) and nothing already in the ring was touched.

        Raises:
            ValueError: unknown kind, oversized payload or a field out of
                range (also when the ring is closed).
            RingError: the consumer's ``read_pos`` is impossible.
        """
        if self._mm.closed:
            raise ValueError(f"{self._path}: the ring is closed")
        payload_len = len(payload)
        if payload_len > self._max_payload:
            raise ValueError(
                f"payload of {payload_len} bytes exceeds the limit of {self._max_payload}"
            )
        if kind not in DATA_KINDS:
            raise ValueError(f"record kind must be TOKEN, FINISH or ERROR, got {kind!r}")
        length = RECORD_HEADER_SIZE + payload_len
        size = (length + _ALIGN_MASK) & ~_ALIGN_MASK
        capacity = self._capacity
        position = self._write_cursor
        offset = position & self._mask
        room = capacity - offset
        if size > room:
            if position + room - self._read_cache > capacity:
                if position + room - self._load_read_pos() > capacity:
                    return False
            self._write_pad(offset, room)
            position += room
            offset = 0
            self._write_cursor = position
        if position + size - self._read_cache > capacity:
            if position + size - self._load_read_pos() > capacity:
                return False
        start = HEADER_SIZE + offset
        try:
            _RECORD_STRUCT.pack_into(self._mm, start, length, kind, flags, handle, seq, token_id)
        except struct.error as exc:
            raise ValueError(f"record field out of range: {exc}") from exc
        if payload_len:
            self._mm[start + RECORD_HEADER_SIZE : start + length] = payload
        self._write_cursor = position + size
        return True

    def _write_pad(self, offset: int, room: int) -> None:
        start = HEADER_SIZE + offset
        if room >= RECORD_HEADER_SIZE:
            _RECORD_STRUCT.pack_into(self._mm, start, room, KIND_PAD, 0, 0, 0, 0)
        else:
            _PAD_PREFIX_STRUCT.pack_into(self._mm, start, room, KIND_PAD, 0)

    def publish(self) -> bool:
        """Make every record written so far visible to the consumer at once.

        Stores ``write_pos``, issues a full fence, then loads
        ``consumer_waiting``.

        Returns:
            True if the consumer is sleeping on its doorbell: the caller must
            then ring it.
        """
        # x86: the record bytes were stored before this store and stores are
        # not reordered, so a consumer that sees write_pos sees the records.
        self._q[_Q_WRITE_POS] = self._write_cursor
        _full_fence()
        return self._i[_I_CONSUMER_WAITING] != 0

    def arm_space(self, nbytes: int) -> bool:
        """Announce that the producer is about to sleep until ``nbytes`` of
        space are free.

        Pass ``record_size(len(payload))`` of the record :meth:`try_write`
        refused: once that much is free the retry makes progress (it writes
        the record, or at least the PAD in front of a wrapping record, since
        such a PAD is always smaller than the record), and a drained ring
        always has that much.

        Sets ``producer_waiting``, fences, then reloads ``read_pos``.

        Returns:
            True if the space is still missing and the caller should sleep
            until the consumer rings the doorbell (then call
            :meth:`disarm_space`); False, with the flag cleared again, if the
            space is free now.

        Raises:
            ValueError: ``nbytes`` is not between 1 and the capacity.
            RingError: the consumer's ``read_pos`` is impossible.
        """
        if not 0 < nbytes <= self._capacity:
            raise ValueError(f"nbytes must be between 1 and {self._capacity}, got {nbytes}")
        self._i[_I_PRODUCER_WAITING] = 1
        # Dekker handshake with RingConsumer.commit (see RingConsumer.arm).
        _full_fence()
        if self._capacity - (self._write_cursor - self._load_read_pos()) >= nbytes:
            self._i[_I_PRODUCER_WAITING] = 0
            return False
        return True

    def disarm_space(self) -> None:
        """Clear ``producer_waiting`` (call after waking up)."""
        self._i[_I_PRODUCER_WAITING] = 0

    def free_bytes(self) -> int:
        """Bytes the producer may still write, counting records written but
        not yet published as used."""
        return self._capacity - (self._write_cursor - self._load_read_pos())

    def __enter__(self) -> RingProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the mapping; the segment itself is left alone."""
        self.close()

    def __repr__(self) -> str:
        return f"RingProducer(name={self._name!r}, capacity={self._capacity})"


class RingObserver(_Mapped):
    """A read-only view of a ring for monitoring (``ringstream-top``).

    The segment is opened ``O_RDONLY`` and mapped ``PROT_READ``: the observer
    needs only read permission, cannot write, never unlinks and never makes
    the producer or consumer wait.
    """

    def __init__(self, name: str, path: str, mm: mmap.mmap, capacity: int) -> None:
        """Internal; use :meth:`attach`."""
        self._init_mapping(name, path, mm, capacity)

    @classmethod
    def attach(cls, name: str) -> RingObserver:
        """Map segment ``name`` read-only.

        Raises:
            TypeError, ValueError: a malformed name.
            RingError: no such segment, no read access, or a header that is
                not a version-1 ring header.
        """
        path = segment_path(name)
        mm, capacity = _open_segment(path, os.O_RDONLY, mmap.PROT_READ)
        return cls(name, path, mm, capacity)

    def header(self) -> dict[str, int | float]:
        """Return a snapshot of the header.

        Keys: ``version``, ``header_size``, ``capacity``, ``owner_pid``,
        ``producer_pid``, ``created_ns`` (ns since the epoch),
        ``instance_id``, ``write_pos``, ``read_pos`` (byte counts),
        ``consumer_waiting``, ``producer_waiting`` (0 or 1), ``pending_bytes``
        (published, not committed) and ``fill`` (``pending_bytes`` /
        capacity, 0..1).  The fields are read one by one while the ring runs,
        so they are individually, not jointly, consistent.
        """
        q = self._q
        i = self._i
        read_pos = q[_Q_READ_POS]
        write_pos = q[_Q_WRITE_POS]
        pending = min(max(write_pos - read_pos, 0), self._capacity)
        return {
            "version": i[_I_VERSION],
            "header_size": i[_I_HEADER_SIZE],
            "capacity": q[_Q_CAPACITY],
            "owner_pid": q[_Q_OWNER_PID],
            "producer_pid": q[_Q_PRODUCER_PID],
            "created_ns": q[_Q_CREATED_NS],
            "instance_id": q[_Q_INSTANCE_ID],
            "write_pos": write_pos,
            "read_pos": read_pos,
            "consumer_waiting": i[_I_CONSUMER_WAITING],
            "producer_waiting": i[_I_PRODUCER_WAITING],
            "pending_bytes": pending,
            "fill": pending / self._capacity,
        }

    def tail(self, n: int) -> list[Record]:
        """Return up to the last ``n`` published records not yet consumed.

        Record boundaries are only known from ``read_pos`` onward, so records
        the consumer has already committed cannot be shown.  The walk runs
        from a snapshot of ``read_pos`` to a snapshot of ``write_pos``; then
        ``read_pos`` is loaded again and every record before it is dropped,
        because the producer may have reused its bytes while they were being
        copied.  If the walk stumbled over such reused bytes it is retried a
        few times; the result may therefore be shorter than ``n``.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 0:
            return []
        found: list[tuple[int, Record]] = []
        for _attempt in range(_TAIL_ATTEMPTS):
            start = self._q[_Q_READ_POS]
            end = self._q[_Q_WRITE_POS]
            window, stopped_at = self._walk(start, end, n)
            copies = [(position, self._copy(position, header)) for position, header in window]
            oldest_intact = self._q[_Q_READ_POS]
            found = [item for item in copies if item[0] >= oldest_intact]
            if stopped_at is None or stopped_at >= oldest_intact:
                break
        return [record for _position, record in found]

    def follow(
        self,
        cursor: int | None = None,
        *,
        max_records: int | None = None,
        unpublished_bytes: int | None = None,
    ) -> tuple[list[Record], int, bool]:
        """Return the records published after ``cursor``, oldest first.

        Pass ``cursor=None`` to start at the current ``read_pos`` (the oldest
        record the consumer has not committed), then pass back the cursor
        each call returns.  Unlike :meth:`tail`, this also returns records
        the consumer has already committed: their bytes stay intact until the
        producer writes one full lap (``capacity`` bytes) past them, so an
        observer that calls often enough sees every record exactly once.
        PAD records are skipped.

        Overwrite detection.  The producer stores a record's bytes before it
        publishes ``write_pos``, and it may reuse position ``p`` as soon as it
        writes at ``p + capacity``.  Its (private) write cursor never exceeds
        ``read_pos + capacity``, nor, as long as it keeps at most
        ``unpublished_bytes`` written but unpublished, ``write_pos +
        unpublished_bytes``.  Every byte at or after the *horizon*
        ``min(read_pos, write_pos + unpublished_bytes - capacity)`` is
        therefore intact.  ``follow`` loads both positions, copies the
        records from the cursor to ``write_pos``, then loads the positions
        again: if the cursor is behind the new horizon, the copies may hold
        reused bytes and are all discarded (the position of each record comes
        from the header before it, so one damaged header misplaces every
        later record).  Whenever the cursor is behind the horizon, before or
        after copying, the observer was *lapped*: it resynchronises to the
        current ``read_pos`` (always a record boundary) and continues from
        there; the records in between are lost to it.

        Args:
            cursor: a byte position returned by an earlier call on this ring,
                or None to start at ``read_pos``.
            max_records: return at most this many records (None: all); the
                returned cursor then points after the last one returned.
            unpublished_bytes: the most bytes the producer holds written but
                unpublished, between 0 and ``capacity``; None means
                ``capacity // 2``.  Larger values are safer and make lapping
                likelier; ``capacity`` trusts only bytes at or after
                ``read_pos``.

        Returns:
            ``(records, cursor, lapped)``: the records, the cursor to pass
            next time (a byte position, a record boundary), and True if
            records between the given cursor and the first returned record
            were lost because the producer reused their bytes first.

        Raises:
            TypeError: ``cursor``, ``max_records`` or ``unpublished_bytes`` is
                not an int.
            ValueError: a negative ``max_records``, ``unpublished_bytes``
                outside ``0..capacity``, a cursor ahead of ``write_pos`` (not
                a cursor of this ring), or the ring is closed.
            RingError: intact bytes do not form valid records (the cursor
                is not a record boundary, or the producer breached the
                protocol).
        """
        if cursor is not None:
            _validate_u64(cursor, "cursor")
        if max_records is None:
            limit = -1
        elif isinstance(max_records, bool) or not isinstance(max_records, int):
            raise TypeError(f"max_records must be int, not {type(max_records).__name__}")
        elif max_records < 0:
            raise ValueError(f"max_records must be >= 0, got {max_records}")
        else:
            limit = max_records
        if unpublished_bytes is None:
            unpublished_bytes = self._capacity // _UNPUBLISHED_SHARE_DIVISOR
        elif isinstance(unpublished_bytes, bool) or not isinstance(unpublished_bytes, int):
            raise TypeError(
                f"unpublished_bytes must be int, not {type(unpublished_bytes).__name__}"
            )
        elif not 0 <= unpublished_bytes <= self._capacity:
            raise ValueError(
                f"unpublished_bytes must be between 0 and {self._capacity}, "
                f"got {unpublished_bytes}"
            )
        slack = unpublished_bytes - self._capacity
        q = self._q
        # read_pos before write_pos: read_pos <= write_pos holds for any
        # read_pos loaded earlier, so a fresh cursor never passes the end.
        read_pos = q[_Q_READ_POS]
        end = q[_Q_WRITE_POS]
        if cursor is None:
            cursor = read_pos
        elif cursor > end:
            raise ValueError(
                f"{self._path}: cursor {cursor} is ahead of write_pos {end}; "
                "it is not a cursor of this ring"
            )
        lapped = False
        for _attempt in range(_FOLLOW_ATTEMPTS):
            if cursor < min(read_pos, end + slack):
                lapped = True
                cursor = read_pos
            if limit == 0:
                return [], cursor, lapped
            found, after, invalid_at = self._collect(cursor, end, limit)
            read_pos = q[_Q_READ_POS]
            end = q[_Q_WRITE_POS]
            if cursor >= min(read_pos, end + slack):
                if invalid_at is not None:
                    raise RingError(
                        f"{self._path}: no valid record at position {invalid_at} "
                        "(not a record boundary, or a corrupt ring)"
                    )
                return found, after, lapped
            lapped = True
            cursor = read_pos
        return [], cursor, lapped

    def _collect(
        self, position: int, end: int, limit: int
    ) -> tuple[list[Record], int, int | None]:
        """Copy up to ``limit`` (-1: all) records in [position, end).

        Returns the records, the position where the walk stopped (after the
        last record or PAD it passed, or at an invalid header), and the
        position of an invalid header that stopped the walk (None if none
        did).  The copies are trustworthy only if ``position`` is still at
        or after the horizon once they are made (see :meth:`follow`).
        """
        capacity = self._capacity
        mask = self._mask
        mm = self._mm
        unpack = _RECORD_STRUCT.unpack_from
        out: list[Record] = []
        append = out.append
        while position < end and len(out) != limit:
            offset = position & mask
            room = capacity - offset
            if room < RECORD_HEADER_SIZE:
                position += room
                continue
            start = HEADER_SIZE + offset
            length, kind, flags, handle, seq, token_id = unpack(mm, start)
            if kind == KIND_PAD and length == room:
                position += room
                continue
            size = (length + _ALIGN_MASK) & ~_ALIGN_MASK
            if (
                kind not in DATA_KINDS
                or length < RECORD_HEADER_SIZE
                or size > room
                or position + size > end
            ):
                return out, position, position
            payload = mm[start + RECORD_HEADER_SIZE : start + length]
            append(_tuple_new(Record, (kind, flags, handle, seq, token_id, payload)))
            position += size
        return out, position, None

    def _walk(
        self, position: int, end: int, n: int
    ) -> tuple[deque[tuple[int, tuple[int, ...]]], int | None]:
        """Collect (position, header) of the last ``n`` records in
        [position, end).  Returns them and the position where an invalid
        header stopped the walk (None if it reached ``end``)."""
        capacity = self._capacity
        mask = self._mask
        mm = self._mm
        window: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=n)
        if end < position or end - position > capacity:
            return window, position
        while position < end:
            offset = position & mask
            room = capacity - offset
            if room < RECORD_HEADER_SIZE:
                position += room
                continue
            header = _RECORD_STRUCT.unpack_from(mm, HEADER_SIZE + offset)
            length, kind = header[0], header[1]
            if kind == KIND_PAD and length == room:
                position += room
                continue
            size = (length + _ALIGN_MASK) & ~_ALIGN_MASK
            if (
                kind not in DATA_KINDS
                or length < RECORD_HEADER_SIZE
                or size > room
                or position + size > end
            ):
                return window, position
            window.append((position, header))
            position += size
        return window, None

    def _copy(self, position: int, header: tuple[int, ...]) -> Record:
        length, kind, flags, handle, seq, token_id = header
        start = HEADER_SIZE + (position & self._mask)
        payload = self._mm[start + RECORD_HEADER_SIZE : start + length]
        return _tuple_new(Record, (kind, flags, handle, seq, token_id, payload))

    def __enter__(self) -> RingObserver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the mapping."""
        self.close()

    def __repr__(self) -> str:
        return f"RingObserver(name={self._name!r}, capacity={self._capacity})"

"""The consuming end of a ring: the owner, which creates, reads, commits and unlinks it."""

from __future__ import annotations

import mmap
import secrets

from ringstream.ipc.ring.errors import RingError
from ringstream.ipc.ring.layout import (
    HEADER_SIZE,
    I_CONSUMER_WAITING,
    I_PRODUCER_WAITING,
    KIND_PAD,
    PAD_PREFIX_STRUCT,
    Q_INSTANCE_ID,
    Q_READ_POS,
    Q_WRITE_POS,
    Record,
    validate_capacity,
    validate_u64,
)
from ringstream.ipc.ring.ordering import full_fence
from ringstream.ipc.ring.segment import (
    DEFAULT_MODE,
    MappedSegment,
    create_segment,
    segment_path,
    unlink_segment,
)
from ringstream.ipc.ring.walk import walk


class RingConsumer(MappedSegment):
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
        self._cursor = self._q[Q_READ_POS]
        self._instance_id = self._q[Q_INSTANCE_ID]

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
        validate_capacity(capacity)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits between 0 and 0o777, got {mode!r}")
        if instance_id is None:
            instance_id = secrets.randbits(64)
        validate_u64(instance_id, "instance_id")
        mm, identity = create_segment(path, capacity, mode, instance_id, reclaim_stale)
        return cls(name, path, mm, capacity, identity)

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
        end = self._q[Q_WRITE_POS]
        cursor = self._cursor
        if end == cursor:
            return []
        if end < cursor or end - cursor > self._capacity:
            raise RingError(
                f"{self._path}: write_pos {end} is impossible for read cursor {cursor}"
            )
        records, cursor, invalid_at = walk(self._mm, self._capacity, cursor, end, limit)
        if invalid_at is not None:
            raise self._breach(invalid_at)
        self._cursor = cursor
        return records

    def _breach(self, position: int) -> RingError:
        """The error for the invalid record header at ``position``."""
        length, kind, _flags = PAD_PREFIX_STRUCT.unpack_from(
            self._mm, HEADER_SIZE + (position & self._mask)
        )
        if kind == KIND_PAD:
            return RingError(f"{self._path}: PAD record of {length} bytes at {position}")
        return RingError(f"{self._path}: bad record (length {length}, kind {kind}) at {position}")

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
        self._q[Q_READ_POS] = self._cursor
        full_fence()
        return self._i[I_PRODUCER_WAITING] != 0

    def arm(self) -> bool:
        """Announce that the consumer is about to sleep on its doorbell.

        Sets ``consumer_waiting``, fences, then reloads ``write_pos``.  If
        records were published in between, clears the flag again.

        Returns:
            True if nothing is pending and the caller should sleep until the
            producer rings the doorbell (then call :meth:`disarm`); False if
            records are pending and the caller should :meth:`read` instead.
        """
        self._i[I_CONSUMER_WAITING] = 1
        # Dekker handshake with RingProducer.publish: store flag, fence, load
        # write_pos here; store write_pos, fence, load flag there.  At least
        # one side sees the other's store, so a wake-up is never lost.
        full_fence()
        if self._q[Q_WRITE_POS] != self._cursor:
            self._i[I_CONSUMER_WAITING] = 0
            return False
        return True

    def disarm(self) -> None:
        """Clear ``consumer_waiting`` (call after waking up)."""
        self._i[I_CONSUMER_WAITING] = 0

    def pending_bytes(self) -> int:
        """Bytes published by the producer but not yet returned by
        :meth:`read` (record bytes, padding and PAD records included)."""
        return self._q[Q_WRITE_POS] - self._cursor

    def fill(self) -> float:
        """Fraction (0..1) of the data area holding published records that
        have not been committed, i.e. space the producer cannot reuse."""
        return (self._q[Q_WRITE_POS] - self._q[Q_READ_POS]) / self._capacity

    def unlink(self) -> None:
        """Remove the segment from ``/dev/shm``.  Idempotent.

        Only the owner calls this.  Mapped processes keep their mapping; the
        memory is freed when the last one unmaps.  If the name no longer
        refers to the file this consumer created (it was removed and the name
        reused), nothing is removed.
        """
        unlink_segment(self._path, self._identity)

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the mapping and unlink the segment (the owner is done)."""
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        return f"RingConsumer(name={self._name!r}, capacity={self._capacity})"

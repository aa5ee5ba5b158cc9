"""The producing end of a ring: the worker, which appends records and publishes them."""

from __future__ import annotations

import mmap
import os
import struct

from ringstream.ipc.ring.errors import RingError
from ringstream.ipc.ring.layout import (
    ALIGN_MASK,
    DATA_KINDS,
    HEADER_SIZE,
    I_CONSUMER_WAITING,
    I_PRODUCER_WAITING,
    KIND_PAD,
    MAX_PAYLOAD,
    PAD_PREFIX_STRUCT,
    Q_INSTANCE_ID,
    Q_PRODUCER_PID,
    Q_READ_POS,
    Q_WRITE_POS,
    RECORD_HEADER_SIZE,
    RECORD_STRUCT,
    record_size,
    validate_u64,
)
from ringstream.ipc.ring.ordering import full_fence
from ringstream.ipc.ring.segment import MappedSegment, open_segment, segment_path

# Bound once, here: CPython compiles a method call on an imported name to an
# attribute load that builds a bound method on every call (try_write is hot).
_pack_record = RECORD_STRUCT.pack_into
_pack_pad_prefix = PAD_PREFIX_STRUCT.pack_into

class RingProducer(MappedSegment):
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
        self._write_cursor = self._q[Q_WRITE_POS]
        self._read_cache = self._q[Q_READ_POS]
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
            validate_u64(instance_id, "instance_id")
        mm, capacity = open_segment(path, os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE)
        ring = cls(name, path, mm, capacity)
        if instance_id is not None and ring._q[Q_INSTANCE_ID] != instance_id:
            found = ring._q[Q_INSTANCE_ID]
            ring.close()
            raise RingError(f"{path} has instance id {found:#x}; expected {instance_id:#x}")
        ring._q[Q_PRODUCER_PID] = os.getpid()
        return ring

    @property
    def instance_id(self) -> int:
        """The u64 instance id stored in the header."""
        return self._q[Q_INSTANCE_ID]

    @property
    def max_payload(self) -> int:
        """Largest payload :meth:`try_write` accepts on this ring, in bytes:
        ``min(MAX_PAYLOAD, capacity - RECORD_HEADER_SIZE)``."""
        return self._max_payload

    @staticmethod
    def record_size(payload_len: int) -> int:
        """Bytes a record with a ``payload_len``-byte payload occupies in the
        ring (header plus payload, rounded up to 8)."""
        return record_size(payload_len)

    def _load_read_pos(self) -> int:
        read_pos = self._q[Q_READ_POS]
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
        size = (length + ALIGN_MASK) & ~ALIGN_MASK
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
            _pack_record(self._mm, start, length, kind, flags, handle, seq, token_id)
        except struct.error as exc:
            raise ValueError(f"record field out of range: {exc}") from exc
        if payload_len:
            self._mm[start + RECORD_HEADER_SIZE : start + length] = payload
        self._write_cursor = position + size
        return True

    def _write_pad(self, offset: int, room: int) -> None:
        start = HEADER_SIZE + offset
        if room >= RECORD_HEADER_SIZE:
            _pack_record(self._mm, start, room, KIND_PAD, 0, 0, 0, 0)
        else:
            _pack_pad_prefix(self._mm, start, room, KIND_PAD, 0)

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
        self._q[Q_WRITE_POS] = self._write_cursor
        full_fence()
        return self._i[I_CONSUMER_WAITING] != 0

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
        self._i[I_PRODUCER_WAITING] = 1
        # Dekker handshake with RingConsumer.commit (see RingConsumer.arm).
        full_fence()
        if self._capacity - (self._write_cursor - self._load_read_pos()) >= nbytes:
            self._i[I_PRODUCER_WAITING] = 0
            return False
        return True

    def disarm_space(self) -> None:
        """Clear ``producer_waiting`` (call after waking up)."""
        self._i[I_PRODUCER_WAITING] = 0

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

"""The read-only end of a ring: observers such as ``ringstream-top`` inspect it without changing it.

:meth:`RingObserver.tail` shows the records the consumer has not committed
yet; :meth:`RingObserver.follow` shows every record published after a
cursor, including those the consumer has already committed, as long as the
observer keeps up with the producer (their bytes stay in the data area until
the producer reuses them one lap later).  Neither ever stores to the segment
or makes the producer or consumer wait.
"""

from __future__ import annotations

import mmap
import os

from ringstream.ipc.ring.errors import RingError
from ringstream.ipc.ring.layout import (
    I_CONSUMER_WAITING,
    I_HEADER_SIZE,
    I_PRODUCER_WAITING,
    I_VERSION,
    Q_CAPACITY,
    Q_CREATED_NS,
    Q_INSTANCE_ID,
    Q_OWNER_PID,
    Q_PRODUCER_PID,
    Q_READ_POS,
    Q_WRITE_POS,
    Record,
    validate_u64,
)
from ringstream.ipc.ring.segment import MappedSegment, open_segment, segment_path
from ringstream.ipc.ring.walk import walk

_TAIL_ATTEMPTS = 4
_FOLLOW_ATTEMPTS = 4
_UNPUBLISHED_SHARE_DIVISOR = 2
"""RingObserver.follow assumes by default that the producer never holds
more than ``capacity // 2`` bytes written but not yet published."""


def _record_limit(max_records: int | None) -> int:
    """Check ``max_records`` of :meth:`RingObserver.follow`; return it, -1 for None.

    Raises:
        TypeError: not an int.
        ValueError: negative.
    """
    if max_records is None:
        return -1
    if isinstance(max_records, bool) or not isinstance(max_records, int):
        raise TypeError(f"max_records must be int, not {type(max_records).__name__}")
    if max_records < 0:
        raise ValueError(f"max_records must be >= 0, got {max_records}")
    return max_records


def _horizon(read_pos: int, write_pos: int, slack: int) -> int:
    """The oldest byte position still intact (:meth:`RingObserver.follow`).

    ``min(read_pos, write_pos + unpublished_bytes - capacity)``, given
    ``slack = unpublished_bytes - capacity``.
    """
    return min(read_pos, write_pos + slack)


class RingObserver(MappedSegment):
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
        mm, capacity = open_segment(path, os.O_RDONLY, mmap.PROT_READ)
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
        read_pos = q[Q_READ_POS]
        write_pos = q[Q_WRITE_POS]
        pending = min(max(write_pos - read_pos, 0), self._capacity)
        return {
            "version": i[I_VERSION],
            "header_size": i[I_HEADER_SIZE],
            "capacity": q[Q_CAPACITY],
            "owner_pid": q[Q_OWNER_PID],
            "producer_pid": q[Q_PRODUCER_PID],
            "created_ns": q[Q_CREATED_NS],
            "instance_id": q[Q_INSTANCE_ID],
            "write_pos": write_pos,
            "read_pos": read_pos,
            "consumer_waiting": i[I_CONSUMER_WAITING],
            "producer_waiting": i[I_PRODUCER_WAITING],
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
        found: list[Record] = []
        for _attempt in range(_TAIL_ATTEMPTS):
            start = self._q[Q_READ_POS]
            end = self._q[Q_WRITE_POS]
            positions: list[int] = []
            if end < start or end - start > self._capacity:
                copies: list[Record] = []
                stopped_at: int | None = start
            else:
                copies, _after, stopped_at = walk(
                    self._mm, self._capacity, start, end, positions=positions
                )
            oldest_intact = self._q[Q_READ_POS]
            found = [
                record
                for position, record in zip(positions[-n:], copies[-n:])
                if position >= oldest_intact
            ]
            if stopped_at is None or stopped_at >= oldest_intact:
                break
        return found

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
            validate_u64(cursor, "cursor")
        limit = _record_limit(max_records)
        slack = self._unpublished_slack(unpublished_bytes)
        read_pos, end = self._positions()
        if cursor is None:
            cursor = read_pos
        elif cursor > end:
            raise ValueError(
                f"{self._path}: cursor {cursor} is ahead of write_pos {end}; "
                "it is not a cursor of this ring"
            )
        return self._follow_from(cursor, read_pos, end, limit, slack)

    def _unpublished_slack(self, unpublished_bytes: int | None) -> int:
        """Check ``unpublished_bytes`` (:meth:`follow`); return the horizon's slack.

        The slack is ``unpublished_bytes - capacity``: the horizon's offset
        from ``write_pos``, in bytes, at most 0.

        Raises:
            TypeError: not an int (None: ``capacity // 2``).
            ValueError: outside ``0..capacity``.
        """
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
        return unpublished_bytes - self._capacity

    def _positions(self) -> tuple[int, int]:
        """Load ``(read_pos, write_pos)`` (byte positions), in that order.

        ``read_pos <= write_pos`` holds for any ``read_pos`` loaded earlier,
        so a cursor taken from ``read_pos`` never passes the end.
        """
        q = self._q
        read_pos = q[Q_READ_POS]
        return read_pos, q[Q_WRITE_POS]

    def _follow_from(
        self, cursor: int, read_pos: int, end: int, limit: int, slack: int
    ) -> tuple[list[Record], int, bool]:
        """The copy-and-check rounds of :meth:`follow`, starting at ``cursor``.

        ``read_pos`` and ``end`` (``write_pos``) are the positions loaded
        last, ``limit`` the most records (-1: all), ``slack`` the horizon's
        offset from ``write_pos`` (:meth:`_unpublished_slack`).

        Each round resynchronises a lapped cursor to ``read_pos``, copies the
        records up to ``end``, loads the positions again and keeps the copies
        only if the cursor is still at or after the horizon; after
        ``_FOLLOW_ATTEMPTS`` lapped rounds it returns no records.
        """
        lapped = False
        for _attempt in range(_FOLLOW_ATTEMPTS):
            if cursor < _horizon(read_pos, end, slack):
                lapped = True
                cursor = read_pos
            if limit == 0:
                return [], cursor, lapped
            found, after, invalid_at = self._collect(cursor, end, limit)
            read_pos, end = self._positions()
            if cursor >= _horizon(read_pos, end, slack):
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
        """Copy up to ``limit`` (-1: all) records in [position, end) with
        :func:`walk`; the copies are trustworthy only if ``position`` is
        still at or after the horizon once they are made (see :meth:`follow`)."""
        return walk(self._mm, self._capacity, position, end, limit)

    def __enter__(self) -> RingObserver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the mapping."""
        self.close()

    def __repr__(self) -> str:
        return f"RingObserver(name={self._name!r}, capacity={self._capacity})"

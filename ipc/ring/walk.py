"""The record walk: parse the records between two positions of a ring.

Every reader of records goes through :func:`walk`: the consumer
(:meth:`RingConsumer.read`) and the observer (:meth:`RingObserver.tail` and
:meth:`RingObserver.follow`).  What they do with an invalid header differs
(the consumer raises, an observer may have been lapped and retries), so the
walk reports where it stopped and leaves the verdict to them.
"""

from __future__ import annotations

import mmap

from ringstream.ipc.ring.layout import (
    ALIGN_MASK,
    DATA_KINDS,
    HEADER_SIZE,
    KIND_PAD,
    RECORD_HEADER_SIZE,
    RECORD_STRUCT,
    Record,
)

_tuple_new = tuple.__new__
_unpack_record = RECORD_STRUCT.unpack_from


def walk(
    mm: mmap.mmap,
    capacity: int,
    position: int,
    end: int,
    limit: int = -1,
    positions: list[int] | None = None,
) -> tuple[list[Record], int, int | None]:
    """Copy the records in ``[position, end)``, oldest first.

    PAD records and tails too short for a record header are skipped.  The
    walk stops at ``end``, after ``limit`` records, or at the first header
    that is not a valid record: a kind other than TOKEN, FINISH, ERROR or a
    PAD filling exactly the tail, a ``len`` below :data:`RECORD_HEADER_SIZE`,
    or a record that would cross the end of the data area or ``end``.

    Args:
        mm: the segment's mapping (header, then data area).
        capacity: data bytes, a power of two.
        position: a record boundary (a monotonic byte count).
        end: a published ``write_pos``; the caller checks that
            ``position <= end <= position + capacity``.
        limit: return at most this many records; -1 for all.
        positions: if a list, the position of each returned record is
            appended to it.

    Returns:
        ``(records, stopped, invalid_at)``: the records; the position where
        the walk stopped (after the last record or skipped tail it passed,
        or at an invalid header); the position of the invalid header that
        stopped the walk, or None if it reached ``end`` or ``limit``.
    """
    mask = capacity - 1
    out: list[Record] = []
    append = out.append
    while position < end and len(out) != limit:
        offset = position & mask
        room = capacity - offset
        if room < RECORD_HEADER_SIZE:
            position += room
            continue
        start = HEADER_SIZE + offset
        length, kind, flags, handle, seq, token_id = _unpack_record(mm, start)
        if kind == KIND_PAD and length == room:
            position += room
            continue
        size = (length + ALIGN_MASK) & ~ALIGN_MASK
        if (
            length < RECORD_HEADER_SIZE
            or size > room
            or position + size > end
            or kind not in DATA_KINDS
        ):
            return out, position, position
        if positions is not None:
            positions.append(position)
        payload = mm[start + RECORD_HEADER_SIZE : start + length]
        append(_tuple_new(Record, (kind, flags, handle, seq, token_id, payload)))
        position += size
    return out, position, None

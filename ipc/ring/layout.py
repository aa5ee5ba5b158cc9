"""Ring layout, version 1: the header and record formats and who writes which field.

Layout (all integers little-endian, offsets in bytes)::

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
    +4  u16 kind      1 TOKEN, 2 FINISH, 3 ERROR, 4 PROMPT_LOGPROBS, 0xFFFF PAD
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
(``len``, ``kind``, ``flags``); readers skip any tail that short without
reading it (:func:`ringstream.ipc.ring.walk.walk`).

Who writes what::

    field                      written by
    -------------------------  ---------------------------------------------
    magic .. instance id       owner, once, in RingConsumer.create
                               (segment.create_segment)
    producer pid               producer, in RingProducer.attach
    write_pos, data area       producer only (RingProducer.try_write/publish)
    read_pos                   consumer only (RingConsumer.commit)
    consumer_waiting           consumer only (RingConsumer.arm/disarm)
    producer_waiting           producer only (RingProducer.arm_space/disarm_space)
    everything                 never written by RingObserver (PROT_READ map)

The memory-ordering assumptions that make this safe without locks are in
:mod:`ringstream.ipc.ring.ordering` and beside the stores and loads that rely
on them.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

SHM_DIR = "/dev/shm"
MAGIC = b"RSRING\x00\x01"
VERSION = 1
HEADER_SIZE = 256
RECORD_HEADER_SIZE = 24
RECORD_ALIGN = 8
MIN_CAPACITY = 4096
MAX_CAPACITY = 1 << 56
MAX_PAYLOAD = 1 << 16

KIND_TOKEN = 1
KIND_FINISH = 2
KIND_ERROR = 3
KIND_PROMPT_LOGPROBS = 4
"""A slice of one request's prompt logprobs, written before its first TOKEN record."""
KIND_PAD = 0xFFFF
DATA_KINDS = frozenset((KIND_TOKEN, KIND_FINISH, KIND_ERROR, KIND_PROMPT_LOGPROBS))

U64_LIMIT = 1 << 64
ALIGN_MASK = RECORD_ALIGN - 1
MAGIC_SIZE = len(MAGIC)

# Header field indices.  Q_* index the u64 view, I_* the u32 view
# (ordering.header_views).
I_VERSION = 8 // 4
I_HEADER_SIZE = 12 // 4
Q_CAPACITY = 16 // 8
Q_OWNER_PID = 24 // 8
Q_PRODUCER_PID = 32 // 8
Q_CREATED_NS = 40 // 8
Q_INSTANCE_ID = 48 // 8
Q_WRITE_POS = 64 // 8
Q_READ_POS = 128 // 8
I_CONSUMER_WAITING = 192 // 4
I_PRODUCER_WAITING = 196 // 4

HEADER_STRUCT = struct.Struct("<8sIIQQQQQ")
"""Magic .. instance id, for validating a header before mapping it."""
HEADER_OWNER_PID_INDEX = 4
"""Position of the owner pid in a :data:`HEADER_STRUCT` tuple."""

RECORD_STRUCT = struct.Struct("<IHHQII")
PAD_PREFIX_STRUCT = struct.Struct("<IHH")
"""The part of a PAD header that fits in a tail shorter than a record header."""
assert RECORD_STRUCT.size == RECORD_HEADER_SIZE


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


def record_size(payload_len: int) -> int:
    """Bytes a record with a ``payload_len``-byte payload occupies in the data
    area: header plus payload, rounded up to :data:`RECORD_ALIGN`."""
    return (RECORD_HEADER_SIZE + payload_len + ALIGN_MASK) & ~ALIGN_MASK


def valid_capacity(capacity: int) -> bool:
    """Whether ``capacity`` is a power of two in ``MIN_CAPACITY..MAX_CAPACITY``."""
    return MIN_CAPACITY <= capacity <= MAX_CAPACITY and not capacity & (capacity - 1)


def validate_capacity(capacity: int) -> None:
    """Check a capacity argument.

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: it is not a power of two between :data:`MIN_CAPACITY` and
            :data:`MAX_CAPACITY` bytes.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be int, not {type(capacity).__name__}")
    if not valid_capacity(capacity):
        raise ValueError(
            f"capacity must be a power of two between {MIN_CAPACITY} and "
            f"{MAX_CAPACITY} bytes, got {capacity}"
        )


def validate_u64(value: int, what: str) -> None:
    """Check that ``value`` fits a u64 field.

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: it is negative or needs more than 64 bits.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be int, not {type(value).__name__}")
    if not 0 <= value < U64_LIMIT:
        raise ValueError(f"{what} must fit in an unsigned 64-bit integer, got {value}")

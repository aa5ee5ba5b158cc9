"""Single-producer/single-consumer byte ring in a POSIX shared-memory segment.

The front process (consumer and owner) creates one ring per worker process;
the worker (producer) appends one record per generated token; observers such
as ``ringstream-top`` map the segment read-only.  This package deals in bytes
and records only: it knows nothing about requests, models or sockets, and it
imports nothing but the standard library.

Modules, one concept each:

    layout    the header and record formats, their constants, who writes what
    ordering  the memory-ordering assumptions: the fence, untorn header access
    errors    RingError, RingSpaceError, RingExistsError
    segment   names, creating, mapping and unlinking /dev/shm/<name>
    owner     creating a segment's file, reclaiming it from a dead owner
    walk      the one record walk, used by every reader of records
    consumer  RingConsumer: the owner; creates, reads, commits, unlinks
    producer  RingProducer: the worker; appends and publishes records
    observer  RingObserver: read-only inspection (tail, follow)

Every public name is importable from here.
"""

from __future__ import annotations

from ringstream.ipc.ring.consumer import RingConsumer
from ringstream.ipc.ring.errors import RingError, RingExistsError, RingSpaceError
from ringstream.ipc.ring.layout import (
    DATA_KINDS,
    HEADER_SIZE,
    KIND_ERROR,
    KIND_FINISH,
    KIND_PAD,
    KIND_PROMPT_LOGPROBS,
    KIND_TOKEN,
    MAGIC,
    MAX_CAPACITY,
    MAX_PAYLOAD,
    MIN_CAPACITY,
    RECORD_ALIGN,
    RECORD_HEADER_SIZE,
    SHM_DIR,
    VERSION,
    Record,
)
from ringstream.ipc.ring.observer import RingObserver
from ringstream.ipc.ring.producer import RingProducer
from ringstream.ipc.ring.segment import (
    DEFAULT_MODE,
    MAX_NAME_LENGTH,
    segment_path,
    validate_name,
)

# DATA_KINDS, DEFAULT_MODE, MAX_NAME_LENGTH and RECORD_ALIGN are importable
# from here too, outside __all__, as before the ring became a package.

__all__ = [
    "HEADER_SIZE",
    "KIND_ERROR",
    "KIND_FINISH",
    "KIND_PAD",
    "KIND_PROMPT_LOGPROBS",
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

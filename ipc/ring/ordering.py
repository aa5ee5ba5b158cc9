"""Memory ordering: the fence and the untorn header access the ring relies on.

The ring targets x86-64 (total store order), where a store is never reordered
with an earlier store, a load never with an earlier load, and a store never
moves before an earlier load.  The only reordering x86 allows, a store
followed by a load of a different location, matters for the doorbell
handshake, which therefore uses an explicit full fence (:func:`full_fence`).

Every u64 header field is read and written through an element of
``memoryview(mm).cast("Q")`` (:func:`header_views`): CPython copies such an
element with a fixed-size 8-byte ``memcpy``, which compiles to a single
aligned 8-byte move, so a reader in another process never sees a torn
position.  ``struct.pack_into`` gives no such guarantee and is used for
record bytes only, which are never read before they are published.
"""

from __future__ import annotations

import mmap
import threading

from ringstream.ipc.ring.layout import HEADER_SIZE

# A lock acquire is a locked read-modify-write instruction, which on x86-64 is
# a full memory barrier (the same trick as vLLM's shm_broadcast memory_fence).
_FENCE_LOCK = threading.Lock()


def full_fence() -> None:
    """Order every earlier load and store before every later one.

    Needed only for the Dekker-style doorbell handshake: one side stores its
    waiting flag (or position) and then loads the other side's position (or
    flag).  Without the fence x86 may perform the load before the store
    becomes visible, both sides would miss each other and both would sleep.
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def header_views(mm: mmap.mmap) -> tuple[memoryview, memoryview]:
    """Return the u64 and u32 views of the header of mapping ``mm``.

    Index them with the ``Q_*`` and ``I_*`` constants of
    :mod:`ringstream.ipc.ring.layout`; each element access is one aligned,
    untorn load or store.  Release both views before closing ``mm``.
    """
    with memoryview(mm) as whole:
        header = whole[:HEADER_SIZE]
        u64 = header.cast("Q")
        u32 = header.cast("I")
        header.release()
    return u64, u32

"""The exceptions the ring raises."""

from __future__ import annotations


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

"""When a client heartbeats, checks its socket and gives up: bookkeeping over times, no sockets.

:class:`Liveness` is the small core the clients (:mod:`ringstream.ipc.client`)
consult at every wait; it decides, the client acts.
"""

from __future__ import annotations

import math

PROBE_AFTER_S = 0.25
"""A heartbeat, ``status()`` or ``admin()`` unanswered this long (capped at ``heartbeat_s``) makes the client
check that its ipc socket still listens, seconds; a live front answers them in well under a millisecond."""
MIN_WAIT_S = 0.001
"""Shortest wait between two liveness checks, seconds (never a busy loop)."""


class Liveness:
    """When a client heartbeats, checks its socket, and gives up on a silent daemon.

    Pure bookkeeping over ``time.monotonic()`` seconds: the clients report
    what they sent and heard, ask what is due, and do it.

    * heartbeat every ``heartbeat_s`` while streams are open;
    * a *ping* (a heartbeat, ``status``, ``admin``: messages a live front
      answers at once) unanswered for :data:`PROBE_AFTER_S` (at most
      ``heartbeat_s``) makes the socket due for a probe;
    * a request made after ``heartbeat_s`` without a word from the daemon
      (or before any) probes the socket first;
    * silence for ``timeout_s`` from :meth:`start_clock` (or the last
      message heard, if later) ends the wait.
    """

    def __init__(self, heartbeat_s: float, timeout_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.heard_at: float | None = None
        self.pinged_at: float | None = None
        """When the oldest ping that nothing has answered yet was sent; None if none."""
        self.clock_from = 0.0
        self.next_heartbeat = 0.0

    @property
    def probe_after_s(self) -> float:
        """Seconds an unanswered ping waits before the socket is probed."""
        return min(PROBE_AFTER_S, self.heartbeat_s)

    def heard(self, now: float) -> None:
        """A message arrived from the daemon."""
        self.heard_at = now
        self.pinged_at = None

    def pinged(self, now: float) -> None:
        """A ping was sent."""
        if self.pinged_at is None:
            self.pinged_at = now

    def start_clock(self, now: float) -> None:
        """Measure silence from ``now`` (a client starting to wait with nothing outstanding)."""
        self.clock_from = now

    def first_stream(self, now: float) -> None:
        """A stream opened while none was open: the next heartbeat is one period away."""
        self.next_heartbeat = now + self.heartbeat_s

    def probe_before_request(self, now: float) -> bool:
        """Whether a request should check the socket first: nothing heard for a heartbeat period, or ever."""
        return self.heard_at is None or now - self.heard_at > self.heartbeat_s

    def heartbeat_due(self, now: float) -> bool:
        """Whether a heartbeat should be sent at ``now`` (monotonic seconds)."""
        return now >= self.next_heartbeat

    def heartbeat_sent(self, now: float) -> None:
        """A heartbeat was sent at ``now``: the next is one period later."""
        self.next_heartbeat = now + self.heartbeat_s

    def probe_due(self, now: float) -> bool:
        """Whether a ping has gone unanswered for ``probe_after_s`` at ``now``."""
        return self.pinged_at is not None and now - self.pinged_at >= self.probe_after_s

    def probed(self) -> None:
        """The socket was probed and listens: the ping stays unanswered, the silence clock decides."""
        self.pinged_at = None

    def silent_s(self, now: float) -> float:
        """Seconds of silence that count against ``timeout_s``."""
        return now - max(self.clock_from, self.heard_at if self.heard_at is not None else -math.inf)

    def next_wake_s(self, now: float, streaming: bool) -> float:
        """Seconds until something may be due (a heartbeat, a probe, the silence limit), at most ``heartbeat_s``."""
        due = [self.heartbeat_s, self.timeout_s - self.silent_s(now)]
        if streaming:
            due.append(self.next_heartbeat - now)
        if self.pinged_at is not None:
            due.append(self.pinged_at + self.probe_after_s - now)
        return max(MIN_WAIT_S, min((d for d in due if d > 0), default=MIN_WAIT_S))

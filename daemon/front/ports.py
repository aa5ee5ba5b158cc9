"""What the front's core may do to the world (:class:`Ports`); the shell implements it.

The core (:mod:`ringstream.daemon.front.core`) and its outbox reach sockets,
workers and the loop only through these calls, so unit tests can drive the
core with fakes that record what it sends and fire its timers by hand.
"""

from __future__ import annotations

from typing import Callable, Literal, Protocol

__all__ = ["Ports", "SendResult", "Timer"]

SendResult = Literal["sent", "blocked", "gone"]
"""A send to a client: queued; refused at its high-water mark (retry later); or its peer is unroutable."""


class Timer(Protocol):
    """A pending callback; ``cancel()`` before it runs drops it."""

    def cancel(self) -> None: ...


class Ports(Protocol):
    """What the core may do to the world; the shell implements it over sockets and the event loop."""

    def send(self, identity: bytes, msg: object) -> SendResult:
        """Send one message to a client; never blocks."""

    def send_worker(self, index: int, command: object) -> None:
        """Queue a command for worker ``index``; never blocks (a dead worker's commands are dropped)."""

    def call_later(self, delay_s: float, callback: Callable[..., None], *args: object) -> Timer:
        """Run ``callback(*args)`` after ``delay_s`` seconds, unless cancelled."""

    def poll_connections(self) -> None:
        """Apply the client socket's pending connection events (a closed connection: ``client_gone``), so
        that nothing queued for a closed connection reaches a later connection of the same identity."""

    def ready(self) -> None:
        """Every worker is ready: the daemon serves (systemd hears READY=1)."""

    def stopping(self) -> None:
        """The shutdown began (systemd hears STOPPING=1)."""

    def stopped(self) -> None:
        """The shutdown is over: nothing is left to deliver; the shell tears down."""



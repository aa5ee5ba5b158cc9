"""Service-manager notifications (the sd_notify protocol) without libsystemd.

Under ``systemd`` with ``Type=notify`` the manager passes the path of its
notification socket in ``$NOTIFY_SOCKET`` and, with ``WatchdogSec=``, the
watchdog timeout in ``$WATCHDOG_USEC``. :class:`Notifier` speaks the protocol of
sd_notify(3): one datagram per message, newline-separated ``KEY=VALUE``
assignments, sent to that ``AF_UNIX`` ``SOCK_DGRAM`` socket (a file system path,
or an abstract-namespace name written with a leading ``@``). The manager reads
the sender's credentials from the kernel, so nothing else is needed.

Outside systemd (``$NOTIFY_SOCKET`` unset) every call is a no-op, so the daemon
calls the notifier unconditionally. A send never raises: a notification is
advisory, and a failed one must not take the daemon down; failures are counted
and logged once.

:class:`WatchdogGate` decides whether the front may send the watchdog
keep-alive: only while its own loop runs *and* every ready worker has sent a
heartbeat recently, so that a hung worker (a stuck CUDA call, say) stops the
pings and systemd restarts the whole service.

The environment is left as it is by default: worker processes inherit
``$NOTIFY_SOCKET`` but never use it, and with ``NotifyAccess=main`` systemd
ignores messages from any process other than the main one anyway.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger("ringstream.notify")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
"""Environment variable holding the manager's notification socket address."""
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
"""Environment variable holding the watchdog timeout, microseconds."""
WATCHDOG_PID_ENV = "WATCHDOG_PID"
"""Environment variable naming the one process the watchdog applies to (absent: the receiving process)."""
ABSTRACT_PREFIX = "@"
"""A ``$NOTIFY_SOCKET`` starting with this names a socket in the abstract namespace."""
USEC_PER_S = 1_000_000
"""Microseconds per second (systemd's time unit in the protocol)."""
WATCHDOG_PING_FRACTION = 0.5
"""Ping every this fraction of the watchdog timeout, as sd_watchdog_enabled(3) recommends."""
FIELD_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
"""Valid assignment names: upper-case letters, digits and underscores, as systemd defines them."""


class Notifier:
    """Sends state changes and watchdog keep-alives to the service manager.

    Build it once, early, in the daemon's main process::

        notifier = Notifier()          # reads os.environ
        notifier.ready(status="serving")

    Every message method returns True if a datagram was handed to the kernel,
    False if the notifier is disabled or the send failed; none raises on a
    send failure. Only malformed input raises ValueError, before anything is
    sent: a bad field in :meth:`send`, a non-positive time in :meth:`extend_timeout`.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        """Read the notification settings from ``environ`` (default: ``os.environ``).

        Args:
            environ: the environment to read; it is not modified.
            pid: this process's id (default: ``os.getpid()``), compared with
                ``$WATCHDOG_PID``.
        """
        env = os.environ if environ is None else environ
        self.send_failures = 0
        """Datagrams that could not be sent (the manager gone, its queue full, ...)."""
        self.address: str | None = _socket_address(env.get(NOTIFY_SOCKET_ENV, ""))
        """The socket address in the form ``socket.sendto`` takes (abstract names start with NUL), or None."""
        self._watchdog_usec = _watchdog_usec(env, os.getpid() if pid is None else pid)
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None, unset: bool = False) -> Notifier:
        """A notifier for ``environ`` (default: ``os.environ``); with ``unset``, remove the three variables.

        Unsetting keeps child processes from seeing them, as
        ``sd_notify(unset_environment=1)`` does. It is not needed with
        ``NotifyAccess=main``, which makes systemd ignore other processes.
        """
        env = os.environ if environ is None else environ
        notifier = cls(env)
        if unset:
            for name in (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV):
                env.pop(name, None)
        return notifier

    # ------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        """True if a notification socket is configured (the process runs under a notify-aware manager)."""
        return self._sock is not None

    @property
    def watchdog_timeout_s(self) -> float | None:
        """The manager's watchdog timeout, seconds; None if no watchdog applies to this process."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / USEC_PER_S

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to call :meth:`watchdog`, seconds: half the timeout; None if no watchdog applies."""
        timeout = self.watchdog_timeout_s
        return None if timeout is None else timeout * WATCHDOG_PING_FRACTION

    # ------------------------------------------------------------ messages

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up (or a reload) is complete; optionally with a ``STATUS=`` line."""
        fields = {"READY": "1"}
        if status is not None:
            fields["STATUS"] = _one_line(status)
        return self.send(**fields)

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``: a reload has begun; call :meth:`ready` when it ends.

        ``MONOTONIC_USEC`` (``CLOCK_MONOTONIC``, microseconds) is required by
        ``Type=notify-reload`` (systemd 253 and later) and ignored by older managers.
        """
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING="1", MONOTONIC_USEC=str(now_usec))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: a graceful stop has begun; optionally with a ``STATUS=`` line."""
        fields = {"STOPPING": "1"}
        if status is not None:
            fields["STATUS"] = _one_line(status)
        return self.send(**fields)

    def status(self, text: str) -> bool:
        """``STATUS=text``: a one-line, human-readable state shown by ``systemctl status``.

        Line breaks in ``text`` are replaced by spaces.
        """
        return self.send(STATUS=_one_line(text))

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for ``seconds`` more before the current start/stop timeout fires.

        Useful when a configured start or drain time may exceed the unit's
        ``TimeoutStartSec=``/``TimeoutStopSec=``. Raises ValueError if
        ``seconds`` is not positive.
        """
        if not seconds > 0:
            raise ValueError(f"extend_timeout({seconds!r}): must be > 0 seconds")
        return self.send(EXTEND_TIMEOUT_USEC=str(int(seconds * USEC_PER_S)))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the keep-alive ping; a no-op (False) when no watchdog applies to this process."""
        if self.watchdog_timeout_s is None:
            return False
        return self.send(WATCHDOG="1")

    def send(self, **fields: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines, e.g. ``send(STATUS="warming up", ERRNO="0")``.

        Returns True if the kernel accepted the datagram, False if the notifier
        is disabled or the send failed (counted in ``send_failures``, logged
        once). Raises ValueError, before sending anything, if a name is not
        upper-case ``[A-Z][A-Z0-9_]*``, a value holds a newline, or no field is given.
        """
        if not fields:
            raise ValueError("send(): give at least one KEY=VALUE field")
        for name, value in fields.items():
            if not FIELD_NAME_RE.match(name):
                raise ValueError(f"notification field {name!r}: use upper-case letters, digits and '_'")
            if "\n" in str(value):
                raise ValueError(f"notification field {name}: the value must not contain a newline")
        if self._sock is None:
            return False
        payload = "\n".join(f"{name}={value}" for name, value in fields.items()).encode()
        try:
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            self.send_failures += 1
            if self.send_failures == 1:
                log.warning("cannot notify the service manager at %s: %s (further failures logged at debug)",
                            _printable(self.address), exc)
            else:
                log.debug("notify failed (%d so far): %s", self.send_failures, exc)
            return False
        return True

    def close(self) -> None:
        """Close the socket; later calls are no-ops. Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class WatchdogGate:
    """Sends the watchdog ping only while the whole daemon is healthy.

    Healthy means: the front's own loop is alive (``front_ok``) and every
    worker in ``worker_heartbeats`` (index -> ``time.monotonic()`` of its last
    heartbeat) was heard from less than ``max_age_s`` ago. Pass only the
    workers that are expected to heartbeat (those that reported ready); a
    worker still loading its model is bounded by ``worker_start_timeout_s``
    instead, and systemd arms the watchdog only after ``READY=1``.

    The decision itself, :meth:`withhold_reason`, is pure; :meth:`ping_if_healthy`
    adds the ping and logs when the verdict changes.
    """

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.withheld_reason: str | None = None
        """Why the last ping was withheld, or None if it was sent."""

    @staticmethod
    def withhold_reason(front_ok: bool, worker_heartbeats: Mapping[int, float], now: float,
                        max_age_s: float) -> str | None:
        """Why the ping must be withheld (e.g. ``"worker 1 silent for 31.0 s"``), or None if healthy.

        Args:
            front_ok: the front's loop made progress recently.
            worker_heartbeats: worker index -> time of its last heartbeat, seconds
                on the same clock as ``now``; a time after ``now`` counts as fresh.
            now: the current time, seconds (``time.monotonic()``).
            max_age_s: oldest acceptable heartbeat, seconds (> 0).

        Raises:
            ValueError: ``max_age_s`` is not positive.
        """
        if not max_age_s > 0:
            raise ValueError(f"max_age_s = {max_age_s!r}: must be > 0 seconds")
        if not front_ok:
            return "front loop not healthy"
        stale = {index: now - beat for index, beat in worker_heartbeats.items() if now - beat >= max_age_s}
        if stale:
            return "; ".join(f"worker {index} silent for {age:.1f} s" for index, age in sorted(stale.items()))
        return None

    def ping_if_healthy(self, front_ok: bool, worker_heartbeats: Mapping[int, float], now: float,
                        max_age_s: float) -> bool:
        """Hand ``WATCHDOG=1`` to the notifier if healthy; returns True if healthy, False if withheld.

        Arguments as for :meth:`withhold_reason`. Once pings have been withheld
        for a whole watchdog timeout, systemd stops the service with
        ``WatchdogSignal=`` (SIGABRT) and ``Restart=`` restarts it. Logs a
        warning when pings start being withheld and a note when they resume.
        Raises ValueError as :meth:`withhold_reason` does.
        """
        reason = self.withhold_reason(front_ok, worker_heartbeats, now, max_age_s)
        if reason is not None:
            if self.withheld_reason is None:
                log.warning("withholding the watchdog ping: %s", reason)
            self.withheld_reason = reason
            return False
        if self.withheld_reason is not None:
            log.info("healthy again; watchdog pings resume")
            self.withheld_reason = None
        self.notifier.watchdog()
        return True


def _socket_address(raw: str) -> str | None:
    """``$NOTIFY_SOCKET`` -> a ``sendto`` address; None if unset or of an unsupported kind."""
    if not raw:
        return None
    if raw.startswith(ABSTRACT_PREFIX):
        return "\0" + raw[len(ABSTRACT_PREFIX):]
    if raw.startswith("/"):
        return raw
    log.warning("%s=%r: not a path or an abstract socket name; notifications disabled", NOTIFY_SOCKET_ENV, raw)
    return None


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """The watchdog timeout for process ``pid``, microseconds, or None (absent, malformed, another process's)."""
    raw = env.get(WATCHDOG_USEC_ENV)
    if not raw:
        return None
    owner = env.get(WATCHDOG_PID_ENV)
    if owner:
        try:
            if int(owner) != pid:
                return None
        except ValueError:
            log.warning("%s=%r: not a process id; watchdog disabled", WATCHDOG_PID_ENV, owner)
            return None
    try:
        usec = int(raw)
    except ValueError:
        usec = 0
    if usec <= 0:
        log.warning("%s=%r: not a positive integer; watchdog disabled", WATCHDOG_USEC_ENV, raw)
        return None
    return usec


def _one_line(text: str) -> str:
    """``text`` with every line break replaced by a space (a value must fit on one line)."""
    return " ".join(str(text).splitlines())


def _printable(address: str | None) -> str:
    """The address as ``$NOTIFY_SOCKET`` writes it (abstract names with ``@``)."""
    if address and address.startswith("\0"):
        return ABSTRACT_PREFIX + address[1:]
    return str(address)

"""The front's client socket: a ZeroMQ ROUTER, its connection monitor, and CURVE.

* ``ROUTER_MANDATORY``: a send to a gone peer raises instead of vanishing; a
  send at the high-water mark raises EAGAIN and the chunk stays pending in
  the outbox, coalesced with later tokens, and is retried: nothing is
  dropped silently.
* A monitor of the socket's connections: the front learns a connection's
  close at once and cancels its requests, so an identity that connects
  again never receives chunks of its previous connection's requests. A
  second connection that claims an identity already connected is refused by
  ZeroMQ (``ROUTER_HANDOVER`` stays off: a newcomer cannot take over, and
  read, another connection's streams).
* Optionally CURVE-encrypted, with an allow-list of client keys (a ZAP
  handler on the front's loop).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
from typing import Callable, Iterator

import zmq

from ringstream.daemon.common.config import Config
from ringstream.daemon.front.ports import SendResult
from ringstream.daemon.common.supervision import StartupError
from ringstream.ipc import protocol as P
from ringstream.ipc.address import unix_socket_listening
from ringstream.ipc.aio import SocketPump

__all__ = ["CLIENT_SNDHWM", "ClientSocket", "refuse_live_socket"]

log = logging.getLogger("ringstream.front")

CLIENT_SNDHWM = 1000
"""Per-client queued messages before sends raise EAGAIN (then chunks coalesce): bounds what a client that
stops reading costs the front to about this many chunks, whatever its streams produce meanwhile."""
MONITOR_ADDRESS = "inproc://ringstream-client-connections"
"""Where the client socket's monitor (connection accepted / closed events) publishes."""
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
MONITOR_EVENT = struct.Struct("=HI")
"""First frame of a ZeroMQ monitor message: event id (u16), value (u32, the connection's fd here)."""


class ClientSocket:
    """The bound client socket; ``on_message(parts)`` gets each message's frames (identity first)."""

    def __init__(self, ctx: zmq.Context, config: Config, on_message: Callable[[list[zmq.Frame]], None]) -> None:
        self.ctx = ctx
        self.config = config
        self.router = zmq.Socket(ctx, zmq.ROUTER)  # plain sockets, read by a SocketPump (ipc.aio)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.router.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pump = SocketPump(self.router, on_message, multipart=True)
        self.monitor: zmq.Socket | None = None
        self.authenticator = None
        self.path: str | None = None
        """The ipc socket file bound (removed at close)."""
        self._watching_monitor = False
        self.closed = False

    def bind(self) -> str:
        """Set up CURVE (if configured) and the monitor, bind the configured address; returns it.

        Raises StartupError for a socket another process listens on, or unreadable CURVE keys.
        """
        config = self.config
        if config.curve_secret_key_file is not None:
            self._setup_curve()
        self.router.monitor(MONITOR_ADDRESS, CONNECTION_EVENTS)
        self.monitor = zmq.Socket(self.ctx, zmq.PAIR)  # a plain socket: drained synchronously
        self.monitor.connect(MONITOR_ADDRESS)
        address = config.address()
        if address.startswith("ipc://"):
            path = address[len("ipc://"):]
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            refuse_live_socket(path)
            umask = os.umask(0o777 & ~config.socket_mode)  # the socket file never exists with a wider mode
            try:
                self.router.bind(address)
            finally:
                os.umask(umask)
            self.path = path
            os.chmod(path, config.socket_mode)
        else:
            self.router.bind(address)
        return address

    def start(self, on_connection_events: Callable[[], None]) -> None:
        """Begin delivering messages; ``on_connection_events()`` runs when the monitor has events to read."""
        self.pump.start()
        if self.monitor is not None:
            asyncio.get_running_loop().add_reader(self.monitor.getsockopt(zmq.FD), on_connection_events)
            self._watching_monitor = True

    def send(self, identity: bytes, msg) -> SendResult:
        """Send one message; "sent", "blocked" (EAGAIN at the HWM) or "gone". Never blocks."""
        if not identity or self.closed:
            return "gone"
        try:
            # Two sends with int flags: send_multipart combines flag enums per frame, a measurable cost here.
            # A ROUTER refuses or queues the first frame; once queued, the second never fails.
            self.router.send(identity, SNDMORE_NOBLOCK)
            self.router.send(P.encode(msg), NOBLOCK)
        except zmq.Again:
            return "blocked"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "gone"
            raise
        finally:
            self.pump.kick()  # a send may take the socket's read edge (see ipc.aio)
        return "sent"

    def connection_events(self) -> Iterator[tuple[int, int]]:
        """Pending ``(event, fd)`` connection events (``zmq.EVENT_ACCEPTED`` / ``EVENT_DISCONNECTED``)."""
        if self.monitor is None:
            return
        while True:
            try:
                event_frame, _endpoint = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            yield MONITOR_EVENT.unpack(event_frame)

    @staticmethod
    def source_fd(part: zmq.Frame) -> int | None:
        """File descriptor of the connection a received frame came through (None if unknown)."""
        try:
            return part.get(zmq.SRCFD)
        except zmq.ZMQError:
            return None

    def _setup_curve(self) -> None:
        """The server's key pair, and a ZAP handler allowing the listed client keys."""
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        config = self.config
        try:
            public, secret = zmq.auth.load_certificate(config.curve_secret_key_file)
        except (OSError, ValueError) as exc:
            raise StartupError(f"curve_secret_key_file {config.curve_secret_key_file}: {exc}") from exc
        if not secret:
            raise StartupError(f"curve_secret_key_file {config.curve_secret_key_file}: holds no secret key")
        if not os.path.isdir(config.curve_allowed_clients_dir):
            raise StartupError(f"curve_allowed_clients_dir {config.curve_allowed_clients_dir}: not a directory")
        self.authenticator = AsyncioAuthenticator(self.ctx, log=logging.getLogger("ringstream.auth"))
        self.authenticator.start()
        self.load_allowed_clients()
        self.router.curve_secretkey = secret
        self.router.curve_publickey = public
        self.router.curve_server = True

    def load_allowed_clients(self) -> None:
        """(Re)read the public keys (``*.key`` certificates) that may connect over CURVE (none: no-op)."""
        if self.authenticator is None:
            return
        directory = self.config.curve_allowed_clients_dir
        self.authenticator.configure_curve(domain="*", location=directory)
        allowed = self.authenticator.certs.get("*", {})
        if not allowed:
            log.warning("curve_allowed_clients_dir %s lists no client key: no client can connect", directory)
        else:
            log.info("CURVE: %d client key(s) allowed from %s", len(allowed), directory)

    def close(self) -> None:
        """Stop reading, close the socket and its monitor, remove the socket file; later sends answer "gone"."""
        self.closed = True
        self.pump.stop()
        if self.monitor is not None:
            if self._watching_monitor:
                asyncio.get_running_loop().remove_reader(self.monitor.getsockopt(zmq.FD))
            self.router.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        if self.authenticator is not None:
            self.authenticator.stop()
        self.router.close(linger=0)
        if self.path is not None:  # libzmq leaves the files of closed ipc sockets behind
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def refuse_live_socket(path: str) -> None:
    """Raise StartupError if a process already listens on the unix socket ``path``.

    ZeroMQ would silently unlink and re-bind it, stealing another daemon's
    clients; a stale file (nobody listening) is fine to replace.
    """
    try:
        live = unix_socket_listening(path)
    except OSError as exc:
        raise StartupError(f"socket {path}: {exc}") from exc
    if live:
        raise StartupError(f"socket {path} is in use by another process (another daemon?)")

"""Bounds on what a slow, idle, stuck or hostile HTTP client may hold in the HTTP server process.

Each has a named default and a :class:`ringstream.daemon.http.options.HttpLimits` field, declared in
:mod:`ringstream.daemon.http.options` (and a command-line option of :mod:`ringstream.daemon.http.server`):

* ``keepalive_timeout_s`` (:data:`KEEPALIVE_TIMEOUT_S`): a connection with no
  request in progress is closed after this long. The clock starts when the
  connection opens or its last answer was sent and is not reset by incoming
  bytes, so it is also the deadline for a request's line and headers: a
  client that sends them byte by byte (slowloris) is dropped at it.
* ``body_timeout_s`` (:data:`BODY_TIMEOUT_S`): the whole body must arrive within
  this long of the headers; else 408 and the connection is closed.
* ``write_timeout_s`` (:data:`WRITE_TIMEOUT_S`): an answer the client does not
  take (its TCP receive window stays full) for this long aborts the
  connection and cancels its daemon requests. ``StreamResponse.write`` waits
  for the socket to drain once about 64 KiB are buffered, so a stuck reader
  holds at most that much of the stream plus its socket's send buffer, which
  is fixed at :data:`SEND_BUFFER_BYTES` (the kernel's autotuning would let it
  grow to megabytes per connection).
* ``max_connections`` (:data:`MAX_CONNECTIONS`): connections beyond it are
  answered ``503`` at once and closed; the ones being served are untouched.
  The open-file limit is raised (up to its hard limit) to fit; where it
  cannot be, the cap is lowered to what it allows.
* :data:`MAX_LINE_BYTES`, :data:`MAX_FIELD_BYTES`, :data:`MAX_HEADERS`: larger
  request lines or headers, or more headers, get 400 from aiohttp's parser;
  the body size is capped by ``max_body_bytes`` (413).
"""

from __future__ import annotations

import logging
import resource
import socket
import time

from aiohttp import web


log = logging.getLogger("ringstream.http")

SEND_BUFFER_BYTES = 256 * 1024
"""SO_SNDBUF of each connection, bytes (the kernel doubles it): plenty for a token stream, and what a client
that stops reading pins in kernel memory."""
OWN_FILES = 64
"""Open files the server needs besides its connections (listening sockets, the daemon client, logs, the
tokenizer), counted against RLIMIT_NOFILE."""
_REFUSAL_BODY = (b'{"error": {"message": "too many connections to this server", "type": "service_unavailable", '
                 b'"param": null, "code": "too_many_connections"}}')
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL_BODY), _REFUSAL_BODY))
"""What a connection over the cap gets before it is closed."""
REFUSAL_LOG_S = 10.0
"""Refused connections are logged at most this often (with their count)."""




def fit_open_files(max_connections: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit (up to the hard one) to fit ``max_connections`` plus :data:`OWN_FILES`;
    returns the cap the limit allows (``max_connections``, or less with a warning logged)."""
    needed = max_connections + OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        allowed = max(1, soft - OWN_FILES)
        log.warning("the open-file limit (%d) allows %d connections, not %d: the cap is %d (raise the hard limit: "
                    "ulimit -Hn, LimitNOFILE= in the unit)", soft, allowed, max_connections, allowed)
        return allowed
    return max_connections


class ConnectionCap:
    """At most ``limit`` connections at once on an aiohttp ``web.Server``: each one over it is answered
    :data:`REFUSAL` and closed before anything of it is read (:attr:`refused` counts them); each admitted
    one gets a send buffer of ``send_buffer_bytes``."""

    def __init__(self, limit: int, send_buffer_bytes: int = SEND_BUFFER_BYTES) -> None:
        self.limit = limit
        self.send_buffer_bytes = send_buffer_bytes
        self.refused = 0
        self._open: set = set()
        self._logged_at = -REFUSAL_LOG_S
        self._logged_refused = 0

    @property
    def open(self) -> int:
        """Connections admitted and not yet lost."""
        return len(self._open)

    def install(self, server: web.Server) -> None:
        """Wrap ``server``'s ``connection_made`` and ``connection_lost`` (which each connection's handler calls)."""
        admit, lose = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            if len(self._open) >= self.limit:
                self._refuse(handler, transport)
                return
            self._open.add(handler)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
                except OSError as exc:  # not fatal: the kernel's own sizing applies
                    log.debug("SO_SNDBUF: %s", exc)
            admit(handler, transport)

        def connection_lost(handler, exc: BaseException | None = None) -> None:
            self._open.discard(handler)
            lose(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def abort_all(self) -> int:
        """Abort every admitted connection's transport (the stop's last resort for clients that do not read:
        their handlers' pending writes then fail at once). Returns how many."""
        handlers = list(self._open)
        for handler in handlers:
            transport = handler.transport
            if transport is not None:
                transport.abort()
        return len(handlers)

    def _refuse(self, handler, transport) -> None:
        self.refused += 1
        transport.write(REFUSAL)
        handler.force_close()  # closes the transport once REFUSAL is flushed; the handler never reads a request
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_S:
            log.warning("%d connections refused: %d open, the cap (--max-connections)",
                        self.refused - self._logged_refused, len(self._open))
            self._logged_at, self._logged_refused = now, self.refused

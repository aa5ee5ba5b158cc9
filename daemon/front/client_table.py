"""The front's client table: who has which requests open, over which connection, and who stopped talking.

Socket-free: the front feeds it the client socket's connection events
(accepted, closed) and each message's identity and connection, and acts on
what it returns (a client gone: cancel its requests). It never sends
anything and never calls back into the front.

A connection is a ZeroMQ peer's transport (one unix or TCP connection,
numbered by a serial that is never reused); an identity is the peer's
routing id. A client whose connection closes is gone at once, so an identity
that connects again never receives chunks of its previous connection's
requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from ringstream.daemon.front.request import Request

__all__ = ["ClientState", "ClientTable", "STUCK_GIVE_UP_FACTOR"]

STUCK_GIVE_UP_FACTOR = 2
"""A client that has not read for ``client_timeout_s`` has its requests cancelled; their terminal
messages stay pending until it reads, for at most this many ``client_timeout_s`` in all."""


@dataclass(slots=True)
class ClientState:
    """Requests open for one client identity, and when it last spoke (``time.monotonic`` seconds)."""

    last_seen: float
    requests: dict[str, Request] = field(default_factory=dict)
    blocked_since: float = 0.0
    """When a send to it first met a full queue, while one still waits (0: none waits)."""
    connection: int | None = None
    """Serial of the connection this identity's requests arrived on (None: not tracked)."""


class ClientTable:
    """Clients by identity, and the client socket's open connections."""

    def __init__(self) -> None:
        self._clients: dict[bytes, ClientState] = {}
        self._connections: dict[int, int] = {}
        """Open connections: file descriptor -> connection serial."""
        self._identity_of: dict[int, bytes] = {}
        """Connection serial -> the identity its last message carried."""
        self._serials = itertools.count(1)

    def __len__(self) -> int:
        return len(self._clients)

    def __iter__(self) -> Iterator[tuple[bytes, ClientState]]:
        """``(identity, state)`` of every client (a copy: safe to change the table meanwhile)."""
        return iter(list(self._clients.items()))

    def get(self, identity: bytes) -> ClientState | None:
        return self._clients.get(identity)

    # ------------------------------------------------------------ connections

    def connection_accepted(self, fd: int) -> None:
        self._connections[fd] = next(self._serials)

    def connection_closed(self, fd: int) -> bytes | None:
        """Forget the connection on ``fd``; the identity whose requests came over it, if any (it is gone)."""
        serial = self._connections.pop(fd, None)
        identity = self._identity_of.pop(serial, None)
        client = self._clients.get(identity) if identity is not None else None
        return identity if client is not None and client.connection == serial else None

    def connection_of(self, fd: int) -> int | None:
        """Serial of the open connection on file descriptor ``fd`` (None if unknown)."""
        return self._connections.get(fd)

    def heard(self, identity: bytes, connection: int | None, now: float) -> tuple[ClientState | None, bool]:
        """A message from ``identity`` arrived over ``connection``.

        Returns ``(its state or None, reconnected)``; ``reconnected`` is True
        when the identity's requests came over another connection: the caller
        ends them unseen (:meth:`pop`) and the identity starts afresh.
        """
        client = self._clients.get(identity)
        if connection is not None:
            self._identity_of[connection] = identity
            if client is not None and client.connection not in (None, connection):
                return client, True
        if client is not None:
            client.last_seen = now
        return client, False

    # ------------------------------------------------------------ requests

    def add(self, req: Request, connection: int | None, now: float) -> ClientState:
        """Register ``req`` as open for its client (created on its first request)."""
        client = self._clients.get(req.client)
        if client is None:
            client = self._clients[req.client] = ClientState(last_seen=now, connection=connection)
        client.requests[req.id] = req
        return client

    def remove(self, req: Request) -> None:
        """``req`` is delivered (or was never admitted): drop it; a client with nothing open is dropped too."""
        client = self._clients.get(req.client)
        if client is None:
            return
        if client.requests.get(req.id) is req:
            del client.requests[req.id]
        if not client.requests:
            del self._clients[req.client]

    def pop(self, identity: bytes) -> ClientState | None:
        """Drop a client that is gone; its state (with the requests it had open), or None if unknown."""
        return self._clients.pop(identity, None)

    # ------------------------------------------------------------ timeouts

    def expired(self, now: float, timeout_s: float) -> list[tuple[bytes, ClientState, str, float]]:
        """Clients past ``timeout_s``: ``(identity, state, verdict, seconds)`` with verdict

        - ``"silent"``: no message for ``timeout_s`` (seconds silent): gone;
        - ``"gone"``: not reading for ``STUCK_GIVE_UP_FACTOR * timeout_s`` (seconds stuck): gone;
        - ``"stuck"``: not reading for ``timeout_s``: cancel its requests, keep their last messages.
        """
        found = []
        for identity, client in self._clients.items():
            stuck_s = now - client.blocked_since if client.blocked_since else 0.0
            if now - client.last_seen > timeout_s:
                found.append((identity, client, "silent", now - client.last_seen))
            elif stuck_s > STUCK_GIVE_UP_FACTOR * timeout_s:
                found.append((identity, client, "gone", stuck_s))
            elif stuck_s > timeout_s:
                found.append((identity, client, "stuck", stuck_s))
        return found

"""What the front owes its clients: each stream's pending tokens as one Chunk, held while a client's queue is full.

A send at a client's high-water mark does not drop anything: the stream's
pending tokens stay pending, coalesce with later ones, and are retried every
``RETRY_SEND_S`` until they go or the client is declared gone (the client
table's ``expired``). The outbox never decides a client's fate: it reports the
identities it found unroutable and the core cancels their requests.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ringstream.daemon.front.client_table import ClientTable
from ringstream.daemon.front.metrics import Metrics
from ringstream.daemon.front.ports import Ports, SendResult
from ringstream.daemon.front.request import Request
from ringstream.ipc import protocol as P

__all__ = ["Outbox", "RETRY_SEND_S"]

RETRY_SEND_S = 0.002
"""Delay before retrying chunks that met a full client queue (EAGAIN)."""


class Outbox:
    """Pending chunks and terminal messages per request, and the streams blocked on a full client queue."""

    def __init__(self, clients: ClientTable, ports: Ports, metrics: Metrics, clock: Callable[[], float],
                 on_retry: Callable[[], None]) -> None:
        self.clients = clients
        self.on_retry = on_retry
        """Called when the retry timer fires (the core: it calls :meth:`retry` and ends gone clients)."""
        self.ports = ports
        self.metrics = metrics
        self.clock = clock
        self.blocked: dict[int, Request] = {}
        """Requests (by handle) whose last send met a full queue."""
        self.retry_armed = False
        self.lagged = False
        """A send met a full client queue since :meth:`watch_lag` (the shutdown then keeps its whole grace)."""

    def flush(self, requests: Iterable[Request]) -> list[bytes]:
        """Send what is pending for each request (one Chunk each, its terminal message merged in).

        Returns the identities found gone (unroutable): the caller ends their requests.
        """
        gone: list[bytes] = []
        for req in requests:
            if self._flush(req) == "gone" and req.client:
                gone.append(req.client)
        return gone

    def retry(self) -> list[bytes]:
        """The retry timer fired: send what was blocked; returns the identities found gone."""
        self.retry_armed = False
        gone = self.flush([r for r in list(self.blocked.values()) if self.blocked.get(r.handle) is r])
        for _, client in self.clients:
            if client.blocked_since and not any(r.handle in self.blocked for r in client.requests.values()):
                client.blocked_since = 0.0
        return gone

    def watch_lag(self) -> None:
        """Start noting whether any client lags (its queue fills) from now on."""
        self.lagged = False

    def forget(self, req: Request) -> None:
        """``req`` is delivered or was never admitted: it leaves the client table."""
        self.clients.remove(req)
        self.blocked.pop(req.handle, None)

    def drop(self, req: Request) -> None:
        """Its client is gone: nothing more is sent for ``req``."""
        self.blocked.pop(req.handle, None)

    def _flush(self, req: Request) -> SendResult | None:
        final = req.final
        if not (req.pending_ids or final) or (not req.msg.stream and final is None):
            return None
        if isinstance(final, P.Error):
            msg = final
        else:
            msg = P.Chunk(id=req.id, seq=req.chunk_seq, text="".join(req.pending_text), token_ids=req.pending_ids)
            if req.msg.sampling.logprobs is not None:
                msg.logprobs = req.pending_logprobs
            if req.prompt_logprobs is not None and req.pending_ids:
                msg.prompt_logprobs, msg.prompt_token_ids = req.prompt_logprobs, req.prompt_token_ids
            if final is not None:
                msg.finish_reason, msg.stop_reason, msg.usage = final.finish_reason, final.stop_reason, final.usage
        result = self.ports.send(req.client, msg) if req.client else "gone"
        if result == "sent":
            req.chunk_seq += 1
            req.pending_text = []
            req.pending_ids = []
            if isinstance(msg, P.Chunk):
                if msg.logprobs:
                    req.pending_logprobs = []
                if msg.prompt_logprobs is not None:
                    req.prompt_logprobs = None
            self.blocked.pop(req.handle, None)
            if final is not None:
                self.forget(req)
        elif result == "blocked":
            self.lagged = True
            if req.handle not in self.blocked:
                self.metrics.client_events.labels("send_blocked").inc()
            self.blocked[req.handle] = req
            client = self.clients.get(req.client)
            if client and not client.blocked_since:
                client.blocked_since = self.clock()
            if not self.retry_armed:
                self.retry_armed = True
                self.ports.call_later(RETRY_SEND_S, self.on_retry)
        return result

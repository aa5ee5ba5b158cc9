"""Client messages into core events: decode, validate, tokenise, and answer what needs no request.

Socket-free: the shell hands :meth:`Intake.on_frames` each message's frames
(identity first) and the serial of the connection it came through; replies go
out through the core's ports. A ``Generate`` becomes a :class:`Request`
admitted to the core once its prompt is tokenised and checked: inline for
prompts up to ``INLINE_TOKENIZE_CHARS`` (a chat's contents together: rendered
with the chat template, then tokenised), else on the tokenizer thread (the
request holds its id meanwhile, so a ``Cancel`` finds it).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Callable

import msgspec

from ringstream.daemon.front.core import FrontCore
from ringstream.daemon.front.request import Request, RequestStatus
from ringstream.daemon.front.validate import RequestRejected, Validator, prompt_chars
from ringstream.ipc import protocol as P

__all__ = ["INLINE_TOKENIZE_CHARS", "Intake", "MAX_TOKENIZING", "MAX_UNKNOWN_ANSWERS"]

log = logging.getLogger("ringstream.front")

INLINE_TOKENIZE_CHARS = 4096
"""Prompts up to this many characters are tokenised on the event loop (about 10 ms at worst); longer ones on
the tokenizer thread, so that no single frame can stall every other client."""
MAX_TOKENIZING = 64
"""Long prompts waiting for the tokenizer thread at most; more get QUEUE_FULL."""
MAX_UNKNOWN_ANSWERS = 64
"""Unknown ids one Heartbeat gets UNKNOWN_REQUEST answers for, at most: a client names its open ids in every
heartbeat, so the rest are answered by the next ones, and no single frame makes the front send thousands."""


class Intake:
    """Turns client frames into core calls and direct answers (heartbeat acks, status, admin).

    ``run_off_loop(fn)`` runs ``fn()`` on the tokenizer thread and returns a
    future (``add_done_callback``, ``result``, ``cancelled``) whose callbacks
    run on the loop; ``status(notes)`` builds a ``StatusReply``;
    ``admin_allowed`` says whether the client socket may change settings.
    """

    def __init__(self, core: FrontCore, validator: Validator, run_off_loop: Callable,
                 status: Callable[[list[str]], P.StatusReply], admin_allowed: bool) -> None:
        self.core = core
        self.validator = validator
        self.run_off_loop = run_off_loop
        self.status = status
        self.admin_allowed = admin_allowed
        self.handles = itertools.count(1)

    def reply(self, identity: bytes, msg) -> None:
        self.core.ports.send(identity, msg)

    def _refused(self, identity: bytes, rid: str | None, message: str) -> None:
        self.core.metrics.invalid.inc()
        self.core.metrics.dropped.labels("invalid").inc()
        self.reply(identity, P.Error(id=rid, code=P.ErrorCode.INVALID_REQUEST, message=message))

    def on_frames(self, frames: list[bytes], connection: int | None = None) -> None:
        """One client message: ``[identity, frame...]``."""
        core = self.core
        identity = frames[0]
        now = core.clock()
        client, reconnected = core.clients.heard(identity, connection, now)
        if reconnected:
            core.client_gone(identity, "connected again")  # its previous connection's requests end unseen
            client = None
        if len(frames) != 2:
            core.metrics.dropped.labels("frame_count").inc()
            self.reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST,
                                         message=f"expected 1 message frame, got {len(frames) - 1}"))
            return
        try:
            msg = P.CLIENT_DECODER.decode(frames[1])
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested deeper than the stack
            rid = guess_id(frames[1])
            if client is not None and rid in client.requests:
                rid = None  # never end a live stream because of another, broken frame
            self._refused(identity, rid, f"bad message: {P.explain(exc, frames[1])}")
            return
        match msg:
            case P.Generate():
                self._on_generate(identity, msg, now, connection)
            case P.Cancel(id=rid):
                req = client.requests.get(rid) if client else None
                if req is None:
                    self.reply(identity, P.Error(id=rid, code=P.ErrorCode.UNKNOWN_REQUEST,
                                                 message=f"no open request {rid!r}"))
                else:
                    core.abort(req, P.FinishReason.CANCELLED)
            case P.Heartbeat(open_ids=open_ids):
                self.reply(identity, P.HeartbeatAck())
                known = client.requests if client is not None else {}
                for rid in itertools.islice((rid for rid in open_ids if rid not in known), MAX_UNKNOWN_ANSWERS):
                    self.reply(identity, P.Error(id=rid, code=P.ErrorCode.UNKNOWN_REQUEST,
                                                 message=f"request {rid!r} is not known to this daemon "
                                                         "(it restarted, or the request was cancelled)"))
            case P.Status():
                self.reply(identity, self.status([]))
            case P.Admin(settings=settings):
                self._on_admin(identity, settings)
            case P.Metrics():
                self.reply(identity, P.MetricsReply(text=self.core.metrics.exposition()))

    def _on_generate(self, identity: bytes, msg: P.Generate, now: float, connection: int | None) -> None:
        core = self.core
        client = core.clients.get(identity)
        if client is not None and msg.id in client.requests:
            self._refused(identity, None, f"duplicate request id {msg.id!r}: it is still open")
            return
        if not core.state.accepts_requests:
            self.reply(identity, P.Error(id=msg.id, code=P.ErrorCode.SHUTTING_DOWN, message="daemon is shutting down"))
            return
        req = Request(identity, msg.id, next(self.handles), msg, [], now, queued_at=now)
        if prompt_chars(msg) > INLINE_TOKENIZE_CHARS:
            self._tokenize_off_loop(req, connection)
            return
        try:
            req.prompt_token_ids = self.validator.check(msg, core.scheduler.max_request_tokens())
        except RequestRejected as exc:
            core.reject(req, exc.code, str(exc))
            return
        core.admit(req, connection)

    def _tokenize_off_loop(self, req: Request, connection: int | None) -> None:
        """Tokenise a long prompt on the tokenizer thread; the request holds its id (Cancel finds it) meanwhile."""
        core = self.core
        try:
            self.validator.precheck(req.msg, self.validator.limit(core.scheduler.max_request_tokens()))
        except RequestRejected as exc:
            core.reject(req, exc.code, str(exc))
            return
        if core.tokenizing >= MAX_TOKENIZING:
            core.reject(req, P.ErrorCode.QUEUE_FULL, f"{core.tokenizing} long prompts are being tokenised already")
            return
        core.clients.add(req, connection, req.arrival)
        core.tokenizing += 1
        future = self.run_off_loop(functools.partial(self.validator.prompt_ids, req.msg, release_gil=True))
        future.add_done_callback(functools.partial(self._on_tokenized, req, connection))

    def _on_tokenized(self, req: Request, connection: int | None, future) -> None:
        core = self.core
        core.tokenizing -= 1
        core.advance_shutdown()  # the drain waits for tokenisations
        if future.cancelled() or not req.client:
            return  # stopping, or the client is gone: nothing to answer
        if req.status == RequestStatus.ABORTING:
            core.finish(req, req.abort_reason)  # cancelled meanwhile
            return
        if not core.state.accepts_requests:
            core.reject(req, P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
            return
        try:
            ids = future.result()
            limit = self.validator.limit(core.scheduler.max_request_tokens())
            req.prompt_token_ids = self.validator.finish(req.msg, ids, limit)
        except RequestRejected as exc:
            core.reject(req, exc.code, str(exc))
            return
        except Exception:
            log.exception("tokenising the prompt of request %s failed", req.id)
            core.metrics.internal_errors.inc()
            core.reject(req, P.ErrorCode.INTERNAL, "tokenisation failed")
            return
        core.admit(req, connection)

    def _on_admin(self, identity: bytes, settings: dict) -> None:
        if not self.admin_allowed:
            self.reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST,
                                         message="admin is accepted only on an ipc socket (its file mode says who may)"))
            return
        try:
            notes = self.core.apply_settings(settings)
        except ValueError as exc:
            self.reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST, message=str(exc)))
            return
        self.reply(identity, self.status(notes))


def guess_id(frame: bytes) -> str | None:
    """Best-effort request id of an undecodable frame, so its sender can match the error."""
    _, rid = P.frame_head(frame)
    return rid if rid and len(rid) <= P.MAX_ID_CHARS else None

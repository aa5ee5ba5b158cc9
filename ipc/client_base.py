"""What both clients share: address, socket, request building, reply routing, stream and liveness bookkeeping.

:class:`ClientBase` leaves only the waiting to its shells in
:mod:`ringstream.ipc.client`: :class:`~ringstream.ipc.client.Client` blocks in
``poll``, :class:`~ringstream.ipc.client.AsyncClient` is woken by its event loop.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from ringstream.ipc import protocol as P
from ringstream.ipc.address import client_socket, unreachable
from ringstream.ipc.errors import DaemonUnavailable, InvalidRequest, RingstreamError, StreamOrderError, error_from
from ringstream.ipc.liveness import Liveness

DEFAULT_HEARTBEAT_S = 1.0
"""Heartbeat period while streams are open, seconds (a third of the daemon's default 10 s or less)."""
DEFAULT_TIMEOUT_S = 30.0
"""Raise :class:`DaemonUnavailable` when the daemon has said nothing for this long, seconds."""

GENERATE_DEFAULTS: dict[str, object] = {
    f.name: f.default for cls in (P.SamplingParams, P.Generate) for f in msgspec.structs.fields(cls)
    if f.default is not msgspec.NODEFAULT and f.default is not None and not isinstance(f.default, msgspec.Struct)
}
"""The defaults of every request, by flat field name: those of the wire's
:class:`ringstream.ipc.protocol.SamplingParams` (``max_tokens`` 16, ``temperature`` 1.0, ``top_p`` 1.0,
``top_k`` 0, ...) and :class:`~ringstream.ipc.protocol.Generate` (``priority`` 0, ...), the same for the
library, the CLI and raw protocol clients."""


@dataclass
class Completion:
    """A whole generation, as returned by ``complete()``.

    ``logprobs``: with the ``logprobs`` parameter, one
    :class:`ringstream.ipc.protocol.TokenLogprob` per entry of ``token_ids``
    (else None). ``prompt_logprobs`` / ``prompt_token_ids``: with
    ``prompt_logprobs``, one entry per prompt token, None for the first.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    usage: P.Usage | None
    chunks: int
    logprobs: list[P.TokenLogprob] | None = None
    prompt_logprobs: list[P.TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None


def join_chunks(chunks: list[P.Chunk]) -> Completion:
    """One :class:`Completion` of a whole stream's chunks (the last one has ``finish_reason``)."""
    last = chunks[-1]
    asked = any(c.logprobs is not None for c in chunks)
    first = next((c for c in chunks if c.prompt_logprobs is not None), None)
    return Completion(
        text="".join(c.text for c in chunks), token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=str(last.finish_reason), stop_reason=last.stop_reason, usage=last.usage, chunks=len(chunks),
        logprobs=[lp for c in chunks for lp in c.logprobs or ()] if asked else None,
        prompt_logprobs=first.prompt_logprobs if first else None,
        prompt_token_ids=first.prompt_token_ids if first else None,
    )


class Stream:
    """One open request: its replies not read yet, and the checks of their order."""

    __slots__ = ("id", "expected_seq", "done", "items")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.expected_seq = 0
        self.done = False
        self.items: deque[P.Chunk | P.Error] = deque()

    def put(self, msg: P.Chunk | P.Error) -> None:
        self.items.append(msg)

    def accept(self, msg: P.Chunk | P.Error) -> P.Chunk:
        """Check ``msg``; return the chunk or raise its typed error (StreamOrderError for a broken order)."""
        if self.done:
            raise StreamOrderError(f"request {self.id}: message after the terminal one")
        if isinstance(msg, P.Error):
            self.done = True
            raise error_from(msg)
        if msg.seq != self.expected_seq:
            self.done = True
            raise StreamOrderError(f"request {self.id}: chunk seq {msg.seq}, expected {self.expected_seq}")
        self.expected_seq += 1
        self.done = msg.finish_reason is not None
        return msg


def _new_identity() -> bytes:
    return b"rs-" + os.urandom(8).hex().encode()


def _connect(address: str, identity: bytes | None, curve_server_key: bytes | None,
             curve_public_key: bytes | None, curve_secret_key: bytes | None) -> tuple[zmq.Context, zmq.Socket]:
    """A new context and a DEALER socket of it connected to ``address``, CURVE-secured when keys are given.

    Raises ValueError unless all three CURVE keys or none are given (nothing is left open then).
    """
    keys = (curve_server_key, curve_public_key, curve_secret_key)
    if any(k is not None for k in keys) and not all(k is not None for k in keys):
        raise ValueError("CURVE needs curve_server_key, curve_public_key and curve_secret_key together")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, identity or _new_identity())
        sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            sock.curve_serverkey = curve_server_key
            sock.curve_publickey = curve_public_key
            sock.curve_secretkey = curve_secret_key
        sock.connect(address)
    except Exception:  # e.g. ZMQError for a malformed address: close what was opened
        sock.close(linger=0)
        ctx.term()
        raise
    return ctx, sock


def _request_params(params: dict) -> dict:
    """``params`` with ``stop`` as the wire's list: one string becomes a list of it, ``None`` none; ``messages``
    (``{"role", "content"[, "name"]}`` dicts) as :class:`ringstream.ipc.protocol.ChatMessage` (TypeError for
    another key)."""
    messages = params.get("messages")
    if messages is not None:
        params = {**params, "messages": [m if isinstance(m, P.ChatMessage) else P.ChatMessage(**m) for m in messages]}
    stop = params.get("stop")
    if isinstance(stop, str):
        return {**params, "stop": [stop]}
    if stop is None and "stop" in params:
        return {k: v for k, v in params.items() if k != "stop"}
    if isinstance(stop, tuple):
        return {**params, "stop": list(stop)}
    return params


def _generate_frame(rid: str, prompt: str | None, prompt_token_ids: list[int] | None, params: dict) -> bytes:
    """The encoded ``Generate`` of flat ``params`` (the one place a client builds it, sampling fields nested by
    :func:`ringstream.ipc.protocol.make_generate`); TypeError for an unknown parameter, InvalidRequest for
    what cannot be sent.

    What cannot be sent: an integer outside msgpack's 64-bit range, or a frame
    over the daemon's ``MAX_FRAME_BYTES`` (ZeroMQ would drop the connection).
    """
    try:
        msg = P.make_generate(rid, prompt=prompt, prompt_token_ids=prompt_token_ids, **_request_params(params))
    except TypeError as exc:
        raise TypeError(f"generate(): {exc}") from None
    try:
        frame = P.encode(msg)
    except OverflowError as exc:
        raise InvalidRequest(f"{P.ErrorCode.INVALID_REQUEST}: {exc}", rid) from None
    if len(frame) > P.MAX_FRAME_BYTES:
        raise InvalidRequest(f"{P.ErrorCode.INVALID_REQUEST}: the request is {len(frame):,} bytes encoded; the daemon "
                             f"takes at most {P.MAX_FRAME_BYTES:,} (prompts: {P.MAX_PROMPT_CHARS:,} characters)", rid)
    return frame


class ClientBase:
    """What :class:`Client` and :class:`AsyncClient` share; not used directly.

    Args:
        address: the daemon's ZeroMQ address, ``ipc://PATH`` or ``tcp://HOST:PORT``
            (default: :func:`ringstream.ipc.address.client_socket` of ``instance``:
            ``$RINGSTREAM_SOCKET``, the systemd service's socket, or the per-user default).
        instance: a daemon instance name, for its default socket (ignored with ``address``).
        identity: a fixed ZeroMQ routing id (default: random per client).
        heartbeat_s: heartbeat period while streams are open, seconds.
        timeout_s: silence after which a waiting call raises :class:`DaemonUnavailable`, seconds.
        curve_server_key, curve_public_key, curve_secret_key: CURVE keys (Z85
            bytes), see the module docstring.

    Raises:
        ValueError: some but not all CURVE keys, or a ``$RINGSTREAM_SOCKET`` that is
            neither ``ipc://`` nor ``tcp://``.
        zmq.ZMQError: an address ZeroMQ cannot use.
    """

    _stream_type: type[Stream] = Stream

    def __init__(self, address: str | None = None, *, instance: str | None = None, identity: bytes | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None) -> None:
        self.address = address or client_socket(instance)
        self._live = Liveness(heartbeat_s, timeout_s)
        self._ctx, self._sock = _connect(self.address, identity, curve_server_key, curve_public_key,
                                         curve_secret_key)
        self._streams: dict[str, Stream] = {}
        self._waiters: deque = deque()
        """``status()`` / ``admin()`` calls waiting for their answer, oldest first (futures, or the blocking client's stand-ins)."""
        self._closed = False
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self.stray_errors: deque[P.Error] = deque(maxlen=100)
        """Errors that named no open request (e.g. UNKNOWN_REQUEST for the cancel of a stream that had ended)."""
        self.decode_errors: deque[str] = deque(maxlen=100)
        """Replies this client could not decode (a newer daemon's message types), skipped."""

    @property
    def heartbeat_s(self) -> float:
        """Seconds between heartbeats while requests are open (also the liveness probe's period); settable."""
        return self._live.heartbeat_s

    @heartbeat_s.setter
    def heartbeat_s(self, value: float) -> None:
        self._live.heartbeat_s = value

    @property
    def timeout_s(self) -> float:
        """Seconds of daemon silence, with requests open, before they fail with DaemonUnavailable; settable."""
        return self._live.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._live.timeout_s = value

    # -- hooks of the shells ----------------------------------------------------------------

    def _start(self) -> None:
        """Called when a request is about to be sent (the async client starts its reader and heartbeat)."""

    def _nudge(self) -> None:
        """Called after a request was sent: liveness checks may be due sooner than planned."""

    def _after_send(self) -> None:
        """Called after every send attempt."""

    # -- requests -----------------------------------------------------------------------------

    def _request(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None, rid: str | None,
                 params: dict) -> tuple[str, bytes]:
        """A request id and the encoded ``Generate``; ValueError for an id open already, see :func:`_generate_frame`."""
        rid = rid or f"{self._prefix}-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already open on this client")
        if isinstance(prompt, (list, tuple)) and prompt_token_ids is None:  # token ids given as the prompt
            prompt, prompt_token_ids = None, list(prompt)
        return rid, _generate_frame(rid, prompt, prompt_token_ids, params)

    def _before_request(self) -> float:
        """Check the client is open and the daemon reachable; start the silence clock if nothing was outstanding.

        The clock restarts only when nothing was outstanding: new requests must
        not hide a daemon that stopped answering the ones already open. Returns
        the time now. Raises RingstreamError after ``close()``, DaemonUnavailable
        when the ipc socket cannot be served (see :func:`ringstream.ipc.address.unreachable`).
        """
        if self._closed:
            raise RingstreamError("the client is closed")
        now = time.monotonic()
        if self._live.probe_before_request(now):
            reason = unreachable(self.address)
            if reason is not None:
                raise DaemonUnavailable(reason)
        if not self._streams and not self._waiters:
            self._live.start_clock(now)
        return now

    def _open_stream(self, rid: str, frame: bytes) -> Stream:
        """Register request ``rid`` and send its frame; DaemonUnavailable if it cannot be sent."""
        now = self._before_request()
        if not self._streams:
            self._live.first_stream(now)
        stream = self._streams[rid] = self._stream_type(rid)
        self._start()
        if not self._send(frame):
            del self._streams[rid]
            raise DaemonUnavailable(f"cannot send to {self.address}: its queue is full")
        self._nudge()
        return stream

    def _close_stream(self, stream: Stream) -> None:
        """Forget ``stream``; cancel its request on the daemon unless it ended."""
        self._streams.pop(stream.id, None)
        if not stream.done:
            self._send(P.Cancel(id=stream.id))

    def _open_call(self, msg: P.Status | P.Admin | P.Metrics, waiter) -> None:
        """Queue ``waiter`` for the answer to ``msg`` and send it; DaemonUnavailable if it cannot be sent."""
        now = self._before_request()
        self._waiters.append(waiter)
        self._start()
        if not self._send(msg):
            self._drop_waiter(waiter)
            raise DaemonUnavailable(f"cannot send to {self.address}: its queue is full")
        self._live.pinged(now)
        self._nudge()

    def _drop_waiter(self, waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def _next_waiter(self):
        """The oldest call still waiting (abandoned ones are dropped), or None."""
        waiters = self._waiters
        while waiters and waiters[0].done():
            waiters.popleft()
        return waiters.popleft() if waiters else None

    def _send(self, msg: P.Struct | bytes) -> bool:
        """Send without waiting; False if the socket's queue is full or the socket is closed (nothing sent)."""
        if self._sock.closed:
            return False
        try:
            self._sock.send(msg if isinstance(msg, bytes) else P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        finally:
            self._after_send()

    # -- replies and liveness -----------------------------------------------------------------

    def _on_frame(self, frame: bytes) -> None:
        """Route one reply to its stream or waiting call."""
        self._live.heard(time.monotonic())
        try:
            msg = P.SERVER_DECODER.decode(frame)
        except msgspec.DecodeError as exc:
            self.decode_errors.append(str(exc))
            return
        match msg:
            case P.Chunk(id=rid) | P.Error(id=rid) if rid in self._streams:
                self._streams[rid].put(msg)
            case P.StatusReply() | P.MetricsReply():
                waiter = self._next_waiter()
                if waiter is not None:
                    waiter.set_result(msg)
            case P.Error(id=None) if (waiter := self._next_waiter()) is not None:
                waiter.set_exception(error_from(msg))  # an admin refusal; errors naming a request are not theirs
            case P.Error():
                self.stray_errors.append(msg)

    def _keep_alive(self, now: float) -> None:
        """Heartbeat when due; raise DaemonUnavailable when the ipc socket stopped listening or silence lasted ``timeout_s``."""
        live = self._live
        if self._streams and live.heartbeat_due(now):
            live.heartbeat_sent(now)
            if self._send(P.Heartbeat(open_ids=list(self._streams))):
                live.pinged(now)
        if live.probe_due(now):
            live.probed()
            reason = unreachable(self.address)
            if reason is not None:
                raise DaemonUnavailable(reason)
        if (self._streams or self._waiters) and live.silent_s(now) > live.timeout_s:
            raise DaemonUnavailable(f"no answer from {self.address} for {live.timeout_s:g} s")

    def _not_ready(self, timeout_s: float) -> DaemonUnavailable:
        skipped = f" (undecodable replies: {self.decode_errors[-1]})" if self.decode_errors else ""
        return DaemonUnavailable(f"daemon at {self.address} not ready after {timeout_s:g} s{skipped}")

    def _close_socket(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

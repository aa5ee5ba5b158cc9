"""Client library: stream generations from a ringstream daemon.

Two flavours over one ZeroMQ DEALER socket each:

* :class:`AsyncClient` for asyncio code: any number of concurrent streams;
  a background task routes replies by request id and heartbeats while
  streams are open;
* :class:`Client` for plain code: one thread, streams consumed by iterating;
  it heartbeats while it waits for the daemon, so a caller that stops
  iterating for longer than the daemon's ``client_timeout_s`` (10 s by
  default) has its requests cancelled, as any client that stops reading.

Over TCP to a daemon with CURVE configured, pass the server's public key and
this client's key pair (``curve_server_key``, ``curve_public_key``,
``curve_secret_key``: Z85 bytes, as ``zmq.auth.load_certificate`` returns);
a client whose key the daemon does not list gets no answer at all
(:class:`DaemonUnavailable` after ``timeout_s``).

One connection at a time per ``identity``: the daemon refuses a second
connection claiming an identity that is connected already (it gets no answer),
and cancels an identity's requests when its connection closes, so a client
that connects again with the same identity starts afresh.

Both check that each stream's chunks arrive with ``seq`` 0, 1, 2... and end
with exactly one terminal message, and raise a typed :class:`ServerError`
subclass for an error code. Leaving a stream early (``break``, an exception,
``close()``) cancels the request on the daemon.

Example::

    with Client() as client:
        for chunk in client.generate("The socket module", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import msgspec
import zmq

from ringstream.ipc import protocol as P
from ringstream.ipc.aio import SocketPump
from ringstream.ipc.address import default_socket

DEFAULT_HEARTBEAT_S = 1.0
"""Heartbeat period while streams are open, seconds (a third of the daemon's default 10 s or less)."""
DEFAULT_TIMEOUT_S = 30.0
"""Raise :class:`DaemonUnavailable` when the daemon has said nothing for this long, seconds."""


class RingstreamError(Exception):
    """Base of every error this library raises."""


class DaemonUnavailable(RingstreamError):
    """No answer from the daemon within the client's ``timeout_s``."""


class StreamOrderError(RingstreamError):
    """A chunk arrived out of ``seq`` order, or after the terminal message."""


class ServerError(RingstreamError):
    """The daemon ended a request with an ``Error``; ``code`` is its error code."""

    code = P.ErrorCode.INTERNAL

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class InvalidRequest(ServerError):
    code = P.ErrorCode.INVALID_REQUEST


class PromptTooLong(ServerError):
    code = P.ErrorCode.PROMPT_TOO_LONG


class QueueFull(ServerError):
    code = P.ErrorCode.QUEUE_FULL


class QueueTimeout(ServerError):
    code = P.ErrorCode.QUEUE_TIMEOUT


class WorkerFailed(ServerError):
    code = P.ErrorCode.WORKER_FAILED


class ShuttingDown(ServerError):
    code = P.ErrorCode.SHUTTING_DOWN


class UnknownRequest(ServerError):
    code = P.ErrorCode.UNKNOWN_REQUEST


class InternalError(ServerError):
    code = P.ErrorCode.INTERNAL


ERRORS: dict[str, type[ServerError]] = {cls.code: cls for cls in ServerError.__subclasses__()}


def error_from(msg: P.Error) -> ServerError:
    """The typed exception for an ``Error`` message."""
    return ERRORS.get(msg.code, InternalError)(f"{msg.code}: {msg.message}", msg.id)


@dataclass
class Completion:
    """A whole generation, as returned by ``complete()``."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    usage: P.Usage | None
    chunks: int


@dataclass
class _Stream:
    """Order checking for one request's replies."""

    id: str
    expected_seq: int = 0
    done: bool = False
    inbox: deque = field(default_factory=deque)

    def accept(self, msg: P.Chunk | P.Error) -> P.Chunk:
        """Check ``msg``; return the chunk or raise its typed error."""
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


def _generate_frame(rid: str, prompt: str | None, prompt_token_ids: list[int] | None, params: dict) -> bytes:
    """The encoded ``Generate``; TypeError for an unknown parameter, InvalidRequest for what cannot be sent.

    What cannot be sent: an integer outside msgpack's 64-bit range, or a frame
    over the daemon's ``MAX_FRAME_BYTES`` (ZeroMQ would drop the connection).
    """
    try:
        msg = P.Generate(id=rid, prompt=prompt, prompt_token_ids=prompt_token_ids, **params)
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


def _join(chunks: list[P.Chunk]) -> Completion:
    last = chunks[-1]
    return Completion(
        text="".join(c.text for c in chunks), token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=str(last.finish_reason), stop_reason=last.stop_reason, usage=last.usage, chunks=len(chunks),
    )


class _Inbox:
    """Replies of one stream of an :class:`AsyncClient`, awaited without a timer per reply."""

    __slots__ = ("items", "waiter", "error")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.error: Exception | None = None

    def put(self, msg) -> None:
        self.items.append(msg)
        self.error = None  # the daemon spoke again
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: Exception) -> None:
        """Make the stream's next wait for a reply (or the current one) raise ``exc``."""
        self.error = exc
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def get(self):
        """The next reply; raises what :meth:`fail` gave when no reply is queued."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class AsyncClient:
    """asyncio client; use ``async with AsyncClient() as c`` or call :meth:`close`.

    ``address``: the daemon's ZeroMQ address (default: the instance's
    socket, see :func:`ringstream.ipc.address.default_socket`). ``identity``: a fixed
    ZeroMQ routing id (default: random per client). ``heartbeat_s`` and
    ``timeout_s`` in seconds. ``curve_*``: CURVE keys (Z85 bytes), see the
    module docstring; ValueError unless all three or none are given;
    ``zmq.ZMQError`` for an address ZeroMQ cannot use (e.g. no ``ipc://``/``tcp://``).
    """

    def __init__(self, address: str | None = None, *, instance: str = "default", identity: bytes | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None) -> None:
        self.address = address or default_socket(instance)
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._ctx, self._sock = _connect(self.address, identity, curve_server_key, curve_public_key,
                                         curve_secret_key)
        self._pump = SocketPump(self._sock, self._on_frame)
        self._streams: dict[str, _Inbox] = {}
        self._status_waiters: deque[asyncio.Future] = deque()
        self._closed = False
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self._last_rx = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self.stray_errors: deque[P.Error] = deque(maxlen=100)
        """Errors that named no open request (e.g. for an undecodable frame)."""
        self.decode_errors: deque[str] = deque(maxlen=100)
        """Replies this client could not decode (a newer daemon's message types), skipped."""

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel open streams on the daemon and close the socket.

        A stream still being read elsewhere raises :class:`RingstreamError` at its next wait.
        """
        self._closed = True
        closed = RingstreamError("the client was closed")
        for rid, inbox in list(self._streams.items()):
            self._send_nowait(P.Cancel(id=rid))
            inbox.fail(closed)
        for waiter in self._status_waiters:
            if not waiter.done():
                waiter.set_exception(closed)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._pump.stop()
        self._sock.close(linger=0)
        self._ctx.term()

    def _begin(self) -> None:
        """Before a request: check the client is open, start its reader and heartbeat, start the silence clock.

        The clock (``timeout_s`` of silence) restarts only when nothing was
        outstanding: new requests must not hide a daemon that stopped answering
        the ones already open. Raises RingstreamError after :meth:`close`.
        """
        if self._closed:
            raise RingstreamError("the client is closed")
        if not self._tasks:
            self._pump.start()
            self._tasks = [asyncio.create_task(self._heartbeat())]
        if not self._streams and not self._status_waiters:
            self._last_rx = time.monotonic()

    def _next_waiter(self) -> asyncio.Future | None:
        """The oldest status waiter still waiting (cancelled ones are dropped), or None."""
        waiters = self._status_waiters
        while waiters and waiters[0].done():
            waiters.popleft()
        return waiters.popleft() if waiters else None

    def _send_nowait(self, msg: P.Struct | bytes) -> bool:
        """Send without waiting; False if the socket's queue is full or the client is closed (nothing sent)."""
        if self._sock.closed:
            return False
        try:
            self._sock.send(msg if isinstance(msg, bytes) else P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        finally:
            self._pump.kick()  # a send may take the socket's read edge (see ipc.aio)

    def _on_frame(self, frame: bytes) -> None:
        """Route one reply to its stream or status waiter (called by the socket pump)."""
        self._last_rx = time.monotonic()
        try:
            msg = P.SERVER_DECODER.decode(frame)
        except msgspec.DecodeError as exc:
            self.decode_errors.append(str(exc))
            return
        match msg:
            case P.Chunk(id=rid) | P.Error(id=rid) if rid in self._streams:
                self._streams[rid].put(msg)
            case P.StatusReply():
                waiter = self._next_waiter()
                if waiter is not None:
                    waiter.set_result(msg)
            case P.Error(id=None) if (waiter := self._next_waiter()) is not None:
                waiter.set_exception(error_from(msg))  # an admin refusal; errors naming a request are not theirs
            case P.Error():
                self.stray_errors.append(msg)  # e.g. UNKNOWN_REQUEST for the cancel of a stream that had ended

    async def _heartbeat(self) -> None:
        """While anything is open: heartbeat, and fail every waiter once the daemon is silent for ``timeout_s``."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self._streams:
                self._send_nowait(P.Heartbeat(open_ids=list(self._streams)))
            if (self._streams or self._status_waiters) and time.monotonic() - self._last_rx > self.timeout_s:
                silent = DaemonUnavailable(f"no answer from {self.address} for {self.timeout_s:.0f} s")
                for inbox in self._streams.values():
                    inbox.fail(silent)
                while self._status_waiters:
                    waiter = self._status_waiters.popleft()
                    if not waiter.done():
                        waiter.set_exception(silent)

    async def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       id: str | None = None, **params) -> AsyncIterator[P.Chunk]:
        """Stream one generation: yields ``Chunk``s; the last has ``finish_reason``.

        ``params`` are :class:`ringstream.ipc.protocol.Generate` fields (``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``priority``, ``queue_timeout_s``,
        ``timeout_s``, ``stream``). Raises a :class:`ServerError` subclass
        for an error reply, :class:`StreamOrderError`, :class:`DaemonUnavailable`,
        or TypeError for an unknown parameter.
        """
        rid = id or f"{self._prefix}-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already open on this client")
        frame = _generate_frame(rid, prompt, prompt_token_ids, params)
        self._begin()
        inbox = self._streams[rid] = _Inbox()
        stream = _Stream(rid)
        try:
            if not self._send_nowait(frame):
                stream.done = True
                raise DaemonUnavailable(f"cannot send to {self.address}: its queue is full")
            while not stream.done:
                yield stream.accept(inbox.items.popleft() if inbox.items else await inbox.get())
        finally:
            del self._streams[rid]
            if not stream.done:
                self._send_nowait(P.Cancel(id=rid))

    async def complete(self, prompt: str | None = None, **params) -> Completion:
        """Run one generation to the end and return it whole (same arguments as :meth:`generate`)."""
        return _join([chunk async for chunk in self.generate(prompt, **params)])

    async def status(self) -> P.StatusReply:
        """The daemon's live figures. Raises DaemonUnavailable if it does not answer."""
        self._begin()
        waiter = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        if not self._send_nowait(P.Status()):
            self._status_waiters.remove(waiter)
            raise DaemonUnavailable(f"cannot send to {self.address}: its queue is full")
        try:
            return await waiter
        finally:
            if waiter in self._status_waiters:
                self._status_waiters.remove(waiter)

    async def wait_ready(self, timeout_s: float = 300.0) -> P.StatusReply:
        """Poll ``status()`` until the daemon reports ready. Raises DaemonUnavailable on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = await asyncio.wait_for(self.status(), timeout=min(2.0, max(0.01, deadline - time.monotonic())))
                if reply.ready:
                    return reply
                await asyncio.sleep(0.05)
            except (asyncio.TimeoutError, DaemonUnavailable):
                pass
            if time.monotonic() > deadline:
                skipped = f" (undecodable replies: {self.decode_errors[-1]})" if self.decode_errors else ""
                raise DaemonUnavailable(f"daemon at {self.address} not ready after {timeout_s:.0f} s{skipped}")


class Client:
    """Blocking client for one thread; see the module docstring. Use as a context manager.

    Arguments as :class:`AsyncClient`'s.
    """

    def __init__(self, address: str | None = None, *, instance: str = "default", identity: bytes | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None) -> None:
        self.address = address or default_socket(instance)
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._ctx, self._sock = _connect(self.address, identity, curve_server_key, curve_public_key,
                                         curve_secret_key)
        self._streams: dict[str, _Stream] = {}
        self._refusals: deque[P.Error] = deque()
        self._status: deque[P.StatusReply] = deque()
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self.stray_errors: deque[P.Error] = deque(maxlen=100)
        self.decode_errors: deque[str] = deque(maxlen=100)
        self._last_heartbeat = time.monotonic()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel open streams on the daemon and close the socket."""
        for rid in list(self._streams):
            self._send(P.Cancel(id=rid))
        self._sock.close(linger=0)
        self._ctx.term()

    def _send(self, msg: P.Struct | bytes) -> None:
        if not self._sock.closed:  # a stream left open after close() has nothing to cancel any more
            self._sock.send(msg if isinstance(msg, bytes) else P.encode(msg), zmq.NOBLOCK)

    def _pump(self) -> None:
        """Receive one message (heartbeating while streams are open) and route it."""
        last_rx = time.monotonic()
        while True:
            if self._streams and time.monotonic() - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = time.monotonic()
                self._send(P.Heartbeat(open_ids=list(self._streams)))
            if self._sock.poll(int(self.heartbeat_s * 1000)):
                break
            if time.monotonic() - last_rx > self.timeout_s:
                raise DaemonUnavailable(f"no answer from {self.address} for {self.timeout_s:.0f} s")
        try:
            msg = P.SERVER_DECODER.decode(self._sock.recv())
        except msgspec.DecodeError as exc:
            self.decode_errors.append(str(exc))
            return
        match msg:
            case P.Chunk(id=rid) | P.Error(id=rid) if rid in self._streams:
                self._streams[rid].inbox.append(msg)
            case P.StatusReply():
                self._status.append(msg)
            case P.Error(id=None):
                self._refusals.append(msg)  # an admin refusal (errors naming a request are not one)
                self.stray_errors.append(msg)
            case P.Error():
                self.stray_errors.append(msg)

    def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                 id: str | None = None, **params) -> Iterator[P.Chunk]:
        """Stream one generation; see :meth:`AsyncClient.generate` for arguments and errors."""
        rid = id or f"{self._prefix}-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already open on this client")
        frame = _generate_frame(rid, prompt, prompt_token_ids, params)
        stream = self._streams[rid] = _Stream(rid)
        try:
            self._send(frame)
            while not stream.done:
                while not stream.inbox:
                    self._pump()
                yield stream.accept(stream.inbox.popleft())
        finally:
            del self._streams[rid]
            if not stream.done:
                self._send(P.Cancel(id=rid))

    def complete(self, prompt: str | None = None, **params) -> Completion:
        """Run one generation to the end and return it whole."""
        return _join(list(self.generate(prompt, **params)))

    def status(self) -> P.StatusReply:
        """The daemon's live figures. Raises DaemonUnavailable if it does not answer."""
        self._status.clear()
        self._send(P.Status())
        while not self._status:
            self._pump()
        return self._status.popleft()

    def admin(self, **settings) -> P.StatusReply:
        """Change live settings (``max_concurrency=8``...); returns the status with the values in force.

        Raises :class:`InvalidRequest` for an unknown setting or a bad value.
        """
        self._status.clear()
        self._refusals.clear()
        self._send(P.Admin(settings=settings))
        while not self._status:
            self._pump()
            if self._refusals:
                raise error_from(self._refusals.popleft())
        return self._status.popleft()

    def wait_ready(self, timeout_s: float = 300.0) -> P.StatusReply:
        """Poll ``status()`` until the daemon reports ready. Raises DaemonUnavailable on timeout."""
        deadline = time.monotonic() + timeout_s
        saved, self.timeout_s = self.timeout_s, min(self.timeout_s, 2.0)
        try:
            while True:
                try:
                    reply = self.status()
                    if reply.ready:
                        return reply
                except DaemonUnavailable:
                    pass
                if time.monotonic() > deadline:
                    skipped = f" (undecodable replies: {self.decode_errors[-1]})" if self.decode_errors else ""
                    raise DaemonUnavailable(f"daemon at {self.address} not ready after {timeout_s:.0f} s{skipped}")
                time.sleep(0.05)
        finally:
            self.timeout_s = saved

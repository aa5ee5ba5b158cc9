"""Client library: stream generations from a ringstream daemon.

Two flavours over one ZeroMQ DEALER socket each, on one shared base
(:class:`ClientBase`: request building, reply routing, stream and liveness
bookkeeping):

* :class:`AsyncClient` for asyncio code: any number of concurrent streams;
  a background task heartbeats while streams are open;
* :class:`Client` for plain code: one thread, streams consumed by iterating;
  it heartbeats while it waits for the daemon, so a caller that stops
  iterating for longer than the daemon's ``client_timeout_s`` (10 s by
  default) has its requests cancelled, as any client that stops reading.

Given no address, a client uses ``$RINGSTREAM_SOCKET``, else the systemd
service's socket when it exists, else the per-user default socket
(:func:`ringstream.ipc.address.client_socket`).

No daemon, no wait: on an ``ipc://`` address a request fails at once with
:class:`DaemonUnavailable` when the socket file is missing, stale (its daemon
is gone) or closed to this user ("permission denied"); a daemon that dies
while requests are open is noticed within a heartbeat period plus
:data:`PROBE_AFTER_S` (its heartbeat goes unanswered, the socket refuses
connections). A daemon that is there but says nothing (stopped, or refusing
this client's identity or CURVE key) gives :class:`DaemonUnavailable` after
``timeout_s`` of silence.

Over TCP to a daemon with CURVE configured, pass the server's public key and
this client's key pair (``curve_server_key``, ``curve_public_key``,
``curve_secret_key``: Z85 bytes, as ``zmq.auth.load_certificate`` returns);
a client whose key the daemon does not list gets no answer at all.

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
import contextlib
import math
import time
from typing import AsyncIterator, Iterator

from ringstream.ipc import protocol as P
from ringstream.ipc.aio import SocketPump
from ringstream.ipc.client_base import (
    DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S, GENERATE_DEFAULTS, ClientBase, Completion, Stream, join_chunks,
)
from ringstream.ipc.errors import (
    ERRORS, DaemonUnavailable, InternalError, InvalidRequest, PromptTooLong, QueueFull, QueueTimeout, RingstreamError,
    ServerError, ShuttingDown, StreamOrderError, UnknownRequest, WorkerFailed, error_from,
)
from ringstream.ipc.liveness import MIN_WAIT_S, PROBE_AFTER_S, Liveness

__all__ = [
    "AsyncClient", "Client", "ClientBase", "Completion", "DEFAULT_HEARTBEAT_S", "DEFAULT_TIMEOUT_S",
    "DaemonUnavailable", "ERRORS", "GENERATE_DEFAULTS", "InternalError", "InvalidRequest", "Liveness",
    "PROBE_AFTER_S", "PromptTooLong", "QueueFull", "QueueTimeout", "RingstreamError", "ServerError", "ShuttingDown",
    "StreamOrderError", "UnknownRequest", "WorkerFailed", "error_from",
]

READY_POLL_S = 0.05
"""Pause between two ``status()`` calls of ``wait_ready()``, seconds."""
READY_STATUS_WAIT_S = 2.0
"""How long ``wait_ready()`` waits for one ``status()`` answer, seconds."""


class _AsyncStream(Stream):
    """A stream of an :class:`AsyncClient`: replies are awaited without a timer per reply."""

    __slots__ = ("waiter", "error")

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.waiter: asyncio.Future | None = None
        self.error: Exception | None = None

    def put(self, msg: P.Chunk | P.Error) -> None:
        self.items.append(msg)
        self.error = None  # the daemon spoke again
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: Exception) -> None:
        """Make the stream's next wait for a reply (or the current one) raise ``exc``."""
        self.error = exc
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def get(self) -> P.Chunk | P.Error:
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


class _Reply:
    """A blocking ``status()`` or ``admin()`` call's answer: the part of ``asyncio.Future`` the base uses."""

    __slots__ = ("_value", "_error", "_done")

    def __init__(self) -> None:
        self._value: P.StatusReply | None = None
        self._error: Exception | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: P.StatusReply) -> None:
        self._value, self._done = value, True

    def set_exception(self, exc: Exception) -> None:
        self._error, self._done = exc, True

    def result(self) -> P.StatusReply:
        if self._error is not None:
            raise self._error
        return self._value


class AsyncClient(ClientBase):
    """asyncio client; use ``async with AsyncClient() as c`` or call :meth:`close`. Arguments: :class:`ClientBase`."""

    _stream_type = _AsyncStream

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pump = SocketPump(self._sock, self._on_frame)
        self._task: asyncio.Task | None = None
        self._wakeup = asyncio.Event()
        self._sleep_until = math.inf
        """When the keep-alive task wakes next (monotonic seconds; inf: when woken)."""

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel open streams on the daemon and close the socket.

        A stream still being read elsewhere raises :class:`RingstreamError` at its next wait.
        """
        if self._closed:
            return
        self._closed = True
        closed = RingstreamError("the client was closed")
        for stream in list(self._streams.values()):
            self._send(P.Cancel(id=stream.id))
        self._fail_all(closed)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._pump.stop()
        self._close_socket()

    def _start(self) -> None:
        if self._task is None:
            self._pump.start()
            self._task = asyncio.create_task(self._keep_alive_loop())

    def _nudge(self) -> None:
        now = time.monotonic()
        if now + self._live.next_wake_s(now, bool(self._streams)) < self._sleep_until:
            self._wakeup.set()

    def _after_send(self) -> None:
        self._pump.kick()  # a send may take the socket's read edge (see ipc.aio)

    def _fail_all(self, exc: Exception) -> None:
        """Make every open stream and waiting call raise ``exc``."""
        for stream in self._streams.values():
            stream.fail(exc)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    async def _keep_alive_loop(self) -> None:
        """While anything is open: heartbeat, probe, and fail every wait once the daemon is gone or silent."""
        while True:
            now = time.monotonic()
            try:
                self._keep_alive(now)
            except DaemonUnavailable as exc:
                self._fail_all(exc)
            wait = self._live.next_wake_s(now, bool(self._streams)) if self._streams or self._waiters else None
            self._sleep_until = math.inf if wait is None else now + wait
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wakeup.wait()

    async def generate(self, prompt: str | list[int] | None = None, *, prompt_token_ids: list[int] | None = None,
                       id: str | None = None, **params) -> AsyncIterator[P.Chunk]:
        """Stream one generation: yields ``Chunk``s; the last has ``finish_reason``.

        ``prompt``: text (tokenised by the daemon, BOS added) or a list of
        token ids (as ``prompt_token_ids``, sent as they are).
        ``params`` are flat fields of :class:`ringstream.ipc.protocol.SamplingParams`
        and :class:`~ringstream.ipc.protocol.Generate`, with their defaults
        (:data:`GENERATE_DEFAULTS`): ``max_tokens`` (16),
        ``temperature`` (1.0; 0 is greedy), ``top_p`` (1.0), ``top_k`` (0:
        off), ``seed``, ``stop`` (a string or a list of strings),
        ``stop_token_ids``, ``ignore_eos``, ``presence_penalty``,
        ``frequency_penalty`` (0), ``repetition_penalty`` (1.0), ``min_p`` (0),
        ``min_tokens`` (0), ``logprobs`` and ``prompt_logprobs`` (None: off; an
        int asks for that many top entries, each chunk then carries
        ``Chunk.logprobs``, the first ``Chunk.prompt_logprobs``), ``priority``
        (0; lower is served first), ``queue_timeout_s`` and ``timeout_s``
        (seconds), ``stream``; ``messages`` instead of a prompt: a chat
        (``[{"role": "user", "content": "..."}]``) the daemon renders with the
        model's chat template.
        Raises a :class:`ServerError` subclass for an error reply,
        :class:`StreamOrderError`, :class:`DaemonUnavailable`, or TypeError
        for an unknown parameter.
        """
        rid, frame = self._request(prompt, prompt_token_ids, id, params)
        stream = self._open_stream(rid, frame)
        try:
            while not stream.done:
                yield stream.accept(stream.items.popleft() if stream.items else await stream.get())
        finally:
            self._close_stream(stream)

    async def complete(self, prompt: str | list[int] | None = None, **params) -> Completion:
        """Run one generation to the end and return it whole (same arguments as :meth:`generate`)."""
        return join_chunks([chunk async for chunk in self.generate(prompt, **params)])

    async def status(self) -> P.StatusReply:
        """The daemon's live figures. Raises DaemonUnavailable if it does not answer."""
        return await self._call(P.Status())

    async def metrics(self) -> str:
        """The daemon's Prometheus exposition (text format). Raises DaemonUnavailable, or InvalidRequest from a
        daemon too old to serve it."""
        return (await self._call(P.Metrics())).text

    async def admin(self, **settings) -> P.StatusReply:
        """Change live settings (``max_concurrency=8``...); returns the status with the values in force.

        Raises :class:`InvalidRequest` for an unknown setting or a bad value, DaemonUnavailable.
        """
        return await self._call(P.Admin(settings=settings))

    async def _call(self, msg: P.Status | P.Admin | P.Metrics):
        waiter = asyncio.get_running_loop().create_future()
        self._open_call(msg, waiter)
        try:
            return await waiter
        finally:
            self._drop_waiter(waiter)

    async def wait_ready(self, timeout_s: float = 300.0) -> P.StatusReply:
        """Poll ``status()`` until the daemon reports ready. Raises DaemonUnavailable after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError, DaemonUnavailable):
                wait = min(READY_STATUS_WAIT_S, max(MIN_WAIT_S, deadline - time.monotonic()))
                reply = await asyncio.wait_for(self.status(), timeout=wait)
                if reply.ready:
                    return reply
            if time.monotonic() > deadline:
                raise self._not_ready(timeout_s)
            await asyncio.sleep(READY_POLL_S)


class Client(ClientBase):
    """Blocking client for one thread; use as a context manager. Arguments: :class:`ClientBase`."""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel open streams on the daemon and close the socket."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._streams):
            self._send(P.Cancel(id=rid))
        self._close_socket()

    def _wait(self) -> None:
        """Block until one reply arrived and route it, heartbeating while streams are open.

        Raises DaemonUnavailable (see :meth:`ClientBase._keep_alive`); silence
        counts from the start of this wait.
        """
        live = self._live
        live.start_clock(time.monotonic())
        while True:
            now = time.monotonic()
            self._keep_alive(now)
            if self._sock.poll(math.ceil(live.next_wake_s(now, bool(self._streams)) * 1000)):
                self._on_frame(self._sock.recv())
                return

    def generate(self, prompt: str | list[int] | None = None, *, prompt_token_ids: list[int] | None = None,
                 id: str | None = None, **params) -> Iterator[P.Chunk]:
        """Stream one generation; arguments, defaults and errors as :meth:`AsyncClient.generate`."""
        rid, frame = self._request(prompt, prompt_token_ids, id, params)
        stream = self._open_stream(rid, frame)
        try:
            while not stream.done:
                while not stream.items:
                    self._wait()
                yield stream.accept(stream.items.popleft())
        finally:
            self._close_stream(stream)

    def complete(self, prompt: str | list[int] | None = None, **params) -> Completion:
        """Run one generation to the end and return it whole (same arguments as :meth:`generate`)."""
        return join_chunks(list(self.generate(prompt, **params)))

    def status(self) -> P.StatusReply:
        """The daemon's live figures. Raises DaemonUnavailable if it does not answer."""
        return self._call(P.Status())

    def admin(self, **settings) -> P.StatusReply:
        """Change live settings (``max_concurrency=8``...); returns the status with the values in force.

        Raises :class:`InvalidRequest` for an unknown setting or a bad value, DaemonUnavailable.
        """
        return self._call(P.Admin(settings=settings))

    def metrics(self) -> str:
        """The daemon's Prometheus exposition; errors as :meth:`AsyncClient.metrics`."""
        return self._call(P.Metrics()).text

    def _call(self, msg: P.Status | P.Admin | P.Metrics):
        waiter = _Reply()
        self._open_call(msg, waiter)
        try:
            while not waiter.done():
                self._wait()
            return waiter.result()
        finally:
            self._drop_waiter(waiter)

    def wait_ready(self, timeout_s: float = 300.0) -> P.StatusReply:
        """Poll ``status()`` until the daemon reports ready. Raises DaemonUnavailable after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        saved, self.timeout_s = self.timeout_s, min(self.timeout_s, READY_STATUS_WAIT_S)
        try:
            while True:
                with contextlib.suppress(DaemonUnavailable):
                    reply = self.status()
                    if reply.ready:
                        return reply
                if time.monotonic() > deadline:
                    raise self._not_ready(timeout_s)
                time.sleep(READY_POLL_S)
        finally:
            self.timeout_s = saved

"""Reading a plain ZeroMQ socket from an asyncio event loop, without a future per message.

``zmq.asyncio`` creates a future, a poller registration and several flag
enums for every ``recv`` and ``send``: about 20 us per message here, more
than the rest of the front's per-message work together. :class:`SocketPump`
does what the ZeroMQ guide recommends for event loops instead: it watches the
socket's ``ZMQ_FD`` with ``loop.add_reader`` and, when woken, receives with
``NOBLOCK`` until ``EAGAIN``. Sends are plain non-blocking sends on the same
socket, followed by :meth:`SocketPump.kick`.

Why the kick: ``ZMQ_FD`` is edge-triggered. It signals that the socket's
``ZMQ_EVENTS`` may have changed, not that a message waits, and any operation
on the socket (a send too) may consume that signal while processing commands
(zmq_getsockopt(3), "ZMQ_FD"; pyzmq's ``zmq.asyncio`` re-checks ``ZMQ_EVENTS``
after every send for the same reason). So after sends the pump checks the socket
once more, on the next loop iteration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

POLLIN = int(zmq.POLLIN)
"""``ZMQ_EVENTS`` bit as a plain int (``zmq.POLLIN`` is a flag enum: slow to combine)."""
EVENTS = int(zmq.EVENTS)
DEFAULT_BATCH = 256
"""Messages received per wake-up at most before other callbacks get the loop (fairness)."""


class SocketPump:
    """Delivers every message of ``sock`` to ``on_message`` from an asyncio loop.

    Args:
        sock: a plain (not ``zmq.asyncio``) socket; this pump is its only reader.
        on_message: called with each message: ``list[zmq.Frame]`` when
            ``multipart``, else the single frame as ``bytes``. An exception it
            raises propagates to the loop's exception handler for that
            message; later messages are still delivered.
        multipart: receive whole multipart messages as frames (``copy=False``,
            so per-frame properties such as ``zmq.SRCFD`` can be read).
        batch: messages handled per wake-up at most.

    Not thread-safe; use it from the loop's thread only.
    """

    def __init__(self, sock: zmq.Socket, on_message: Callable, *, multipart: bool = False,
                 batch: int = DEFAULT_BATCH) -> None:
        self.sock = sock
        self.on_message = on_message
        self.multipart = multipart
        self.batch = batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False

    def start(self) -> None:
        """Begin delivering messages (also those already waiting)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self.kick()

    def stop(self) -> None:
        """Stop delivering; the socket stays open (the caller closes it)."""
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def kick(self) -> None:
        """Check the socket again on the next loop iteration; call after sending on it."""
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self._loop is None:
            return
        sock = self.sock
        on_message = self.on_message
        nonblock = zmq.NOBLOCK
        try:
            for _ in range(self.batch):
                message = sock.recv_multipart(nonblock, copy=False) if self.multipart else sock.recv(nonblock)
                on_message(message)
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM or sock.closed:
                return
            self.kick()
            raise
        except BaseException:
            self.kick()  # the edge that woke us is spent: the messages after this one must not wait for another
            raise
        # The batch is spent and more may wait: continue after the callbacks already queued.
        self.kick()

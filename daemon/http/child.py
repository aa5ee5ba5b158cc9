"""The HTTP API server as a child process of the front (``ringstream serve --http HOST:PORT``).

The front binds the TCP listening socket itself (so a taken port fails the
daemon's start before any worker is spawned) and hands it to each spawned
child, which serves the OpenAI-compatible API on it
(:mod:`ringstream.daemon.http.server`) as an ordinary client of the daemon's
socket. The child reports that it listens over a pipe, and exits on SIGTERM
(stops accepting, gives streams in flight ``shutdown_grace_s``, exits 0),
when the front dies (``PR_SET_PDEATHSIG``), with 1 when it cannot listen
and 2 for a configuration error. SIGINT is ignored: the front drains and
then tells the child to stop. :class:`HttpChild` is the front's side of it:
spawn, watch, restart with the workers' backoff, stop with their deadlines.
This module imports no aiohttp at its top, so that the front does not load it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ringstream.daemon.common.listen import parse_listen
from ringstream.daemon.http.options import HttpOptions
from ringstream.daemon.common.proctitle import http_title, set_process_title
from ringstream.daemon.common.supervision import EXIT_REAP_S, backoff, join_with_deadlines

__all__ = ["HttpChild", "HttpSpec", "bind_listener", "http_main"]

log = logging.getLogger("ringstream.http")

PR_SET_PDEATHSIG = 1
LISTEN_BACKLOG = 1024
READY = b"ready"
"""What the child sends on its pipe once it listens."""


@dataclass(frozen=True)
class HttpSpec:
    """What a spawned HTTP child needs (picklable).

    Attributes:
        options: the server's settings, whole (``listen`` None: the front hands the bound socket over).
        parent_pid: the front's pid (the child exits when it is gone).
        log_level: ``debug`` ... ``error``.
    """

    options: HttpOptions
    parent_pid: int
    log_level: str = "info"


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on ``HOST:PORT`` (``[::1]:8000`` for IPv6), ``SO_REUSEADDR`` set, inheritable by the
    children it is handed to. Raises OSError (the port is taken, the host is not local) or ValueError (malformed)."""
    host, port = parse_listen(listen)
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def http_main(spec: HttpSpec, listener: socket.socket | None, ready) -> None:
    """Entry point of the spawned HTTP child: serve on ``listener`` (and ``spec.unix_path``) until SIGTERM.

    ``ready``: the write end of a ``multiprocessing.Pipe``; :data:`READY` is sent on it once listening.
    Exits the process: 0 after a clean stop, 1 when it cannot listen, 2 for a configuration error.
    """
    set_process_title(http_title())
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s http %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front drains first
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != spec.parent_pid:
        sys.exit(0)  # the front died before the death signal was armed
    import uvloop

    from ringstream.daemon.http.server import run_http_server
    from ringstream.daemon.common.listen import ConfigError

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

        def listening(urls: list[str]) -> None:
            ready.send_bytes(READY)
            ready.close()

        await run_http_server(spec.options, sock=listener, stop=stop, handle_signals=False, on_ready=listening)

    try:
        uvloop.run(serve())
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        sys.exit(1)
    sys.exit(0)


class HttpChild:
    """The HTTP API child process (``serve --http``): spawned, watched, restarted with backoff, stopped.

    ``listener``: the TCP socket the front bound, handed to every child (so connections wait in its backlog
    while a child restarts) and closed by :meth:`terminate`. ``still_wanted()``: whether an exit is restarted
    (the daemon serves). ``on_start_failed(message)``: the first child exited before it listened.
    """

    def __init__(self, spec: HttpSpec, listener: socket.socket | None, still_wanted: Callable[[], bool],
                 on_start_failed: Callable[[str], None], on_restart: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self.listener = listener
        self.still_wanted = still_wanted
        self.on_start_failed = on_start_failed
        self.on_restart = on_restart or (lambda: None)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.pid = 0
        self.alive = False
        self.listening = False
        """The current child said it listens."""
        self.served = False
        """Some child listened since the start (a later failure is restarted, not a failed start)."""
        self.stopping = False
        self.failures: list[float] = []
        self._ready = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Spawn the child (spawn method) and watch its sentinel and its ready pipe."""
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=http_main, args=(self.spec, self.listener, writer), name="ringstream-http")
        try:
            self.process.start()
        finally:
            writer.close()
        self.pid, self.alive, self.listening, self._ready = self.process.pid, True, False, reader
        loop = asyncio.get_running_loop()
        loop.add_reader(self.process.sentinel, self._exited)
        loop.add_reader(reader.fileno(), self._read_ready)

    def _read_ready(self) -> None:
        reader, self._ready = self._ready, None
        if reader is None:
            return
        asyncio.get_running_loop().remove_reader(reader.fileno())
        try:
            self.listening = reader.poll(0) and reader.recv_bytes() == READY
        except (EOFError, OSError):
            self.listening = False
        reader.close()
        self.served = self.served or self.listening

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self._read_ready()  # it may have listened just before it died
        self.alive = False
        self.process.join(EXIT_REAP_S)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        if self.stopping:
            log.info("HTTP server (pid %d) exited: %s", self.pid, how)
        elif not self.served:
            log.error("HTTP server (pid %d) exited before it listened: %s", self.pid, how)
            self.on_start_failed(f"the HTTP server exited before it listened ({how}); see its log above")
        elif self.still_wanted():
            self.failures, delay = backoff(self.failures, time.monotonic())
            self.on_restart()
            log.error("HTTP server (pid %d) exited: %s; restarting it in %.1f s", self.pid, how, delay)
            self._timer = asyncio.get_running_loop().call_later(delay, self._restart)

    def _restart(self) -> None:
        self._timer = None
        if self.stopping or self.alive or not self.still_wanted():
            return
        self.process.close()
        self.start()

    def terminate(self) -> None:
        """Stop accepting: close the front's listener and send the child SIGTERM (it finishes the streams in
        flight within ``spec.shutdown_grace_s``, then exits). No restart follows. Safe to call twice."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.listener is not None:
            self.listener.close()
        if self.alive and self.process is not None:
            self.process.terminate()

    async def stop(self) -> None:
        """:meth:`terminate`, then join the child: SIGTERM and SIGKILL past each JOIN_GRACE_S."""
        self.terminate()
        proc, self.process = self.process, None
        if proc is None:
            return
        if self.alive:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._ready is not None:
            asyncio.get_running_loop().remove_reader(self._ready.fileno())
            self._ready.close()
            self._ready = None
        await asyncio.to_thread(join_with_deadlines, proc, "HTTP server")
        self.alive = False

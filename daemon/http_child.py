"""The HTTP API server as a child process of the front (``ringstream serve --http HOST:PORT``).

The front binds the TCP listening socket itself (so a taken port fails the
daemon's start before any worker is spawned) and hands it to each spawned
child, which serves the OpenAI-compatible API on it
(:mod:`ringstream.daemon.http_api`) as an ordinary client of the daemon's
socket. The child reports that it listens over a pipe, and exits on SIGTERM
(stops accepting, gives streams in flight ``shutdown_grace_s``, exits 0),
when the front dies (``PR_SET_PDEATHSIG``), with 1 when it cannot listen
and 2 for a configuration error. SIGINT is ignored: the front drains and
then tells the child to stop. This module imports no aiohttp at its top, so
that the front does not load it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

from ringstream.daemon.proctitle import http_title, set_process_title

__all__ = ["HttpSpec", "bind_listener", "check_api_key_file", "http_main"]

log = logging.getLogger("ringstream.http")

PR_SET_PDEATHSIG = 1
LISTEN_BACKLOG = 1024
READY = b"ready"
"""What the child sends on its pipe once it listens."""


@dataclass(frozen=True)
class HttpSpec:
    """What a spawned HTTP child needs (picklable).

    Attributes:
        socket_address: the daemon's client socket (``ipc://PATH`` or ``tcp://HOST:PORT``).
        unix_path: a unix socket path to listen on too (the child binds it), or None.
        api_key_file: the bearer-token file, or None.
        model_name: the model's name in the API, or None (its directory's name).
        shutdown_grace_s: seconds streams in flight get to finish after SIGTERM.
        parent_pid: the front's pid (the child exits when it is gone).
        log_level: ``debug`` ... ``error``.
    """

    socket_address: str
    unix_path: str | None
    api_key_file: str | None
    model_name: str | None
    shutdown_grace_s: float
    parent_pid: int
    log_level: str = "info"


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on ``HOST:PORT`` (``[::1]:8000`` for IPv6), ``SO_REUSEADDR`` set, inheritable by the
    children it is handed to. Raises OSError (the port is taken, the host is not local) or ValueError (malformed)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{listen!r} is not HOST:PORT")
    host = host.strip("[]")
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

    from ringstream.daemon.http_api import ConfigError, run_http_server

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

        def listening(urls: list[str]) -> None:
            ready.send_bytes(READY)
            ready.close()

        await run_http_server(spec.socket_address, None, sock=listener, unix_path=spec.unix_path,
                              api_key_file=spec.api_key_file, model_name=spec.model_name,
                              shutdown_grace_s=spec.shutdown_grace_s, stop=stop, handle_signals=False,
                              on_ready=listening)

    try:
        uvloop.run(serve())
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        sys.exit(1)
    sys.exit(0)


def check_api_key_file(path: str) -> None:
    """ValueError unless ``path`` is a readable UTF-8 file holding a non-empty key."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc}") from None
    if not key:
        raise ValueError(f"the API key file {path} is empty")

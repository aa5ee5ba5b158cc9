"""The OpenAI-compatible HTTP server process: aiohttp on uvloop, a client of the daemon's ZeroMQ socket.

HTTP parsing and JSON encoding run in this process, never on the front's
event loop; the endpoints are :class:`ringstream.daemon.http.routes.HttpApi`'s.
Start it with::

    python -m ringstream.daemon.http.server --socket ipc:///run/ringstream/ringstream.sock \\
        --listen 127.0.0.1:8000 [--unix PATH] [--api-key-file FILE] [--served-model-name NAME] \\
        [--max-connections N] [--keepalive-timeout S] [--body-timeout S] [--write-timeout S]

or :func:`run_http_server` from an event loop. Loopback addresses need no
key; any other address needs ``api_key_file``, and the server refuses to
start without one (:class:`ConfigError`). Clients send the key as
``Authorization: Bearer KEY`` (compared in constant time; ``/health`` needs
none). A unix socket is created with mode 0600. Once every address is bound
the server prints one line, ``ringstream http: serving on URL ...``, on
stdout. SIGTERM or SIGINT (or the ``stop`` event) stops it: it stops
listening, gives requests in flight ``shutdown_grace_s`` to finish, cancels
the rest (their daemon requests too), closes every connection and exits 0.
Slow, idle and stuck clients are bounded by :class:`~ringstream.daemon.http.options.HttpLimits`
(timeouts, a connection cap, header sizes; see :mod:`ringstream.daemon.http.limits`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from ringstream.daemon.common.listen import ConfigError, check_listen_auth, parse_listen, read_api_key
from ringstream.daemon.http.routes import HttpApi
from ringstream.daemon.http.limits import ConnectionCap, fit_open_files
from ringstream.daemon.http.options import (
    BODY_TIMEOUT_S, DEFAULT_LISTEN, KEEPALIVE_TIMEOUT_S, MAX_BODY_BYTES, MAX_CONNECTIONS, SHUTDOWN_GRACE_S,
    TOOL_CALL_PARSERS, UNKNOWN_FIELDS, WRITE_TIMEOUT_S, HttpLimits, HttpOptions,
)
from ringstream.ipc.client import AsyncClient

log = logging.getLogger("ringstream.http")

UNIX_SOCKET_MODE = 0o600
READY_LINE = "ringstream http: serving on"
"""The start of the line printed (and flushed) on stdout once every address is bound; the URLs follow."""
CLOSE_MARGIN_S = 1.0
"""Past ``shutdown_grace_s`` plus this, connections still open at the stop are aborted."""

__all__ = ["ConfigError", "HttpLimits", "HttpServer", "check_listen_auth", "main", "parse_listen",
           "read_api_key", "run_http_server"]


class HttpServer:
    """The HTTP server over a daemon: :meth:`start` binds, :meth:`close` stops and closes everything.

    Args:
        options: the server's settings (:class:`ringstream.daemon.http.options.HttpOptions`); ``api_key_file`` is
            required for a non-loopback ``listen``, ``socket_address`` None is the client library's default
            (:func:`ringstream.ipc.address.client_socket`).
        sock: a TCP socket bound and listening already, served instead of ``options.listen`` (the front hands
            one to its HTTP child); the loopback rule applies to its address.

    Raises:
        ConfigError: a malformed ``listen``, no address at all, a non-loopback address without a key, or a
            key file that cannot be read or is empty.
    """

    def __init__(self, options: HttpOptions, sock: socket.socket | None = None) -> None:
        if options.listen is None and options.unix_path is None and sock is None:
            raise ConfigError("nothing to listen on: give a HOST:PORT or a unix socket path")
        self.options = options
        self.sock = sock
        self.tcp = parse_listen(options.listen) if options.listen is not None and sock is None else None
        self.api_key = read_api_key(options.api_key_file) if options.api_key_file is not None else options.api_key
        check_listen_auth(self.tcp[0] if self.tcp else sock.getsockname()[0] if sock else None, self.api_key)
        self.unix_path = options.unix_path
        self.shutdown_grace_s = options.shutdown_grace_s
        self.limits = options.limits
        self.cap: ConnectionCap | None = None
        """The connection cap in force once started (lower than ``limits.max_connections`` where the
        open-file limit allows fewer)."""
        self.client: AsyncClient | None = None
        self._runner: web.AppRunner | None = None
        self.urls: list[str] = []
        """What :meth:`start` bound: ``http://HOST:PORT`` and ``unix:PATH``."""

    async def start(self) -> list[str]:
        """Connect to the daemon (no wait: ``/health`` tells when it is ready) and bind; returns :attr:`urls`.

        Raises OSError when an address cannot be bound (everything opened is closed again).
        """
        options = self.options
        self.client = AsyncClient(options.socket_address)
        api = HttpApi(self.client, model_name=options.model_name, api_key=self.api_key,
                      chat_template=options.chat_template, max_body_bytes=options.max_body_bytes,
                      body_timeout_s=self.limits.body_timeout_s, write_timeout_s=self.limits.write_timeout_s,
                      tool_call_parser=options.tool_call_parser, unknown_fields=options.unknown_fields)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its daemon requests
        # (also a non-streaming one: aiohttp >= 3.9 cancels handlers on disconnect only when asked to)
        access = dict(access_log=logging.getLogger("ringstream.http.access"), access_log_format=ACCESS_LOG_FORMAT) \
            if options.access_log else dict(access_log=None)
        self._runner = web.AppRunner(api.app, handler_cancellation=True, **access,
                                     shutdown_timeout=self.shutdown_grace_s, **self.limits.handler_args())
        try:
            self.cap = ConnectionCap(fit_open_files(self.limits.max_connections))
            await self._runner.setup()
            self.cap.install(self._runner.server)
            if self.tcp is not None or self.sock is not None:
                site = web.SockSite(self._runner, self.sock) if self.sock is not None \
                    else web.TCPSite(self._runner, self.tcp[0], self.tcp[1])
                await site.start()
                for address in self._runner.addresses:  # the bound port, when 0 asked for a free one
                    host, port = address[:2]
                    self.urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
            if self.unix_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    if Path(self.unix_path).is_socket():
                        os.unlink(self.unix_path)  # a stale socket of a previous run
                old = os.umask(0o177)
                try:
                    site = web.UnixSite(self._runner, self.unix_path)
                    await site.start()
                finally:
                    os.umask(old)
                os.chmod(self.unix_path, UNIX_SOCKET_MODE)
                self.urls.append(f"unix:{self.unix_path}")
        except BaseException:
            await self.close()
            raise
        return self.urls

    async def close(self) -> None:
        """Stop listening, let requests in flight finish for ``shutdown_grace_s``, cancel the rest, close every
        connection and the daemon client (which cancels its open requests on the daemon). Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            # aiohttp waits up to shutdown_timeout for each handler, then again for one blocked writing to a
            # client that does not read: past the grace plus a margin, abort what is still open instead.
            cleanup = asyncio.ensure_future(runner.cleanup())
            done, _ = await asyncio.wait({cleanup}, timeout=self.shutdown_grace_s + CLOSE_MARGIN_S)
            if not done and self.cap is not None:
                log.warning("aborting %d connection(s) still open after the %.0f s grace",
                            self.cap.abort_all(), self.shutdown_grace_s)
            await cleanup
        client, self.client = self.client, None
        if client is not None:
            await client.close()
        if f"unix:{self.unix_path}" in self.urls:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)


async def run_http_server(options: HttpOptions, *, stop: asyncio.Event | None = None, handle_signals: bool = True,
                          print_ready: bool = False, sock: socket.socket | None = None, on_ready=None) -> None:
    """Serve ``options`` until ``stop`` is set (or SIGTERM / SIGINT with ``handle_signals``), then close cleanly.

    ``sock``: a bound listening socket to serve on (as :class:`HttpServer`). ``print_ready``: print the
    :data:`READY_LINE` with the bound URLs once listening; ``on_ready(urls)``
    is called then too. Raises
    ConfigError (before binding anything) or OSError (an address in use).
    """
    server = HttpServer(options, sock)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        urls = await server.start()
        log.info("serving on %s (daemon %s)", " ".join(urls), server.client.address)
        if print_ready:
            print(READY_LINE, *urls, flush=True)
        if on_ready is not None:
            on_ready(urls)
        await stop.wait()
        log.info("stopping")
    finally:
        await server.close()
        for sig in signals:
            loop.remove_signal_handler(sig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ringstream.daemon.http.server",
                                     description="OpenAI-compatible HTTP API over a ringstream daemon")
    parser.add_argument("--socket", help="the daemon's address, ipc://PATH or tcp://HOST:PORT (default: the "
                                         "client library's: $RINGSTREAM_SOCKET, the system service's, the user's)")
    parser.add_argument("--listen", help=f"HOST:PORT (default {DEFAULT_LISTEN} unless only --unix is given; "
                                         "a non-loopback host needs --api-key-file)")
    parser.add_argument("--unix", metavar="PATH", help="also listen on this unix socket (mode 0600)")
    parser.add_argument("--api-key-file", metavar="FILE", help="file holding the bearer token clients must send")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: its directory's name)")
    parser.add_argument("--chat-template", metavar="FILE", help="Jinja chat template used instead of the model's")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body")
    parser.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                        help="seconds requests in flight get to finish on SIGTERM")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help=f"most connections open at once; more get 503 and are closed (default {MAX_CONNECTIONS})")
    parser.add_argument("--keepalive-timeout", type=float, default=KEEPALIVE_TIMEOUT_S,
                        help="seconds an idle connection, or one whose request headers are not complete, stays "
                             f"open (default {KEEPALIVE_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help=f"seconds a request body may take to arrive; 408 beyond (default {BODY_TIMEOUT_S:g})")
    parser.add_argument("--write-timeout", type=float, default=WRITE_TIMEOUT_S,
                        help="seconds a client may leave an answer unread before its connection is aborted and "
                             f"its requests cancelled (default {WRITE_TIMEOUT_S:g})")
    parser.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                        help="the call format tool_choice auto reads (default: the one the chat template shows)")
    parser.add_argument("--unknown-fields", default="error", choices=UNKNOWN_FIELDS,
                        help="an unknown request field: error (400 naming it, OpenAI's) or warn (logged, served)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log one line per request")
    return parser


ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs "%{User-Agent}i"'
"""One access-log line (aiohttp's format codes): client address, request line, status, response bytes, seconds,
user agent."""


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 after a clean stop, 2 for a configuration error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    listen = args.listen or (None if args.unix else DEFAULT_LISTEN)
    import uvloop

    try:
        limits = HttpLimits(keepalive_timeout_s=args.keepalive_timeout, body_timeout_s=args.body_timeout,
                            write_timeout_s=args.write_timeout, max_connections=args.max_connections)
        options = HttpOptions(socket_address=args.socket, listen=listen, unix_path=args.unix,
                              api_key_file=args.api_key_file, model_name=args.served_model_name,
                              chat_template=args.chat_template, max_body_bytes=args.max_body_bytes,
                              shutdown_grace_s=args.shutdown_grace, limits=limits,
                              tool_call_parser=args.tool_call_parser, unknown_fields=args.unknown_fields,
                              access_log=args.access_log)
        uvloop.run(run_http_server(options, print_ready=True))
    except ConfigError as exc:
        print(f"ringstream http: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ringstream http: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The HTTP server's settings, declared once: :class:`HttpOptions` (with its :class:`HttpLimits`), built from the
daemon's Config by the front or from the command line of :mod:`ringstream.daemon.http.server`, carried whole to the
HTTP child and taken whole by :class:`ringstream.daemon.http.server.HttpServer`. No aiohttp, no sockets: the front
imports it. What each limit bounds: :mod:`ringstream.daemon.http.limits`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringstream.daemon.common.listen import ConfigError

__all__ = ["DEFAULT_LISTEN", "MAX_BODY_BYTES", "SHUTDOWN_GRACE_S", "HttpLimits", "HttpOptions"]

DEFAULT_LISTEN = "127.0.0.1:8000"
"""``HOST:PORT`` the standalone server binds unless told otherwise."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest request body, bytes (413 beyond)."""
SHUTDOWN_GRACE_S = 5.0
"""Seconds requests in flight get to finish on SIGTERM (the standalone server's default)."""
KEEPALIVE_TIMEOUT_S = 15.0
"""Idle connections, and requests whose line and headers are not complete by then, are closed, seconds."""
BODY_TIMEOUT_S = 30.0
"""Most time a request body may take to arrive after its headers, seconds (408 beyond)."""
WRITE_TIMEOUT_S = 30.0
"""Most time one write may wait for a client that does not read, seconds; then the connection is aborted."""
MAX_CONNECTIONS = 1024
"""Most connections open at once (the daemon's ``max_clients`` default); more are answered 503 and closed."""
MAX_LINE_BYTES = 8190
"""Longest request line or header line, bytes (aiohttp's default, stated)."""
MAX_FIELD_BYTES = 8190
"""Longest header value, bytes."""
MAX_HEADERS = 128
"""Most header fields of one request."""
LINGER_S = 2.0
"""How long an answered connection still reads (and drops) a body its handler did not read, seconds."""
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
"""Values of ``tool_call_parser``: ``auto`` reads the format from the chat template."""
UNKNOWN_FIELDS = ("error", "warn")
"""Values of ``unknown_fields``."""


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP server's timeouts (seconds) and connection cap; ConfigError for a value that is not > 0."""

    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("keepalive_timeout_s", "body_timeout_s", "write_timeout_s", "max_connections"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} = {value!r}: must be > 0")

    def handler_args(self) -> dict:
        """Keyword arguments of ``aiohttp.web.AppRunner`` (passed on to each connection's handler)."""
        return dict(keepalive_timeout=self.keepalive_timeout_s, max_line_size=MAX_LINE_BYTES,
                    max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS, lingering_time=LINGER_S)


@dataclass(frozen=True)
class HttpOptions:
    """Everything the HTTP server is configured with (picklable, for the HTTP child).

    Attributes:
        socket_address: the daemon's client socket (``ipc://PATH`` / ``tcp://HOST:PORT``); None = the client
            library's default.
        listen: ``HOST:PORT`` to bind, or None (a unix socket only, or a socket handed over by the front).
        unix_path: a unix socket path to listen on too (mode 0600), or None.
        api_key_file: the bearer-token file, or None (then only loopback addresses may be bound).
        api_key: the bearer token itself (instead of ``api_key_file``), or None.
        model_name: the model's name in the API; None = its directory's name.
        chat_template: a Jinja chat template file used instead of the model's, or None.
        max_body_bytes: largest request body (413 beyond).
        shutdown_grace_s: seconds requests in flight get to finish after SIGTERM.
        limits: timeouts and the connection cap.
        tool_call_parser: the call format ``tool_choice`` auto reads: ``auto`` (from the chat template),
            ``hermes``, ``llama3_json`` or ``none``.
        unknown_fields: ``error`` (400 naming an unknown request field) or ``warn`` (logged, served).
        access_log: log one line per request (logger ``ringstream.http.access``: client, request line, status,
            bytes, seconds, user agent; never a header's credentials).
    """

    socket_address: str | None = None
    listen: str | None = DEFAULT_LISTEN
    unix_path: str | None = None
    api_key_file: str | None = None
    api_key: str | None = None
    model_name: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_grace_s: float = SHUTDOWN_GRACE_S
    limits: HttpLimits = field(default_factory=HttpLimits)
    tool_call_parser: str = "auto"
    unknown_fields: str = "error"
    access_log: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser = {self.tool_call_parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.unknown_fields not in UNKNOWN_FIELDS:
            raise ConfigError(f"unknown_fields = {self.unknown_fields!r}: one of {', '.join(UNKNOWN_FIELDS)}")

    @classmethod
    def from_config(cls, config) -> "HttpOptions":
        """The options of the HTTP child of a daemon with ``config`` (a Config): the front binds the TCP address
        and hands the socket over, so ``listen`` is None."""
        return cls(socket_address=config.address(), listen=None, unix_path=config.http_unix,
                   api_key_file=config.api_key_file, api_key=config.api_key, model_name=config.served_model_name,
                   shutdown_grace_s=config.drain_timeout_s, tool_call_parser=config.tool_call_parser,
                   unknown_fields=config.http_unknown_fields, access_log=config.http_access_log)

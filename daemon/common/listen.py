"""The HTTP listen address (``HOST:PORT``), its auth rule and the API key file; the KV events endpoints. No
sockets opened here."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

__all__ = ["ConfigError", "check_listen_auth", "is_loopback_host", "parse_listen", "check_endpoints_free", "offset_endpoint", "read_api_key"]


class ConfigError(ValueError):
    """The server cannot start as configured: a non-loopback address without a key, a bad address, key file
    or limit."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); any other name or address is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6; port 0 picks a free one) as ``(host, port)``; ConfigError if malformed."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen address {listen!r} is not HOST:PORT")
    return host, int(port)


def read_api_key(path: str | Path) -> str:
    """The key in an API key file (surrounding whitespace dropped); ConfigError when unreadable or empty."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from None
    if not key:
        raise ConfigError(f"the API key file {path} is empty")
    return key


def check_listen_auth(host: str | None, api_key: str | None) -> None:
    """ConfigError unless ``host`` is loopback (None: no TCP address) or an API key is set."""
    if host is not None and not is_loopback_host(host) and api_key is None:
        raise ConfigError(f"listening on {host!r}, which is not a loopback address, needs an API key: "
                          f"give --api-key-file (api_key_file=), or listen on 127.0.0.1")


def offset_endpoint(endpoint: str, index: int) -> str:
    """``endpoint`` for worker ``index``: a ``tcp://HOST:PORT`` address with PORT + ``index`` (vLLM's
    ``offset_endpoint_port`` for data-parallel ranks), an ``ipc://PATH`` with ``.index`` appended past 0.

    Raises:
        ValueError: not ``tcp://HOST:PORT`` or ``ipc://PATH``, or the port leaves 1..65535.
    """
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint if index == 0 else f"{endpoint}.{index}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r}: use tcp://HOST:PORT or ipc://PATH")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r}: use tcp://HOST:PORT (HOST may be *)")
    if not 1 <= int(port) + index <= 65535:
        raise ValueError(f"KV events endpoint {endpoint!r}: port {int(port) + index} (worker {index}) is out "
                         "of 1..65535")
    return f"tcp://{host}:{int(port) + index}"


MAX_IPC_PATH_BYTES = 107
"""Longest path of a unix socket address (``sun_path``, 108 bytes with its NUL)."""


def check_endpoints_free(endpoints: list[str]) -> None:
    """ValueError naming the endpoint when two of ``endpoints`` are the same, an ``ipc://`` path is too long
    for a unix socket, or a ``tcp://`` one cannot be bound now (in use, an address of no interface here, a
    host that does not resolve): checked before any worker starts, so that a bad endpoint fails the daemon's
    start in a moment rather than after the model loads. (An ``ipc://`` path in use cannot be told: a second
    bind takes it over.)"""
    seen: set[str] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            raise ValueError(f"KV events endpoint {endpoint} is given twice (a worker's events port and another "
                             "worker's replay port collide: space the two settings' ports by more than the "
                             "number of workers)")
        seen.add(endpoint)
        if endpoint.startswith("ipc://"):
            if len(endpoint[len("ipc://"):].encode()) > MAX_IPC_PATH_BYTES:
                raise ValueError(f"KV events endpoint {endpoint}: the path is longer than a unix socket's "
                                 f"{MAX_IPC_PATH_BYTES} bytes")
            continue
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(None if host == "*" else host, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, kind, proto, _, address = infos[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                probe.bind(address)
        except OSError as exc:
            raise ValueError(f"KV events endpoint {endpoint}: cannot bind it ({exc.strerror or exc})") from None

"""The HTTP listen address (``HOST:PORT``), its auth rule and the API key file. No sockets opened here."""

from __future__ import annotations

import ipaddress
from pathlib import Path

__all__ = ["ConfigError", "check_listen_auth", "is_loopback_host", "parse_listen", "read_api_key"]


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

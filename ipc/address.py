"""Where a daemon listens and where clients look for it, and whether anything answers there.

The daemon binds, by default (:func:`default_socket`): under systemd the
unit's ``RuntimeDirectory`` holds ``ringstream.sock``; for a user session
``$XDG_RUNTIME_DIR/ringstream/<instance>.sock``; otherwise a private
directory in the temp dir.

A client given no address (:func:`client_socket`) uses ``$RINGSTREAM_SOCKET``,
else the systemd service's socket when it is there, else the per-user
default of instance ``default``.

:func:`unreachable` tells in one non-blocking unix-socket connect why an
``ipc://`` address cannot be served (no file, a stale file, permission
denied), so that clients fail at once instead of waiting for an answer that
cannot come (ZeroMQ retries a refused connection silently, for ever).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from pathlib import Path

SOCKET_ENV = "RINGSTREAM_SOCKET"
"""Environment variable naming the address clients use when they are given none (``ipc://PATH`` or ``tcp://HOST:PORT``)."""
SYSTEMD_SOCKET = "/run/ringstream/ringstream.sock"
"""The socket of the systemd service (``RuntimeDirectory=ringstream`` in ``systemd/ringstream.service``)."""
DEFAULT_INSTANCE = "default"
SCHEMES = ("ipc://", "tcp://")
"""The transports a daemon binds."""


def runtime_dir() -> Path:
    """Directory for this user's sockets: systemd's, XDG's, or ``$TMPDIR/ringstream-<uid>``."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "ringstream"
    return Path(tempfile.gettempdir()) / f"ringstream-{os.getuid()}"


def default_socket(instance: str = DEFAULT_INSTANCE) -> str:
    """The ZeroMQ address a daemon of ``instance`` binds by default."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return f"ipc://{runtime_dir() / 'ringstream.sock'}"
    return f"ipc://{runtime_dir() / f'{instance}.sock'}"


def check_address(address: str, origin: str = "address") -> str:
    """``address`` itself if it is ``ipc://...`` or ``tcp://...``; else ValueError naming ``origin`` (e.g. ``--socket``)."""
    if not address.startswith(SCHEMES) or address in SCHEMES:
        raise ValueError(f"{origin} {address!r}: use ipc://PATH or tcp://HOST:PORT")
    return address


def client_socket(instance: str | None = None) -> str:
    """The address a client uses when it is given none.

    With an ``instance``: that instance's :func:`default_socket`. Without:
    ``$RINGSTREAM_SOCKET`` when set; else the systemd service's socket
    (:data:`SYSTEMD_SOCKET`) when it exists, or when its folder exists but
    this user may not enter it (connecting then says "permission denied");
    else :func:`default_socket` of instance ``default``.

    Raises ValueError when ``$RINGSTREAM_SOCKET`` is neither ``ipc://`` nor ``tcp://``.
    """
    if instance is not None:
        return default_socket(instance)
    named = os.environ.get(SOCKET_ENV)
    if named:
        return check_address(named, SOCKET_ENV)
    if not os.environ.get("RUNTIME_DIRECTORY") and _present(SYSTEMD_SOCKET):
        return f"ipc://{SYSTEMD_SOCKET}"
    return default_socket(DEFAULT_INSTANCE)


def _present(path: str) -> bool:
    """Whether ``path`` exists, counting one this user may not look at (its folder is closed) as existing."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def ipc_path(address: str) -> str | None:
    """The unix-socket path of an ``ipc://`` address (``@name``: Linux's abstract namespace), else None."""
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def _connect_unix(target: str) -> None:
    """One non-blocking connect to the unix socket ``target``, closed at once; raises what ``connect`` raises.

    A ZeroMQ listener sees a connection that ends before its handshake and
    drops it. ``BlockingIOError`` (a full listen backlog) means someone listens.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        probe.connect(target)


def unreachable(address: str) -> str | None:
    """Why no daemon can answer at ``address``, or None when one may.

    Only ``ipc://`` addresses are checked, with one non-blocking connect
    (microseconds): a missing socket file, a stale one (nobody listens: its
    daemon is gone), or a socket this user may not reach (permission denied
    on the socket or a folder above it) give a one-line reason. None for a
    listening socket (a full backlog included) and for every other transport.
    Never raises.
    """
    path = ipc_path(address)
    if path is None:
        return None
    try:
        _connect_unix("\0" + path[1:] if path.startswith("@") else path)
    except BlockingIOError:
        return None
    except FileNotFoundError:
        return f"no daemon at {address} (the socket file does not exist)"
    except ConnectionRefusedError:
        if path.startswith("@"):
            return f"no daemon at {address} (nothing listens on it)"
        return f"no daemon at {address} (a stale socket file: its daemon is gone)"
    except PermissionError:
        return (f"cannot connect to {address}: permission denied (this user may not use the socket or enter "
                f"a folder above it; see socket_mode and the group ringstream)")
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno in errno.errorcode else str(exc)
        return f"cannot connect to {address}: {reason}"
    return None


def unix_socket_listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (False: no file, or a stale one).

    Connects and closes at once (a ZeroMQ listener sees a connection that ends
    before its handshake, and drops it). Raises OSError for anything else, e.g.
    ``PermissionError`` when this user may not connect.
    """
    try:
        _connect_unix(path)
    except BlockingIOError:
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    return True


def bind_private(sock, address: str) -> None:
    """Bind ``sock`` to an ipc ``address`` whose socket file only this user may use (mode 0600)."""
    umask = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(umask)

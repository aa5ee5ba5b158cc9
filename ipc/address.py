"""Where a daemon instance listens by default (shared by the daemon and its clients).

Under systemd the unit's ``RuntimeDirectory`` holds ``ringstream.sock``; for a
user session ``$XDG_RUNTIME_DIR/ringstream/<instance>.sock``; otherwise a
private directory in the temp dir.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """Directory for this user's sockets: systemd's, XDG's, or ``$TMPDIR/ringstream-<uid>``."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "ringstream"
    return Path(tempfile.gettempdir()) / f"ringstream-{os.getuid()}"


def default_socket(instance: str = "default") -> str:
    """The ZeroMQ address a daemon of ``instance`` binds, and clients use, by default."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return f"ipc://{runtime_dir() / 'ringstream.sock'}"
    return f"ipc://{runtime_dir() / f'{instance}.sock'}"


def unix_socket_listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (False: no file, or a stale one).

    Connects and closes at once (a ZeroMQ listener sees a connection that ends
    before its handshake, and drops it). Raises OSError for anything else, e.g.
    ``PermissionError`` when this user may not connect.
    """
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
    return True

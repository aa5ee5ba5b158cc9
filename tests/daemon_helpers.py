"""Start and stop real daemons for end-to-end tests, leaving nothing behind.

:func:`running_daemon` starts ``ringstream serve`` with
:class:`ringstream.tools.daemon_process.DaemonProcess` on a private ipc
socket and a unique instance name, waits for the ready handshake
(``Status.ready``), and on exit stops it (SIGTERM, SIGKILL after a
deadline), removes any /dev/shm segment of that instance and fails the test
if the daemon left one, left a worker process behind or had to be killed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ringstream.tools.daemon_process import DaemonProcess, wait_exit

__all__ = ["Daemon", "running_daemon", "wait_exit"]

Daemon = DaemonProcess
"""A running daemon under test."""


@contextlib.contextmanager
def running_daemon(tmp_path: Path, *args: str, ready: bool = True, env: dict | None = None,
                   preexec_fn=None):
    """Run ``ringstream serve ARGS`` for the duration of the ``with`` block; yields a :class:`DaemonProcess`.

    ``ready=False``: yield at once, without waiting for the ready reply, and
    leave the instance's segments (a test of a failed start, or of the next
    start reclaiming them). ``env``: extra environment variables for the
    daemon. ``preexec_fn``: run in the daemon's process before it starts
    (e.g. to lower a resource limit).
    """
    instance = args[list(args).index("--instance") + 1] if "--instance" in args else None
    daemon = DaemonProcess(*args, runtime_dir=tmp_path, instance=instance, env=env, preexec_fn=preexec_fn,
                           remove_segments=ready, prefix="t")
    clean_exit = False
    try:
        daemon.start(wait_ready=ready)
        yield daemon
        clean_exit = True
    finally:
        left = daemon.close()
    if clean_exit:
        assert not left.killed, f"daemon did not stop within its deadline:\n{daemon.log_tail()}"
        assert not left.segments, f"daemon left /dev/shm segments: {left.segments}"
        assert not left.processes, f"daemon left worker processes: {left.processes}"

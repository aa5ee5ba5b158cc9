"""Process supervision shared by the front's children (workers, the HTTP child): deadline joins, restart backoff,
the instance lock, the startup error. No torch, no sockets."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
from pathlib import Path

__all__ = ["EXIT_REAP_S", "JOIN_GRACE_S", "InstanceLock", "StartupError", "backoff", "join_with_deadlines"]

log = logging.getLogger("ringstream.workers")

JOIN_GRACE_S = 5.0
"""How long a worker gets to exit after ``Shutdown``, and again after SIGTERM."""
EXIT_REAP_S = 1.0
"""Longest wait to reap a worker whose sentinel reported its exit."""
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
RESTART_WINDOW_S = 300.0
"""Worker restarts wait RESTART_BACKOFF_S doubled per failure in the last RESTART_WINDOW_S, at most the max."""


class StartupError(Exception):
    """The daemon cannot start (instance already running, ring or worker failure): exit status ``exit_code``,
    1 (retried under systemd's ``Restart=on-failure``), or 2 for what no retry fixes (a model refused, a setting
    at odds with the model; the unit's ``RestartPreventExitStatus=2``)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class InstanceLock:
    """An exclusive ``flock`` on ``<rundir>/<instance>.lock`` for the daemon's lifetime."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 32).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise StartupError(f"instance already running (pid {holder}, lock {path})") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1


def join_with_deadlines(proc: multiprocessing.process.BaseProcess, name: str, grace_s: float = JOIN_GRACE_S) -> None:
    """Join a process told to stop within ``grace_s`` seconds; SIGTERM, then SIGKILL past each deadline; close
    it. Blocking."""
    proc.join(grace_s)
    if proc.is_alive():
        log.warning("%s did not exit; terminating", name)
        proc.terminate()
        proc.join(JOIN_GRACE_S)
    if proc.is_alive():
        log.warning("%s did not terminate; killing", name)
        proc.kill()
        proc.join()
    proc.close()


def backoff(failures: list[float], now: float) -> tuple[list[float], float]:
    """``(failures in the last RESTART_WINDOW_S with now added, restart delay in seconds)``: RESTART_BACKOFF_S
    doubled per recent failure, at most RESTART_BACKOFF_MAX_S."""
    failures = [t for t in failures if now - t < RESTART_WINDOW_S] + [now]
    return failures, min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(failures) - 1))

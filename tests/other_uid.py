"""Run a check as another user: a forked child that drops to another uid (root only), or in-process.

The child never execs (the interpreter may live where the other user cannot
read it) and never returns into pytest: it ends with ``os._exit``, and by
SIGALRM after :data:`CHILD_ALARM_S`.
"""

from __future__ import annotations

import os
import signal
import sys

NOBODY = 65534
CHILD_ALARM_S = 30
"""A forked child that has not finished by then is ended by SIGALRM."""


def run_as(uid: int, gid: int, action) -> tuple[int, str]:
    """Fork; in the child drop to ``uid``/``gid`` (no supplementary groups) and exit with ``action()``.

    Needs root. Returns ``(exit code, what the child printed)``. An exception
    in the child is printed as ``"ExcName: message"`` and gives exit code 70.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only system calls and os._exit from here
        code = 70
        try:
            os.close(read_fd)
            signal.alarm(CHILD_ALARM_S)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            sys.stdout = os.fdopen(write_fd, "w", closefd=False)
            code = action()
            sys.stdout.flush()
        except BaseException as exc:  # the child must never return into pytest
            os.write(write_fd, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        output = pipe.read()
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), output


def as_other_user(action) -> str:
    """Return what ``action()`` returns (a string), computed without root's rights.

    As root: in a child run as ``nobody`` (:func:`run_as`), whose own output
    and errors are discarded; an exception in the child is returned as
    ``"ExcName: message"``. Otherwise ``action()`` runs here: the current user
    has no rights beyond its own.
    """
    if os.geteuid() != 0:
        return action()

    def child() -> int:
        pipe = sys.stdout
        sys.stdout = sys.stderr = open(os.devnull, "w")
        pipe.write(str(action()))
        pipe.flush()
        return 0

    return run_as(NOBODY, NOBODY, child)[1]

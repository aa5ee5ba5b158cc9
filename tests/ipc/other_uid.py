"""Run a check as a user without this one's rights: a forked child as ``nobody`` when root, else in-process."""

from __future__ import annotations

import os
import signal
import sys

NOBODY = 65534
CHILD_ALARM_S = 30
"""A forked child that has not finished by then is ended by SIGALRM."""


def as_other_user(action) -> str:
    """Return what ``action()`` returns (a string), computed without root's rights.

    As root: in a forked child that drops to ``nobody`` (no supplementary
    groups; no exec, so the interpreter need not be readable by it); an
    exception in the child is returned as ``"ExcName: message"``. Otherwise
    ``action()`` runs here: the current user has no rights beyond its own.
    """
    if os.geteuid() != 0:
        return action()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 70
        try:
            os.close(read_fd)
            signal.alarm(CHILD_ALARM_S)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sys.stderr = open(os.devnull, "w")
            os.write(write_fd, str(action()).encode())
            code = 0
        except BaseException as exc:
            os.write(write_fd, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        output = pipe.read()
    os.waitpid(pid, 0)
    return output

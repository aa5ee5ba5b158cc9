"""Key presses of ``ringstream-top``'s live view: a terminal in cbreak mode, and what each key does.

``q`` quits, ``s`` shows the serving view, ``r`` the rings view; Ctrl-C
still raises KeyboardInterrupt. The terminal's settings come back however
the view ends. Imports nothing of ringstream.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from typing import Any

__all__ = ["KEYS_HELP", "VIEW_RINGS", "VIEW_SERVING", "KeyReader", "handle_keys"]

VIEW_SERVING = "serving"
VIEW_RINGS = "rings"
QUIT_KEYS = "qQ"
VIEW_KEYS = {"s": VIEW_SERVING, "S": VIEW_SERVING, "r": VIEW_RINGS, "R": VIEW_RINGS}
KEYS_HELP = "q quit  s serving view  r rings view"
ESCAPE = "\x1b"
KEY_READ_BYTES = 64
"""Bytes read per key press at most (an escape sequence or a paste is read whole, then ignored)."""


class KeyReader:
    """Single key presses from a terminal on ``stdin``, while used as a context manager.

    On entering, the terminal goes to cbreak mode (keys arrive one by one,
    unechoed; Ctrl-C still raises KeyboardInterrupt); on leaving, its
    previous settings come back, whatever ended the ``with`` block.  When
    ``stdin`` is not a terminal no key ever arrives and :meth:`read` only
    waits.
    """

    def __init__(self, stdin: Any = None) -> None:
        self.stdin = sys.stdin if stdin is None else stdin
        self.fd: int | None = None
        self.saved: list[Any] | None = None

    def __enter__(self) -> KeyReader:
        try:
            fd = self.stdin.fileno()
        except (AttributeError, OSError, ValueError):
            return self
        if os.isatty(fd):
            self.saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
            self.fd = fd
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fd is not None and self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
        self.fd = self.saved = None

    def read(self, timeout_s: float) -> str:
        """The keys typed, waiting up to ``timeout_s`` seconds for the first one ("" if none)."""
        if self.fd is None:
            time.sleep(timeout_s)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return ""
        data = os.read(self.fd, KEY_READ_BYTES)
        if not data:  # the terminal hung up: no key will come, and no setting is left to restore
            self.fd = self.saved = None
            return ""
        return data.decode(errors="ignore")


def handle_keys(view: str, typed: str) -> str | None:
    """The view after the keys ``typed`` in ``view``: ``s`` serving, ``r`` rings; None for ``q`` (quit).
    Other keys, and whatever starts with an escape (arrow keys, a terminal's reports), change nothing."""
    if typed.startswith(ESCAPE):
        return view
    for key in typed:
        if key in QUIT_KEYS:
            return None
        view = VIEW_KEYS.get(key, view)
    return view

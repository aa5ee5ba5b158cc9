"""Stop strings over streamed text: the one scanner of the engines (real and synthetic).

:class:`StopScanner` takes a request's output text in deltas, as they are
produced, and returns the part that is safe to send: the text ends right
before the first stop string to appear (possibly spread over several deltas),
which is never sent, and the longest suffix that could start a stop string is
held back until it is resolved. Torch-free; used by
:class:`ringstream.daemon.engine.detokenizer.IncrementalDetokenizer` and by the
synthetic engine of :mod:`ringstream.daemon.engine.synthetic`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopScanner"]


class StopScanner:
    """Cuts one request's streamed text at its first stop string.

    Args:
        stops: stop strings, characters (empty strings are ignored).

    After :meth:`add`, ``stop_string`` is the stop string that matched, or
    None: the first to be complete in the text so far (of those one delta
    completes, the earliest to start; of two starting at one place, the first
    given). Once one matched the scanner is finished and returns ``""``.
    Each :meth:`add` costs O(len(delta) + longest stop) per stop string.
    """

    __slots__ = ("_stops", "_max_stop_len", "_held", "stop_string")

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stop_string: str | None = None

    def add(self, delta: str, check: bool = True) -> str:
        """Feed a text delta; return the part that is safe to send now (may be "").

        ``check=False``: no stop string may end inside this delta (the request's
        ``min_tokens`` are not out yet); the suffix that could start one is
        still held back, so a later delta may complete a stop string begun here.
        """
        if self.stop_string is not None:
            return ""
        if not self._stops:
            return delta
        pending = self._held + delta
        if not check:
            hold = self._longest_stop_prefix_suffix(pending)
            self._held = pending[len(pending) - hold:]
            return pending[:len(pending) - hold]
        # A match must end inside the new delta, so it starts at most
        # max_stop_len - 1 characters before it.
        search_from = max(0, len(self._held) - self._max_stop_len + 1)
        best_start = -1
        for stop in self._stops:
            start = pending.find(stop, search_from)
            if start != -1 and (best_start == -1 or start < best_start):
                best_start, self.stop_string = start, stop
        if best_start != -1:
            self._held = ""
            return pending[:best_start]
        hold = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - hold:]
        return pending[:len(pending) - hold]

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0

    def flush(self) -> str:
        """Release the held-back text (the request ends without a stop string); ``""`` after a match."""
        held, self._held = self._held, ""
        return "" if self.stop_string is not None else held

"""The finish rule of the engines (real and synthetic): does a request end with the token it just got, and why.

:func:`finish_after_token` is applied once per output token, right after the
token was appended to the request's output, by
:class:`ringstream.daemon.engine.scheduler.StepScheduler` (the paged engine)
and by :class:`ringstream.daemon.engine.synthetic.SyntheticEngine`. Order of
checks (vLLM's ``check_stop`` and detokenizer):

1. EOS / stop token id, once the request has more than ``min_tokens`` output
   tokens: the token stays in the output, adds no text, and the held-back
   text is flushed; ``stop_reason`` is the token id for one of the request's
   own ``stop_token_ids``, None for an EOS id only.
2. Stop string: the token's text is fed to the request's text stream, which
   may end only after ``min_tokens`` output tokens; the text ends right before
   the stop string, which is the ``stop_reason``.
3. Length: ``max_output_tokens`` (``max_tokens`` or what the context leaves)
   reached; the held-back text is flushed; ``stop_reason`` is None.

``ignore_eos`` is applied before the rule runs: the stop-token set a request
is given (:func:`ringstream.daemon.engine.interface.check_request`) holds the
EOS ids only when the request does not ignore them. Torch-free.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from ringstream.ipc.wire import FinishReason

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "TokenText", "finish_after_token"]

FINISH_STOP: str = FinishReason.STOP.value
"""``"stop"``: EOS, a stop token id or a stop string ended the request."""
FINISH_LENGTH: str = FinishReason.LENGTH.value
"""``"length"``: the request reached its most output tokens."""


class TokenText(Protocol):
    """A request's streamed text with stop strings, one token at a time.

    :class:`ringstream.daemon.engine.detokenizer.IncrementalDetokenizer` is
    one; the synthetic engine wraps a
    :class:`ringstream.daemon.common.stops.StopScanner`.
    """

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or None."""

    def add_token(self, token_id: int, check_stops: bool = True) -> str:
        """Feed one output token; return the text delta safe to send now. ``check_stops=False``: no stop
        string may end in this token's text."""

    def flush(self) -> str:
        """Return the held-back text (the request ends without a stop string)."""


def finish_after_token(text: TokenText, token_id: int, num_output: int, stop_token_ids: Container[int],
                       user_stop_token_ids: Container[int], min_tokens: int,
                       max_output_tokens: int) -> tuple[str, str | None, str | int | None]:
    """Apply the finish rule (module docstring) to ``token_id``, the request's output token number
    ``num_output`` (1-based: the output holds ``num_output`` tokens, this one last).

    Args:
        text: the request's text stream; fed ``token_id`` unless it ends the
            request as a stop token, and flushed when the request ends
            without a stop string.
        stop_token_ids: the ids that end the request (its own stop token ids,
            plus EOS unless it ignores EOS).
        user_stop_token_ids: the request's own stop token ids (reported as
            ``stop_reason``).
        min_tokens: output tokens before which neither a stop token nor a stop
            string ends the request.
        max_output_tokens: output tokens at which the request ends for length.

    Returns:
        ``(text delta, finish_reason, stop_reason)``: the token's text to send
        (may be ""), then :data:`FINISH_STOP`, :data:`FINISH_LENGTH` or None
        (the request goes on), and the stop token id or stop string that
        ended it (None for EOS, for length and while it goes on).
    """
    if num_output > min_tokens:
        if token_id in stop_token_ids:
            return text.flush(), FINISH_STOP, token_id if token_id in user_stop_token_ids else None
        delta = text.add_token(token_id)
    else:  # within min_tokens: no stop token or stop string may end here
        delta = text.add_token(token_id, False)
    stop_string = text.stop_string
    if stop_string is not None:
        return delta, FINISH_STOP, stop_string
    if num_output >= max_output_tokens:
        return delta + text.flush(), FINISH_LENGTH, None
    return delta, None, None

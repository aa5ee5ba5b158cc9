"""The OpenAI API's ``logprobs`` objects, built from the daemon's :class:`ringstream.ipc.protocol.TokenLogprob`.

Token strings are decoded in the HTTP process, with the tokenizer it loads
for chat prompts anyway (:class:`TokenStrings`), so neither the front nor
the workers spend anything on them: each id is decoded alone,
``tokenizer.decode([id], skip_special_tokens=False)`` (special tokens show as
their text, e.g. ``</s>``), and memoised. A token that is part of a UTF-8
character decodes to U+FFFD, as in vLLM; its ``bytes`` (chat) are then those
of that replacement, not of the raw byte. ``text_offset`` (completions) is the
running sum of the token strings' lengths from the start of the choice's text
(after the echoed prompt's text when ``echo`` is on, where the prompt tokens
count from 0), vLLM's rule; for text that decodes differently in context
(special tokens skipped in ``text``) the offsets follow the token strings.
"""

from __future__ import annotations

from ringstream.daemon.http import responses as R
from ringstream.ipc import protocol as P

__all__ = ["TokenStrings", "chat_logprobs", "completion_logprobs"]

MAX_CACHED_TOKENS = 1 << 18
"""Most decoded token strings kept (a vocabulary's worth for most models)."""
MIN_LOGPROB = -9999.0
"""Logprobs below this (``-inf`` of a token the model rules out) are reported as this, as vLLM does, so that
the JSON stays numbers."""


def _clamp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class TokenStrings:
    """Decodes single token ids with a ``tokenizers.Tokenizer``, memoised."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._lengths: dict[int, int] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < MAX_CACHED_TOKENS:
                self._cache[token_id] = text
        return text

    def text_length(self, token_id: int) -> int:
        """Characters ``token_id`` adds to the output text: 0 for a special token (BOS...), which the text skips."""
        length = self._lengths.get(token_id)
        if length is None:
            length = len(self._tokenizer.decode([token_id], skip_special_tokens=True))
            if len(self._lengths) < MAX_CACHED_TOKENS:
                self._lengths[token_id] = length
        return length

    def decode(self, ids: list[int]) -> str:
        """The text of a whole id sequence (special tokens skipped, as the daemon's output text)."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def completion_logprobs(entries: list[P.TokenLogprob | None], ids: list[int], names: TokenStrings,
                        start: int = 0) -> R.CompletionLogprobs:
    """The ``logprobs`` of a completion choice: ``ids`` its tokens (echoed prompt first), ``entries`` their
    logprobs (None: a token without context, the prompt's first), ``start`` the text offset of the first."""
    tokens, values, tops, offsets = [], [], [], []
    offset = start
    for token_id, entry in zip(ids, entries):
        text = names(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += names.text_length(token_id)
        if entry is None:
            values.append(None)
            tops.append(None)
        else:  # the chosen token and the top ones, as vLLM's completions answer them (up to logprobs + 1)
            values.append(_clamp(entry.logprob))
            tops.append({text: _clamp(entry.logprob)} | {names(t): _clamp(lp) for t, lp in entry.top})
    return R.CompletionLogprobs(tokens, values, tops, offsets)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[P.TokenLogprob], names: TokenStrings) -> R.ChatLogprobs:
    """The ``logprobs`` of a chat choice or chunk: one entry per generated token, with its top list."""
    content = []
    for entry in entries:
        text = names(entry.token_id)
        top = [R.TopLogprob(names(t), _clamp(lp), _bytes(names(t))) for t, lp in entry.top]
        content.append(R.ChatTokenLogprob(text, _clamp(entry.logprob), _bytes(text), top))
    return R.ChatLogprobs(content)

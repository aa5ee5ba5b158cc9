"""Request validation in the front: everything checked before a request queues.

The wire decoder already enforced types and ranges (``ringstream.ipc.protocol`` limits);
here come the checks that need the model: tokenisation, vocabulary range
(of the prompt here, of the stop token ids in the sampling parameters' one
check, shared with the engines) and the context length. A rejected request
raises :class:`RequestRejected` with the error code its client receives.
"""

from __future__ import annotations

import tokenizers

from ringstream.daemon.model import ModelInfo
from ringstream.ipc import protocol as P

TOKEN_CHARS_MARGIN = 2
"""Normalisers may merge characters (NFC): allow this factor over the longest vocabulary entry."""


class RequestRejected(Exception):
    """A request the daemon will not queue; ``code`` is the wire error code."""

    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Validator:
    """Checks ``Generate`` messages against one model's tokenizer and context."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = max(info.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        longest = max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = TOKEN_CHARS_MARGIN * longest

    def check(self, msg: P.Generate, context_tokens: int = 0) -> list[int]:
        """Return the prompt's token ids, or raise :class:`RequestRejected`.

        ``context_tokens``: the largest prompt + max_tokens a worker can hold
        (0 before any worker reported; the model's context is used then).
        A text prompt so long that it cannot fit even at the longest token is
        refused before it is tokenised, so a huge prompt cannot stall the loop.
        The three steps, :meth:`precheck`, :meth:`tokenize` and :meth:`finish`,
        may also be called apart (the front tokenises long prompts on a thread).
        """
        limit = self.limit(context_tokens)
        self.precheck(msg, limit)
        ids = self.tokenize(msg.prompt) if msg.prompt is not None else msg.prompt_token_ids
        return self.finish(msg, ids, limit)

    def limit(self, context_tokens: int = 0) -> int:
        """Most prompt + max_tokens a request may have, tokens (see :meth:`check` for ``context_tokens``)."""
        return min(context_tokens or self.max_model_len, self.max_model_len)

    def precheck(self, msg: P.Generate, limit: int) -> None:
        """The checks that need no tokenisation, the sampling parameters' among them
        (:func:`ringstream.ipc.protocol.check_sampling`). Raises :class:`RequestRejected`."""
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "give exactly one of prompt or prompt_token_ids")
        if msg.prompt is not None:
            if not msg.prompt:
                raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "empty prompt")
            if len(msg.prompt) > limit * self.max_chars_per_token:
                raise RequestRejected(P.ErrorCode.PROMPT_TOO_LONG,
                                      f"prompt of {len(msg.prompt)} characters cannot fit the context of {limit} tokens")
        elif not msg.prompt_token_ids:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "empty prompt_token_ids")
        try:
            P.check_sampling(msg.sampling, self.vocab_size)
        except ValueError as exc:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, str(exc)) from None

    def tokenize(self, prompt: str, *, release_gil: bool = False) -> list[int]:
        """Token ids of a text prompt (special tokens added). ``release_gil``: let other threads run meanwhile."""
        if release_gil:
            return self.tokenizer.encode_batch([prompt])[0].ids
        return self.tokenizer.encode(prompt).ids

    def finish(self, msg: P.Generate, ids: list[int], limit: int) -> list[int]:
        """Check the prompt's token ids against the vocabulary and ``limit``; returns them. Raises RequestRejected."""
        if ids and max(ids) >= self.vocab_size:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, f"prompt_token_ids: token id {max(ids)} is outside "
                                                               f"the vocabulary of {self.vocab_size}")
        max_tokens = msg.sampling.max_tokens
        if len(ids) + max_tokens > limit:
            raise RequestRejected(
                P.ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len = {limit} tokens",
            )
        return ids

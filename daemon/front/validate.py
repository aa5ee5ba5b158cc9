"""Request validation in the front: everything checked before a request queues.

The wire decoder already enforced types and ranges (``ringstream.ipc.protocol`` limits);
here come the checks that need the model: chat-template rendering, tokenisation, vocabulary range
(of the prompt here, of the stop token ids in the sampling parameters' one
check, shared with the engines) and the context length. A rejected request
raises :class:`RequestRejected` with the error code its client receives.
"""

from __future__ import annotations

import logging

import tokenizers

from ringstream.daemon.common.chat_template import ChatTemplate, ChatTemplateError
from ringstream.daemon.common.model_dir import ModelInfo
from ringstream.ipc import protocol as P

log = logging.getLogger("ringstream.front")

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
        self.model_path = str(info.path)
        self.chat_template: ChatTemplate | None = None
        self.chat_template_error: str | None = None
        """Why the model's template cannot render ``messages`` (none, or it does not compile); None when it can."""
        try:
            self.chat_template = ChatTemplate.from_model_dir(info.path)
        except (ChatTemplateError, OSError) as exc:
            self.chat_template_error = str(exc)
            log.warning("chat requests will be refused: %s", exc)
        if self.chat_template is None and self.chat_template_error is None:
            self.chat_template_error = (f"the model {self.model_path} has no chat template (no chat_template in its "
                                        "tokenizer_config.json or chat_template.jinja): send a prompt instead of messages")
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
        return self.finish(msg, self.prompt_ids(msg), limit)

    def limit(self, context_tokens: int = 0) -> int:
        """Most prompt + max_tokens a request may have, tokens (see :meth:`check` for ``context_tokens``)."""
        return min(context_tokens or self.max_model_len, self.max_model_len)

    def precheck(self, msg: P.Generate, limit: int) -> None:
        """The checks that need no tokenisation, the sampling parameters' among them
        (:func:`ringstream.ipc.protocol.check_sampling`). Raises :class:`RequestRejected`."""
        if (msg.prompt is not None) + (msg.prompt_token_ids is not None) + (msg.messages is not None) != 1:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST,
                                  "give exactly one of prompt, prompt_token_ids or messages")
        if msg.messages is not None:
            self._precheck_messages(msg.messages, limit)
        elif msg.prompt is not None:
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

    def _precheck_messages(self, messages: list[P.ChatMessage], limit: int) -> None:
        if self.chat_template_error is not None:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, self.chat_template_error)
        if not messages:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "empty messages")
        chars = prompt_chars_of(messages)
        if chars > P.MAX_PROMPT_CHARS:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, f"messages: {chars} characters of content; at most "
                                                               f"{P.MAX_PROMPT_CHARS} together")
        if chars > limit * self.max_chars_per_token:
            raise RequestRejected(P.ErrorCode.PROMPT_TOO_LONG,
                                  f"messages of {chars} characters cannot fit the context of {limit} tokens")

    def prompt_ids(self, msg: P.Generate, *, release_gil: bool = False) -> list[int]:
        """The token ids of a prechecked request's prompt: given, tokenised, or its messages rendered with the
        chat template and tokenised without special tokens. Raises RequestRejected when the template fails."""
        if msg.prompt_token_ids is not None:
            return msg.prompt_token_ids
        if msg.prompt is not None:
            return self.tokenize(msg.prompt, release_gil=release_gil)
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
                    for m in msg.messages]
        try:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, str(exc)) from None
        if release_gil:
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "messages: the rendered chat prompt is empty")
        return ids

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


def prompt_chars_of(messages: list[P.ChatMessage]) -> int:
    """Characters of a chat's contents, together."""
    return sum(len(m.content) for m in messages)


def prompt_chars(msg: P.Generate) -> int:
    """Characters the front renders or tokenises for a request: its text prompt or its messages' contents (0 for
    token ids)."""
    if msg.prompt is not None:
        return len(msg.prompt)
    return prompt_chars_of(msg.messages) if msg.messages is not None else 0

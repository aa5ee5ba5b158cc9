"""The OpenAI-compatible API's answers: msgspec Structs of completions, chat completions (whole and streamed
chunks, with tool calls), usage, logprobs and the model list, encoded with
:data:`ringstream.daemon.http.openai_schema.JSON_ENCODER`. Fields are OpenAI's (``logprobs`` is ``null`` unless
asked; ``tool_calls`` / ``function_call`` are left out of a message without calls); the requests they answer are
:mod:`ringstream.daemon.http.openai_schema`'s."""

from __future__ import annotations

from typing import Literal

from msgspec import UNSET, Struct, UnsetType


class UsageBody(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    """A completion choice's ``logprobs``: per token its string, logprob, top ``{string: logprob}`` and its
    offset in the choice's text (the echoed prompt's first token has null logprob and top)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    """A chat choice's (or chunk's) ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionBody(Struct):
    """A ``text_completion`` (whole, or one SSE chunk of a stream with ``usage`` None)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: UsageBody | None = None


class FunctionCallBody(Struct):
    name: str
    arguments: str
    """A JSON object, as a string."""


class ToolCallBody(Struct):
    id: str
    function: FunctionCallBody
    type: Literal["function"] = "function"


class AssistantMessage(Struct):
    """``content`` is null when the answer is tool calls alone; ``tool_calls`` / ``function_call`` are left out
    unless there are calls."""

    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCallBody] | UnsetType = UNSET
    function_call: FunctionCallBody | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionBody(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed call: its first delta has ``id``, ``type`` and ``function.name``; ``arguments`` come in pieces
    that join to the JSON string."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatChunkBody(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: UsageBody | None = None


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "ringstream"
    object: Literal["model"] = "model"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"

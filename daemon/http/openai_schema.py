"""The OpenAI-compatible HTTP API's requests: msgspec Structs of their bodies, their checks, and the API's errors.

Requests (``POST /v1/completions``, ``POST /v1/chat/completions``) decode
with :func:`decode_request` into :class:`CompletionRequest` or
:class:`ChatCompletionRequest`; a body that is not JSON, has a wrong type or
an out-of-range value raises :class:`ApiError` 400 naming the parameter.
A top-level field the API does not know is a 400 naming it, as OpenAI's API
answers (``unknown_fields = "warn"``: logged and ignored, as vLLM does);
fields other servers define that the daemon does not serve are accepted at
their no-op values only (:data:`NOOP_VALUES`). :func:`generate_params` turns a request into the keyword
arguments of :meth:`ringstream.ipc.client.AsyncClient.generate`: the
sampling fields, the penalties (``presence_penalty``, ``frequency_penalty``,
and vLLM's ``repetition_penalty``, ``min_p``, ``min_tokens``), completions'
``logprobs`` (an int; with ``echo`` the prompt's too) and chat's
``logprobs`` / ``top_logprobs``. Fields the daemon cannot honour
(``suffix``, ``logit_bias``, ``best_of`` above ``n``) are refused with 400
rather than silently ignored; ``tools`` are read by :mod:`ringstream.daemon.http.tools`.

The answers' Structs are in :mod:`ringstream.daemon.http.responses`. The error body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (:meth:`ApiError.body`); :func:`api_error_from` maps the
client library's typed exceptions onto HTTP statuses.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from ringstream.daemon.http import tools as T
from ringstream.daemon.http.noop_fields import ANY, NOOP_VALUES
from ringstream.ipc import protocol as P
from ringstream.ipc.errors import (
    DaemonUnavailable, InvalidRequest, PromptTooLong, QueueFull, QueueTimeout, RingstreamError, ShuttingDown,
    UnknownRequest,
)

MAX_CHOICES = 128
"""Most choices one request may ask for (prompts x ``n``, so also the most of each): each is a request to
the daemon."""
MAX_MESSAGES = 4096
"""Most messages of one chat request (the template renders on the event loop)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 answer, seconds."""

JSON_ENCODER = msgspec.json.Encoder()
log = logging.getLogger("ringstream.http")

TokenId = Annotated[int, Meta(ge=0, le=P.MAX_TOKEN_ID)]
StopStrings = Union[
    Annotated[str, Meta(min_length=1, max_length=P.MAX_STOP_CHARS)],
    Annotated[list[Annotated[str, Meta(min_length=1, max_length=P.MAX_STOP_CHARS)]],
              Meta(max_length=P.MAX_STOP_STRINGS)],
]
PromptItem = Union[str, TokenId, list[TokenId]]


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error body.

    Args:
        status: the HTTP status (400, 401, 404, 413, 500, 503...).
        message: what went wrong, for a person.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ``server_error``...).
        param: the request parameter at fault, or None.
        code: a machine-readable code (``model_not_found``, the daemon's error code...), or None.
        retry_after_s: set the ``Retry-After`` header (seconds).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str | None = None) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, code, retry_after_s=RETRY_AFTER_S)


_RETRYABLE = (QueueFull, QueueTimeout, ShuttingDown, UnknownRequest)
"""Refusals that a later try may not get: the daemon is full, stopping, or restarted under the request."""


def api_error_from(exc: RingstreamError) -> ApiError:
    """The HTTP error of a client-library exception: 400 for a bad request, 503 (with ``Retry-After``) when
    the daemon is full, stopping or unreachable, 500 for the rest (``WORKER_FAILED``, ``INTERNAL``...)."""
    if isinstance(exc, PromptTooLong):
        return bad_request(str(exc), "prompt", "context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc), _param_named(str(exc)), str(exc.code))
    if isinstance(exc, _RETRYABLE):
        return unavailable(str(exc), str(exc.code))
    if isinstance(exc, DaemonUnavailable):
        return unavailable(f"the inference daemon is unavailable: {exc}", "daemon_unavailable")
    code = getattr(exc, "code", None)
    return ApiError(500, str(exc), "server_error", None, None if code is None else str(code))


_PARAM_IN_MESSAGE = re.compile(r"\b([a-z][a-z_]+)\b")


def _param_named(message: str) -> str | None:
    """The request field a daemon's INVALID_REQUEST message is about: the first word of it that names a field
    of the OpenAI request (``min_tokens (5) must be <= ...``, ``empty prompt``, ``at `sampling.max_tokens` ``);
    else None."""
    for name in _PARAM_IN_MESSAGE.findall(message):
        if name in _REQUEST_FIELDS:
            return name
    return None


# --------------------------------------------------------------------------
# requests


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields completions and chat completions share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=P.MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    seed: Annotated[int, Meta(ge=0, le=P.MAX_SEED)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Meta(ge=-P.MAX_PENALTY, le=P.MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-P.MAX_PENALTY, le=P.MAX_PENALTY)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=P.MAX_REPETITION_PENALTY)] | None = None
    """vLLM's: 1 switches it off."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=P.MAX_TOKENS_LIMIT)] | None = None
    logit_bias: dict[str, float] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=P.MAX_TOKEN_ID)] | None = None
    """vLLM's: 0 or -1 switch it off."""
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=P.MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    response_format: Any = None
    """OpenAI's: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``."""
    structured_outputs: Any = None
    """vLLM's: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar``, ``json_object``."""
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older spellings of ``structured_outputs`` (which it still accepts)."""
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted and not needed: the daemon has one grammar engine (llguidance)."""
    request_id: str | None = None
    """vLLM's; the answer's id is the server's own (the id is for tracing, not output)."""
    # Fields other clients and routers send that the daemon serves only at their no-op values (:data:`NOOP_VALUES`):
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    no_stop_trim: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    return_hidden_states: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    lora_path: Any = None
    regex: Any = None
    ebnf: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    stream_reasoning: Any = None
    separate_reasoning: Any = None
    include_reasoning: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    session_params: Any = None
    continue_final_message: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids, or a list
    of lists of token ids (one choice set per prompt)."""

    prompt: Union[str, list[PromptItem]]
    max_tokens: Annotated[int, Meta(ge=1, le=P.MAX_TOKENS_LIMIT)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=P.MAX_LOGPROBS)] | None = None
    """Top logprobs per token (0: the sampled token's only)."""
    echo: bool | None = None
    """Prepend the prompt to the text (and, with ``logprobs``, its tokens' logprobs, the first null)."""
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(Struct, forbid_unknown_fields=False):
    """One message: ``content`` is a string, null, or a list of ``{"type": "text", "text": ...}`` parts; an
    assistant's may carry the ``tool_calls`` (or legacy ``function_call``) it made, a ``tool`` message the
    ``tool_call_id`` it answers. Other fields (``refusal``, ``annotations``... of an answer sent back) are
    ignored: they do not reach the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Meta(ge=1, le=P.MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=P.MAX_TOKENS_LIMIT)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=P.MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    """vLLM's: end the rendered prompt with the assistant's turn header."""
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[T.ToolDef], Meta(max_length=T.MAX_TOOLS)] | None = None
    tool_choice: T.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[T.FunctionDef], Meta(max_length=T.MAX_TOOLS)] | None = None
    """OpenAI's legacy spelling of ``tools``: answered with ``function_call``."""
    function_call: T.FunctionCallChoice | None = None


class _LenientCompletionRequest(CompletionRequest, forbid_unknown_fields=False):
    pass


class _LenientChatCompletionRequest(ChatCompletionRequest, forbid_unknown_fields=False):
    pass


_LENIENT: dict[type, type] = {CompletionRequest: _LenientCompletionRequest,
                              ChatCompletionRequest: _LenientChatCompletionRequest}
"""The request types that ignore unknown fields (``unknown_fields = "warn"``)."""

_REQUEST_FIELDS = (frozenset(CompletionRequest.__struct_fields__) | frozenset(ChatCompletionRequest.__struct_fields__)) \
    - {"model", "user"}
"""The names a request may carry that a daemon's refusal can be about, for naming its ``param``."""


_PARAM_AT = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


class TokenizeRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    """``POST /tokenize`` (vLLM's): ``prompt`` (special tokens added unless ``add_special_tokens`` is false, as
    the daemon tokenises a completion's prompt) or ``messages`` (rendered with the chat template, special tokens
    not added unless asked, as a chat's prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    """``POST /detokenize`` (vLLM's): the text of ``tokens``."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Meta(ge=0, le=P.MAX_TOKEN_ID)]], Meta(max_length=P.MAX_PROMPT_TOKEN_IDS)]


def decode_body(body: bytes, kind: type):
    """Decode a JSON request body into ``kind``; ApiError 400 naming the parameter at fault (also for JSON
    nested deeper than the interpreter's recursion limit, which msgspec's decoder enforces)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PARAM_AT.search(text) or _MISSING.search(text)
        raise bad_request(f"invalid request: {text}", match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the body's JSON is nested too deeply") from None


def decode_request(body: bytes, kind: type[_Sampling], unknown_fields: str = "error") -> _Sampling:
    """Decode a JSON request body into ``kind``; ApiError 400 naming the parameter at fault (also for JSON
    nested deeper than the interpreter's recursion limit, which msgspec's decoder enforces), and for a
    parameter the daemon cannot honour.

    A top-level field the API does not know (a typo such as ``max_token``, or another server's extension)
    is a 400 naming it, as OpenAI's API answers, when ``unknown_fields`` is ``error``; with ``warn`` it is
    logged and the request served without it (vLLM's behaviour). Fields inside messages are not checked:
    clients send back answers' extra fields (``refusal``, ``annotations``); tool definitions are.
    """
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _UNKNOWN.fullmatch(str(exc))
        if match is None:
            request = decode_body(body, kind)  # raises its ApiError
        else:
            unknown = _unknown_fields(body, kind) or [match.group(1)]
            if unknown_fields == "error":
                raise bad_request(f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                                  f"{', '.join(unknown)}", unknown[0], "unknown_field") from None
            request = decode_body(body, _LENIENT[kind])
            log.warning("unknown request field%s ignored: %s", "s" if len(unknown) > 1 else "", ", ".join(unknown))
    except (msgspec.DecodeError, RecursionError):
        request = decode_body(body, kind)  # raises its ApiError
    _refuse_unsupported(request)
    return request


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _unknown_fields(body: bytes, kind: type[_Sampling]) -> list[str]:
    """The top-level field names of ``body`` that ``kind`` does not know, in order; empty when the body's
    values nest deeper than the decoder's recursion limit (the caller then names the first one msgspec saw)."""
    try:
        names = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return []
    return [name for name in names if name not in kind.__struct_fields__]


def _refuse_unsupported(req: _Sampling) -> None:
    """ApiError 400 for a parameter the daemon cannot honour (never ignored silently)."""
    for name, allowed in NOOP_VALUES.items():
        value = getattr(req, name)
        if value is not None and ANY not in allowed and not any(
                value == ok and (type(value) is type(ok) or isinstance(ok, float) and not isinstance(value, bool))
                for ok in allowed):
            raise bad_request(f"{name} = {json_text(value)} is not supported"
                              + (f" (only {', '.join(dict.fromkeys(json_text(ok) for ok in allowed))} or null)"
                                 if allowed
                                 else " (only null)"), name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of other than n is not supported", "best_of")
    elif isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported (structured_outputs' "
                          "whitespace_flexible is)", "guided_whitespace_pattern")


def json_text(value) -> str:
    """``value`` as JSON, cut to 40 characters (for an error message)."""
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


Prompt = Union[str, list[int]]


def completion_prompts(req: CompletionRequest) -> list[Prompt]:
    """The prompts of a completion request: each a string or a list of token ids.

    Raises ApiError 400 for an empty prompt list, a list mixing strings, ids
    and id lists, an empty token list, or more than :data:`MAX_CHOICES` choices.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                          "of token ids, not a mix", "prompt")
    if any(isinstance(p, list) and not p for p in prompts):
        raise bad_request("a token id prompt must not be empty", "prompt")
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most {MAX_CHOICES}",
                          "n" if n > 1 else "prompt")
    return prompts


def generate_params(req: _Sampling, max_tokens: int | None, stream: bool,
                    constraint: P.StructuredOutputs | None = None) -> dict:
    """Keyword arguments of ``AsyncClient.generate`` (besides the prompt) for one choice of ``req``.

    ``max_tokens`` None keeps the daemon's default; ``stream=False`` asks the
    daemon for the text in one terminal chunk; ``constraint``: the request's
    :func:`ringstream.daemon.http.constraints.structured_outputs_of`, checked by the caller.
    """
    params: dict[str, Any] = {"stream": stream}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if req.temperature is not None:
        params["temperature"] = req.temperature
    if req.top_p is not None:
        params["top_p"] = req.top_p
    if req.top_k is not None and req.top_k > 0:
        params["top_k"] = req.top_k
    if req.seed is not None:
        params["seed"] = req.seed
    if req.stop:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        params["ignore_eos"] = True
    if req.priority is not None:
        params["priority"] = req.priority
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        params["logprobs"] = req.logprobs
        if req.echo:
            params["prompt_logprobs"] = req.logprobs
    elif isinstance(req, ChatCompletionRequest) and req.logprobs:
        params["logprobs"] = req.top_logprobs or 0
    if constraint is not None:
        params["structured_outputs"] = constraint
    return params


FINISH_REASONS: dict[str, str] = {
    "stop": "stop", "length": "length", "cancelled": "abort", "timeout": "timeout", "shutdown": "abort",
    "error": "error",
}
"""The daemon's finish reasons as the API reports them: ``stop`` and ``length`` are OpenAI's; a cancelled
request or one ended by the daemon's shutdown is ``abort`` (as vLLM names it), the daemon's ``timeout_s``
deadline ``timeout``."""


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(str(reason), str(reason))

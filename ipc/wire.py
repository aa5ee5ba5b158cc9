"""What every message is built from: the encoding options, the limits, the shared enums and the sampling parameters.

:mod:`ringstream.ipc.protocol` (the client channel, and every name of the
protocol re-exported) and :mod:`ringstream.ipc.worker_protocol` (the worker
channel) build on this module, which imports neither.
"""

from __future__ import annotations

import enum
import re
import typing
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Largest client frame the front accepts (ZeroMQ ``MAXMSGSIZE``), bytes."""
MAX_ID_CHARS = 128
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKEN_IDS = 262_144
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_LIMIT = 1_048_576
"""Largest ``max_tokens`` the wire accepts; the model's context is checked later."""
MAX_TEMPERATURE = 100.0
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in ``[-MAX_PENALTY, MAX_PENALTY]`` (OpenAI's range)."""
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20
"""Most top logprobs per token (``logprobs``, ``prompt_logprobs``); vLLM's default ``max_logprobs``."""
MAX_GRAMMAR_CHARS = 65_536
"""Longest JSON schema, regex or grammar text of ``StructuredOutputs``, characters."""
MAX_CHOICES = 256
"""Most alternatives of ``StructuredOutputs.choice``."""
MAX_ADMIN_SETTINGS = 32
MAX_OPEN_IDS = 65_536
MAX_STATUS_REQUESTS = 100
"""Open requests a ``StatusReply`` lists at most (the oldest), so that a reply stays small."""

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Seconds = Annotated[float, Meta(gt=0, le=86_400)]

WIRE = dict(array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=False)
"""Options of every wire struct: encoded as an array (``[tag, field, ...]`` when tagged), unknown trailing
fields (a newer peer's) ignored."""


class ErrorCode(enum.StrEnum):
    """Typed error codes of ``Error``; each ends its request (terminal)."""

    INVALID_REQUEST = "INVALID_REQUEST"
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    QUEUE_FULL = "QUEUE_FULL"
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
    WORKER_FAILED = "WORKER_FAILED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    INTERNAL = "INTERNAL"


class FinishReason(enum.StrEnum):
    """Why a stream ended; carried by the last ``Chunk``."""

    STOP = "stop"
    """EOS, a stop token id or a stop string (``Chunk.stop_reason`` says which)."""
    LENGTH = "length"
    """``max_tokens`` reached, or the model's context is full."""
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    ERROR = "error"


class StructuredOutputs(Struct, frozen=True, **WIRE):
    """A constraint on the output: exactly one field set (vLLM's ``structured_outputs`` request field).

    The engine masks the logits of every step with what the constraint allows next (a grammar engine,
    llguidance, compiled once per constraint text and kept), for greedy and sampled rows alike; the stream
    ends with ``finish_reason="stop"`` when the constraint is complete.

    Attributes:
        json: a JSON schema, as JSON text: the output is one JSON value that validates against it.
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's; ``start`` is the start rule) or in
            GBNF (llama.cpp's EBNF, ``root ::= ...``).
        json_object: the output is one JSON object of any shape (OpenAI's ``response_format`` ``json_object``).
        whitespace_flexible: JSON may carry any whitespace between tokens (default: the compact form, no
            whitespace; a model may otherwise pad with spaces and newlines until ``max_tokens``).
    """

    json: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    regex: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool = False
    whitespace_flexible: bool = False

    @property
    def kind(self) -> str:
        """The one constraint set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``; ValueError
        for none or several."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        return given[0]


class SamplingParams(Struct, frozen=True, **WIRE):
    """How to pick and when to stop generating tokens for one request.

    Carried unchanged from the client (``Generate.sampling``) through the front
    (``Assign.sampling``) to the engine (``EngineRequest.params``). Built in
    Python (``SamplingParams(max_tokens=8, temperature=0.0)``) nothing is
    checked; :func:`check_sampling` applies the limits below and the checks
    that need the model, in the front and in every engine.

    Attributes:
        max_tokens: most output tokens, in ``[1, MAX_TOKENS_LIMIT]``, counting
            those of a resumed request generated before the resume; the
            model's context may end the request sooner.
        temperature: logit divisor, in ``[0, MAX_TEMPERATURE]``; 0 is greedy (argmax).
        top_p: nucleus mass kept, in ``(0, 1]``; 1.0 switches it off.
        top_k: number of most likely tokens kept; 0 switches it off.
        seed: per-request seed in ``[0, 2**63)``: the same seed and prompt give the
            same tokens whatever else is batched with the request, and a resumed
            request continues the same tokens (the generator is reseeded per
            output token from ``(seed, seq)``). None uses the engine's generator.
        stop: at most ``MAX_STOP_STRINGS`` non-empty strings of at most
            ``MAX_STOP_CHARS`` characters; the output text ends right before the
            first one to appear, which is not sent.
        stop_token_ids: at most ``MAX_STOP_TOKEN_IDS`` token ids that end the
            request after that token (it is in the output token ids and adds no text).
        ignore_eos: keep generating past the model's EOS token(s).
        presence_penalty: in ``[-2, 2]``, subtracted once from the logit of
            every token that occurs in the output so far (OpenAI's and vLLM's
            semantics: output tokens only, the prompt does not count); 0 is off.
        frequency_penalty: in ``[-2, 2]``, subtracted from each token's logit
            once per occurrence in the output so far; 0 is off.
        repetition_penalty: in ``(0, MAX_REPETITION_PENALTY]``; the logit of
            every token of the prompt or the output so far is divided by it
            where positive and multiplied by it where not (Keskar et al., 2019,
            "CTRL"; Hugging Face's ``RepetitionPenaltyLogitsProcessor``; vLLM's
            ``apply_penalties`` in ``vllm/model_executor/layers/utils.py``);
            1.0 is off.
        min_p: in ``[0, 1]``; after temperature, tokens whose probability is
            below ``min_p`` times the most likely token's are dropped (vLLM's
            ``MinPLogitsProcessor``, ``vllm/v1/sample/logits_processor``); 0 is
            off; no effect on greedy rows.
        min_tokens: in ``[0, max_tokens]``; until the output holds this many
            tokens, EOS and ``stop_token_ids`` get no probability (they cannot
            be sampled, greedy rows included) and stop strings are not looked
            for; a stop string counts when a later token completes it, its
            start may lie in the earlier text (vLLM: ``MinTokensLogitsProcessor``
            and ``check_stop_strings`` only past ``min_tokens`` in
            ``vllm/v1/engine/detokenizer.py``).
        logprobs: None (off), or how many most likely tokens' logprobs each
            output token carries besides its own, in ``[0, MAX_LOGPROBS]``
            (0: only the sampled token's). They are the model's RAW logprobs,
            ``log_softmax`` of its logits before penalties, temperature and
            filters (vLLM's default ``logprobs_mode="raw_logprobs"``,
            ``Sampler.compute_logprobs`` in ``vllm/v1/sample/sampler.py``).
        prompt_logprobs: None (off), or as ``logprobs`` for every prompt
            token after the first (the logprob of prompt token ``i`` given
            tokens ``0..i-1``). A request asking for them skips the prefix
            cache (every prompt position must be computed), as in vLLM.
        structured_outputs: None (free text), or the constraint the output must meet
            (:class:`StructuredOutputs`); the engine refuses a constraint it cannot compile with
            ``INVALID_REQUEST`` before anything is scheduled.

    Processing order of the logits (vLLM's ``Sampler.forward``): raw logprobs,
    then ``min_tokens`` masking and the penalties, then greedy argmax or
    temperature, ``min_p``, ``top_k``, ``top_p`` and the draw.

    Evolution: a new field goes at the end, with a default (an older peer then
    ignores it, a newer one reads the default from an older peer's shorter array).
    """

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)] = 0
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
        Meta(max_length=MAX_STOP_STRINGS),
    ] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class TokenLogprob(Struct, frozen=True, **WIRE):
    """The logprob of one token and, when asked, of the most likely tokens at its position.

    Attributes:
        token_id: the token (sampled, or the prompt's).
        logprob: its natural-log probability under the model's raw distribution.
        top: ``(token id, logprob)`` of the most likely tokens, most likely first
            (as many as the request's ``logprobs`` / ``prompt_logprobs``; the
            token itself may be among them).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


def check_sampling(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Check ``params`` against the wire limits above and, given ``vocab_size``, the model's vocabulary.

    The one check of sampling parameters, called by the front's validator and
    by every engine's ``check_request``: a decoded message meets the limits
    already, parameters built in Python (an engine driven directly) may not.
    Raises ValueError naming the field (``... - at `top_p```), for ``min_tokens`` above ``max_tokens``, or for
    ``structured_outputs`` that set no constraint or several (whether one compiles is the engine's check).
    """
    try:
        msgspec.convert(msgspec.to_builtins(params), SamplingParams)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValueError(name_path(str(exc), SamplingParams)) from None
    if params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
    if params.structured_outputs is not None:
        params.structured_outputs.kind  # exactly one constraint (ValueError otherwise)
    if vocab_size is not None and params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        raise ValueError(f"stop_token_ids: token id {max(params.stop_token_ids)} is outside the "
                         f"vocabulary of {vocab_size}")


_PATH = re.compile(r"`\$((?:\[\d+\])+)")


def name_path(text: str, cls: type[Struct]) -> str:
    """``text`` (a msgspec error about a ``cls`` array), its array path named by field.

    E.g. ``$[4][0]`` of a ``Generate`` becomes ``sampling.max_tokens``.
    Positions past a struct (into a list) stay indexes (``stop[1]``); a path
    that does not fit ``cls`` leaves ``text`` as it is.
    """
    match = _PATH.search(text)
    if match is None:
        return text
    path, kind = "", cls
    for index in map(int, re.findall(r"\d+", match.group(1))):
        if kind is None:
            path += f"[{index}]"
            continue
        fields = msgspec.structs.fields(kind)
        position = index - (kind.__struct_config__.tag is not None)
        if not 0 <= position < len(fields):
            return text
        path += ("." if path else "") + fields[position].name
        kind = _struct_of(fields[position].type)
    return text[: match.start()] + f"`{path}" + text[match.end():]


def _struct_of(annotation) -> type[Struct] | None:
    """The Struct type an annotation stands for (``Annotated`` and ``| None`` unwrapped), else None."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    struct = options[0] if len(options) == 1 else None
    return struct if isinstance(struct, type) and issubclass(struct, Struct) else None

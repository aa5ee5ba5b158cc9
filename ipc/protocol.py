"""Every message that crosses a process boundary, as tagged msgspec structs.

Two channels use these types:

* the **client channel** (apps <-> front, ZeroMQ DEALER <-> ROUTER): a client
  sends one of :data:`ClientMessage`, the front answers with
  :data:`ServerMessage`; both are defined here;
* the **worker channel** (front <-> worker processes, ZeroMQ PUSH/PULL): the
  front sends :data:`WorkerCommand`, workers send :data:`WorkerEvent`
  (defined in :mod:`ringstream.ipc.worker_protocol`, every name re-exported
  here). Tokens themselves do not travel there; they go through the
  shared-memory ring (:mod:`ringstream.ipc.ring`), whose FINISH and ERROR
  records carry a msgpack-encoded :class:`Finish` or :class:`WorkerError` payload.

The limits, error codes, finish reasons and :class:`SamplingParams` (how a
request samples and stops, carried from ``Generate`` through ``Assign`` to the
engine unchanged) live in :mod:`ringstream.ipc.wire`, re-exported here too.

Encoding: msgpack, each struct ``array_like`` (``[tag, field, ...]``) with its
tag first; a nested struct (``Generate.sampling``) is one nested array.
Evolution is append-only: a new field goes at the end of its struct with a
default, so a peer of the previous version still decodes it (the tests decode
messages written by older layouts). Decoders are built once per direction
(:data:`CLIENT_DECODER`, ...) and reused.

Versions (:data:`PROTOCOL_VERSION`):

* 2: the sampling fields of ``Generate`` (``max_tokens`` ... ``ignore_eos``,
  its array positions 4 to 11 in version 1) became one nested array,
  ``sampling`` at position 4, followed by ``priority``, ``queue_timeout_s``,
  ``timeout_s`` and ``stream``. A version-1 ``Generate`` that gives only its
  leading fields (id, prompt, prompt_token_ids) decodes with every default; one
  that gives more has a number at position 4 and is refused with
  ``INVALID_REQUEST`` (``Expected `array`, got `int` - at `sampling```).
  ``Assign`` carries the same ``sampling`` array (front and workers are always
  the same version).
  Appended since, with defaults (older peers keep working): ``SamplingParams``'
  ``presence_penalty`` ... ``prompt_logprobs``; ``Chunk``'s ``logprobs``,
  ``prompt_logprobs`` and ``prompt_token_ids``.
* 1: the first layout.

Limits (the ``Meta`` constraints) are part of the protocol: a frame that
breaks them fails to decode with :class:`msgspec.ValidationError`, before the
front allocates anything for it. ``MAX_FRAME_BYTES`` is the ZeroMQ
``MAXMSGSIZE`` the front sets on its socket.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from ringstream.ipc.wire import (  # noqa: F401  (re-exported: the protocol's one namespace)
    MAX_ADMIN_SETTINGS, MAX_FRAME_BYTES, MAX_ID_CHARS, MAX_OPEN_IDS, MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS,
    MAX_SEED, MAX_STATUS_REQUESTS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
    MAX_TOKEN_ID, MAX_TOKENS_LIMIT, WIRE, ErrorCode, FinishReason, RequestId, SamplingParams, Seconds, TokenId,
    TokenLogprob, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_GRAMMAR_CHARS, MAX_CHOICES,
    StructuredOutputs, check_sampling, name_path,
)
from ringstream.ipc.worker_protocol import (  # noqa: F401  (re-exported)
    COMMAND_DECODER, EVENT_DECODER, FINISH_DECODER, PROMPT_LOGPROBS_DECODER, TOKEN_PAYLOAD_DECODER,
    FLAG_LOGPROBS, WORKER_ERROR_DECODER, Abort, Assign, Doorbell, Finish, TokenPayload,
    RingSpace, Shutdown, WorkerCapacity, WorkerCommand, WorkerError, WorkerEvent, WorkerHeartbeat, WorkerReady,
    WORKER_PHASES, WorkerStartFailed, WorkerStarting,
)

PROTOCOL_VERSION = 2
"""Layout version of the messages (see the module docstring for what each changed)."""

# --------------------------------------------------------------------------
# client -> front


MAX_CHAT_MESSAGES = 4096
"""Messages of one chat request at most (their contents together: ``MAX_PROMPT_CHARS`` characters)."""
MAX_ROLE_CHARS = 64
"""Longest ``role`` or ``name`` of a chat message."""


class ChatMessage(Struct, **WIRE):
    """One message of a chat request (``Generate.messages``), as the model's chat template reads it."""

    role: Annotated[str, Meta(min_length=1, max_length=MAX_ROLE_CHARS)]
    """``system``, ``user``, ``assistant``... (what the template knows)."""
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] = ""
    name: Annotated[str, Meta(min_length=1, max_length=MAX_ROLE_CHARS)] | None = None


class Generate(Struct, tag="generate", **WIRE):
    """Start a generation; answered by ``Chunk``s (``seq`` 0, 1, ...) and one
    terminal message: a ``Chunk`` with ``finish_reason`` or an ``Error``.

    Exactly one of ``prompt`` (text, tokenised by the daemon with the model's
    tokenizer, special tokens such as BOS added), ``prompt_token_ids`` or
    ``messages`` is given. ``messages`` (a chat, at most ``MAX_CHAT_MESSAGES``,
    their contents together at most ``MAX_PROMPT_CHARS`` characters) are
    rendered by the daemon with the model's chat template, with the prompt of
    the assistant's reply (``add_generation_prompt``), and tokenised without
    adding special tokens (the template holds them); a model without a
    template refuses them with ``INVALID_REQUEST``. A daemon older than the
    field ignores it and refuses the request as having no prompt. ``sampling``: how tokens are picked and when the stream stops
    (:class:`SamplingParams`; ``stop`` strings end the stream before the
    matched text, which is not sent). ``priority``: lower is served first.
    ``queue_timeout_s`` bounds the wait before the first token is scheduled,
    ``timeout_s`` the whole request, both in seconds; a request may shorten,
    never lengthen, the daemon's defaults. With ``stream=False`` the text
    arrives in one terminal ``Chunk``. :func:`make_generate` builds one from
    flat fields (``max_tokens=8, stop=["\\n"]``).
    """

    id: RequestId
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    queue_timeout_s: Seconds | None = None
    timeout_s: Seconds | None = None
    stream: bool = True
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_CHAT_MESSAGES)] | None = None


_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def make_generate(id: str, **fields) -> Generate:
    """A :class:`Generate` of flat keyword fields: :class:`SamplingParams`' (``max_tokens``, ``stop``...)
    go into ``sampling``, the others are ``Generate``'s own. Raises TypeError for an unknown field."""
    sampling = {name: fields.pop(name) for name in _SAMPLING_FIELDS & fields.keys()}
    if sampling and "sampling" in fields:
        raise TypeError(f"give sampling or its fields ({', '.join(sorted(sampling))}), not both")
    return Generate(id=id, **fields, **({"sampling": SamplingParams(**sampling)} if sampling else {}))


class Cancel(Struct, tag="cancel", **WIRE):
    """Stop request ``id``; it ends with ``finish_reason="cancelled"``."""

    id: RequestId


class Heartbeat(Struct, tag="heartbeat", **WIRE):
    """Sent by a client with open requests at least every ``client_timeout_s / 3``.

    The front answers with :class:`HeartbeatAck`, so a client can tell that
    the daemon is alive too. ``open_ids`` lists the client's open requests:
    the front answers each id it does not know (e.g. after a daemon restart)
    with ``UNKNOWN_REQUEST``, so no stream waits forever for a lost request.
    """

    open_ids: Annotated[list[RequestId], Meta(max_length=MAX_OPEN_IDS)] = []


class Status(Struct, tag="status", **WIRE):
    """Ask for live figures; answered by :class:`StatusReply`."""


AdminValue = Union[bool, int, float, str, dict[str, int]]


class Admin(Struct, tag="admin", **WIRE):
    """Change live settings (``{"max_concurrency": 8}``); answered by :class:`StatusReply`."""

    settings: Annotated[dict[Annotated[str, Meta(max_length=64)], AdminValue], Meta(max_length=MAX_ADMIN_SETTINGS)]


class Metrics(Struct, tag="metrics", **WIRE):
    """Ask for the daemon's Prometheus exposition (text format 0.0.4); answered by :class:`MetricsReply`.

    Accepted on every socket (it changes nothing). A daemon older than this
    message answers ``Error(id=None, code=INVALID_REQUEST)``.
    """


ClientMessage = Union[Generate, Cancel, Heartbeat, Status, Admin, Metrics]


# --------------------------------------------------------------------------
# front -> client


class Usage(Struct, **WIRE):
    """Token counts and timings of a finished request (seconds)."""

    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0


class Chunk(Struct, tag="chunk", **WIRE):
    """A piece of a request's output.

    ``seq`` counts this request's chunks from 0 with no gap. ``text`` is valid
    UTF-8 (a character split across tokens is sent whole, with the later
    token); ``token_ids`` are the tokens this chunk adds. The last chunk has
    ``finish_reason`` and ``usage`` set and may carry no text.

    For a request with ``sampling.logprobs`` set, ``logprobs`` has one
    :class:`TokenLogprob` per entry of ``token_ids`` (else None). For one with
    ``sampling.prompt_logprobs`` set, the first chunk with tokens carries
    ``prompt_token_ids`` and ``prompt_logprobs``: one entry per prompt token,
    None for the first (it has no context).
    """

    id: str
    seq: int
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None


class Error(Struct, tag="error", **WIRE):
    """A typed failure. With an ``id`` it is that request's terminal message;
    with ``id=None`` it answers a frame that named no request (undecodable)."""

    id: str | None
    code: ErrorCode
    message: str


class HeartbeatAck(Struct, tag="heartbeat_ack", **WIRE):
    """Answer to :class:`Heartbeat`."""


class WorkerStatus(Struct, **WIRE):
    """One worker as the front sees it."""

    index: int
    device: str
    pid: int
    alive: bool
    running: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_tokens: int
    kv_cache_tokens_used: int
    ring_fill: float
    requests_served: int
    block_size: int = 1
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_cache_usage: float = 0.0
    """Blocks held by requests / blocks in the pool (0..1), as the worker last reported."""
    preemptions_kv_cache: int = 0
    """Requests the worker preempted because its KV blocks ran out (since it started)."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_priority: int = 0
    """Requests preempted on this worker for more urgent ones (since the daemon started)."""
    waiting: int = 0
    """Requests assigned to this worker that its engine has not scheduled yet (no free KV blocks or batch
    slot), as the worker last reported; the front's own queue is ``StatusReply.waiting``."""
    tokens_per_s: float = 0.0
    """Decode rate of the requests running here, tokens per second: the sum over them of the tokens each
    streamed after its first one, divided by the seconds since that first token (an estimate; the exact
    figure of the whole daemon is ``StatusReply.tokens_per_s``)."""
    phase: str = ""
    """What the worker is doing (``worker_protocol.WORKER_PHASES``): ``ready`` when serving; while it starts,
    the phase it is in (``loading weights``...), whose figures are zeros until it is ready."""
    phase_s: float = 0.0
    """Seconds since the worker entered ``phase``."""


class RequestInfo(Struct, **WIRE):
    """One open request as the front sees it (an entry of ``StatusReply.requests``)."""

    id: str
    """The client's request id (ids are scoped per client: two clients may use the same one)."""
    priority: int
    state: str
    """``waiting`` (queued, or back after a preemption), ``running``, ``preempting`` or ``aborting``."""
    worker: int | None = None
    """The worker it runs on (or is being stopped on); None while waiting."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Tokens streamed so far."""
    max_tokens: int = 0
    age_s: float = 0.0
    """Seconds since it arrived."""
    ttft_s: float | None = None
    """Seconds from arrival to its first token; None before that token."""


class StatusReply(Struct, tag="status_reply", **WIRE):
    """Live figures of the daemon."""

    version: str
    ready: bool
    state: str
    uptime_s: float
    waiting: int
    running: int
    queue_size: int
    max_concurrency: int
    requests_total: int
    tokens_generated_total: int
    workers: list[WorkerStatus]
    settings: dict[str, AdminValue] = {}
    counters: dict[str, int] = {}
    metrics: dict[str, float] = {}
    """Every Prometheus sample of the daemon, ``{"name{label=value}": value}`` (no histogram buckets)."""
    notes: list[str] = []
    """After ``Admin``: what takes effect differently from what was asked (e.g. a value capped)."""
    model: str = ""
    """The model being served: its directory (``--model``, or the built-in model's)."""
    tokens_per_s: float = 0.0
    """Tokens streamed per second over the last ``tokens_per_s_window_s`` seconds (all workers)."""
    tokens_per_s_window_s: float = 0.0
    """The window of ``tokens_per_s``, seconds (shorter just after the start)."""
    ttft_p50_s: float | None = None
    """Median time to first token since the start, seconds, estimated from the TTFT histogram's buckets
    (linear within a bucket, as Prometheus' ``histogram_quantile``); None before any first token."""
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    """Median inter-token latency since the start, seconds (same estimate, ITL histogram)."""
    itl_p99_s: float | None = None
    requests_open: int = 0
    """Requests admitted and not yet ended (waiting, running, preempting, aborting)."""
    requests: list[RequestInfo] = []
    """The oldest open requests, oldest first: at most ``MAX_STATUS_REQUESTS`` of ``requests_open``."""
    accepts_messages: bool = False
    """The daemon takes ``Generate.messages`` (False from a daemon older than the field)."""


class MetricsReply(Struct, tag="metrics_reply", **WIRE):
    """Answer to :class:`Metrics`: every metric of the daemon in Prometheus' text exposition format."""

    text: str


ServerMessage = Union[Chunk, Error, HeartbeatAck, StatusReply, MetricsReply]


# --------------------------------------------------------------------------
# codecs, built once per direction

ENCODER = msgspec.msgpack.Encoder()
CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
SERVER_DECODER = msgspec.msgpack.Decoder(ServerMessage)

DecodeError = msgspec.DecodeError
"""Raised by every decoder for a malformed frame (``ValidationError`` is a subclass)."""

def encode(message: Struct) -> bytes:
    """Serialise one message to msgpack bytes."""
    return ENCODER.encode(message)


_CLIENT_TYPES = {cls.__struct_config__.tag: cls for cls in ClientMessage.__args__}


def explain(error: msgspec.DecodeError, frame: bytes) -> str:
    """The decode error of a client frame, array positions named by field (``$[4][0]``: ``sampling.max_tokens``)."""
    cls = _CLIENT_TYPES.get(frame_head(frame)[0])
    return str(error) if cls is None else name_path(str(error), cls)


def frame_head(frame: bytes) -> tuple[str | None, str | None]:
    """The first two elements of a frame that is a msgpack array (a message's tag and, mostly, its request id).

    Each is returned when it is a string, else None. Only the array header and
    those two strings are read, whatever follows: a malformed or hostile frame
    (deep nesting, huge arrays) costs no decoding and no allocation here.
    """
    size = len(frame)
    if not size:
        return None, None
    first = frame[0]
    if 0x90 <= first <= 0x9F:
        count, pos = first & 0x0F, 1
    elif first in _ARRAY_HEADERS and size >= 1 + _ARRAY_HEADERS[first]:
        width = _ARRAY_HEADERS[first]
        count, pos = int.from_bytes(frame[1:1 + width], "big"), 1 + width
    else:
        return None, None
    tag, pos = _string_at(frame, pos) if count >= 1 else (None, -1)
    second, _ = _string_at(frame, pos) if count >= 2 and pos >= 0 else (None, -1)
    return tag, second


_ARRAY_HEADERS = {0xDC: 2, 0xDD: 4}
"""msgpack array16 / array32: the width of their element count, bytes."""
_STRING_HEADERS = {0xD9: 1, 0xDA: 2, 0xDB: 4}
"""msgpack str8 / str16 / str32: the width of their length, bytes."""


def _string_at(frame: bytes, pos: int) -> tuple[str | None, int]:
    """The msgpack string at ``pos`` of ``frame`` and the position after it; ``(None, -1)`` if there is none."""
    if pos >= len(frame):
        return None, -1
    marker = frame[pos]
    if 0xA0 <= marker <= 0xBF:
        start, length = pos + 1, marker & 0x1F
    elif marker in _STRING_HEADERS and pos + 1 + _STRING_HEADERS[marker] <= len(frame):
        width = _STRING_HEADERS[marker]
        start, length = pos + 1 + width, int.from_bytes(frame[pos + 1:pos + 1 + width], "big")
    else:
        return None, -1
    end = start + length
    if end > len(frame):
        return None, -1
    try:
        return frame[start:end].decode(), end
    except UnicodeDecodeError:
        return None, -1


def to_dict(message: Struct) -> dict:
    """A message as a dict keyed by field name (nested structs too), e.g. for JSON output."""
    return {name: to_dict(value) if isinstance(value, Struct) else
            [to_dict(v) if isinstance(v, Struct) else v for v in value] if isinstance(value, list) else value
            for name in message.__struct_fields__ for value in (getattr(message, name),)}


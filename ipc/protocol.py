"""Every message that crosses a process boundary, as tagged msgspec structs.

Two channels use these types:

* the **client channel** (apps <-> front, ZeroMQ DEALER <-> ROUTER): a client
  sends one of :data:`ClientMessage`, the front answers with
  :data:`ServerMessage`;
* the **worker channel** (front <-> worker processes, ZeroMQ PUSH/PULL): the
  front sends :data:`WorkerCommand`, workers send :data:`WorkerEvent`. Tokens
  themselves do not travel here; they go through the shared-memory ring
  (:mod:`ringstream.ipc.ring`), whose FINISH and ERROR records carry a msgpack-encoded
  :class:`Finish` or :class:`WorkerError` payload.

Encoding: msgpack, each struct ``array_like`` (``[tag, field, ...]``) with its
tag first. Evolution is append-only: a new field goes at the end of its struct
with a default, so a peer of the previous version still decodes it (the tests
decode messages written by older layouts). Decoders are built once per
direction (:data:`CLIENT_DECODER`, ...) and reused.

Limits (the ``Meta`` constraints below) are part of the protocol: a frame that
breaks them fails to decode with :class:`msgspec.ValidationError`, before the
front allocates anything for it. ``MAX_FRAME_BYTES`` is the ZeroMQ
``MAXMSGSIZE`` the front sets on its socket.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1

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
MAX_ADMIN_SETTINGS = 32
MAX_OPEN_IDS = 65_536
MAX_STATUS_REQUESTS = 100
"""Open requests a :class:`StatusReply` lists at most (the oldest), so that a reply stays small."""

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Seconds = Annotated[float, Meta(gt=0, le=86_400)]

_WIRE = dict(array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=False)


class ErrorCode(enum.StrEnum):
    """Typed error codes of :class:`Error`; each ends its request (terminal)."""

    INVALID_REQUEST = "INVALID_REQUEST"
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    QUEUE_FULL = "QUEUE_FULL"
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
    WORKER_FAILED = "WORKER_FAILED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    INTERNAL = "INTERNAL"


class FinishReason(enum.StrEnum):
    """Why a stream ended; carried by the last :class:`Chunk`."""

    STOP = "stop"
    """EOS, a stop token id or a stop string (``Chunk.stop_reason`` says which)."""
    LENGTH = "length"
    """``max_tokens`` reached, or the model's context is full."""
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    ERROR = "error"


# --------------------------------------------------------------------------
# client -> front


class Generate(Struct, tag="generate", **_WIRE):
    """Start a generation; answered by ``Chunk``s (``seq`` 0, 1, ...) and one
    terminal message: a ``Chunk`` with ``finish_reason`` or an ``Error``.

    Exactly one of ``prompt`` (text, tokenised by the daemon with the model's
    tokenizer, special tokens such as BOS added) or ``prompt_token_ids`` is
    given. ``temperature == 0`` is greedy decoding. ``top_k == 0`` and
    ``top_p == 1`` switch those filters off. ``seed`` makes sampling
    reproducible whatever else is batched with the request. ``stop`` strings
    end the stream before the matched text (it is not sent); ``stop_token_ids``
    and EOS (unless ``ignore_eos``) end it after that token. ``priority``:
    lower is served first. ``queue_timeout_s`` bounds the wait before the first
    token is scheduled, ``timeout_s`` the whole request, both in seconds; a
    request may shorten, never lengthen, the daemon's defaults. With
    ``stream=False`` the text arrives in one terminal ``Chunk``.
    """

    id: RequestId
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
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
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    queue_timeout_s: Seconds | None = None
    timeout_s: Seconds | None = None
    stream: bool = True


class Cancel(Struct, tag="cancel", **_WIRE):
    """Stop request ``id``; it ends with ``finish_reason="cancelled"``."""

    id: RequestId


class Heartbeat(Struct, tag="heartbeat", **_WIRE):
    """Sent by a client with open requests at least every ``client_timeout_s / 3``.

    The front answers with :class:`HeartbeatAck`, so a client can tell that
    the daemon is alive too. ``open_ids`` lists the client's open requests:
    the front answers each id it does not know (e.g. after a daemon restart)
    with ``UNKNOWN_REQUEST``, so no stream waits forever for a lost request.
    """

    open_ids: Annotated[list[RequestId], Meta(max_length=MAX_OPEN_IDS)] = []


class Status(Struct, tag="status", **_WIRE):
    """Ask for live figures; answered by :class:`StatusReply`."""


AdminValue = Union[bool, int, float, str, dict[str, int]]


class Admin(Struct, tag="admin", **_WIRE):
    """Change live settings (``{"max_concurrency": 8}``); answered by :class:`StatusReply`."""

    settings: Annotated[dict[Annotated[str, Meta(max_length=64)], AdminValue], Meta(max_length=MAX_ADMIN_SETTINGS)]


ClientMessage = Union[Generate, Cancel, Heartbeat, Status, Admin]


# --------------------------------------------------------------------------
# front -> client


class Usage(Struct, **_WIRE):
    """Token counts and timings of a finished request (seconds)."""

    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0


class Chunk(Struct, tag="chunk", **_WIRE):
    """A piece of a request's output.

    ``seq`` counts this request's chunks from 0 with no gap. ``text`` is valid
    UTF-8 (a character split across tokens is sent whole, with the later
    token); ``token_ids`` are the tokens this chunk adds. The last chunk has
    ``finish_reason`` and ``usage`` set and may carry no text.
    """

    id: str
    seq: int
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None


class Error(Struct, tag="error", **_WIRE):
    """A typed failure. With an ``id`` it is that request's terminal message;
    with ``id=None`` it answers a frame that named no request (undecodable)."""

    id: str | None
    code: ErrorCode
    message: str


class HeartbeatAck(Struct, tag="heartbeat_ack", **_WIRE):
    """Answer to :class:`Heartbeat`."""


class WorkerStatus(Struct, **_WIRE):
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


class RequestInfo(Struct, **_WIRE):
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


class StatusReply(Struct, tag="status_reply", **_WIRE):
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


ServerMessage = Union[Chunk, Error, HeartbeatAck, StatusReply]


# --------------------------------------------------------------------------
# front -> worker


class Assign(Struct, tag="assign", **_WIRE):
    """Start generating request ``handle`` (unique within the daemon run).

    ``output_token_ids`` are tokens the client has already received (resume
    after preemption or a worker restart); the worker continues at
    ``seq = len(output_token_ids)``.
    """

    handle: int
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    output_token_ids: list[int] = []
    priority: int = 0
    """The request's priority (lower is more urgent): the engine preempts the least urgent first
    when its KV-cache blocks run out."""


class Abort(Struct, tag="abort", **_WIRE):
    """Stop ``handle`` now; the worker answers with a FINISH record (cancelled)."""

    handle: int


class RingSpace(Struct, tag="ring_space", **_WIRE):
    """Doorbell: the front freed ring space while the worker waited for it."""


class Shutdown(Struct, tag="shutdown", **_WIRE):
    """Finish nothing more; exit now."""


WorkerCommand = Union[Assign, Abort, RingSpace, Shutdown]


# --------------------------------------------------------------------------
# worker -> front


class WorkerReady(Struct, tag="worker_ready", **_WIRE):
    """The worker loaded its model and warmed up; its capacity."""

    worker: int
    pid: int
    device: str
    max_num_seqs: int
    max_model_len: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    block_size: int = 1
    """Token positions per KV-cache block; ``kv_cache_tokens`` is a whole number of blocks."""
    prefix_caching: bool = False
    """The engine reuses the KV blocks of prompt prefixes (the front then places requests by prefix)."""


class WorkerStartFailed(Struct, tag="worker_start_failed", **_WIRE):
    """The worker could not start (bad model path, bad device...)."""

    worker: int
    message: str


class Doorbell(Struct, tag="doorbell", **_WIRE):
    """Records are waiting in ring ``worker`` and the front was asleep."""

    worker: int


class WorkerHeartbeat(Struct, tag="worker_heartbeat", **_WIRE):
    """Periodic liveness signal with the worker's load."""

    worker: int
    running: int
    waiting: int
    steps: int
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    """KV-cache blocks no request holds (cached prefixes included: they are evicted on demand)."""
    preemptions: int = 0
    """Requests the engine preempted because KV-cache blocks ran out (since the worker started)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (since the worker started)."""
    prefix_cache_hits: int = 0
    """Prompt tokens found there."""


WorkerEvent = Union[WorkerReady, WorkerStartFailed, Doorbell, WorkerHeartbeat]


# --------------------------------------------------------------------------
# ring payloads


class Finish(Struct, **_WIRE):
    """Payload of a FINISH ring record: how request ``handle`` ended."""

    finish_reason: FinishReason
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class WorkerError(Struct, **_WIRE):
    """Payload of an ERROR ring record: the request failed inside the worker."""

    code: ErrorCode
    message: str


# --------------------------------------------------------------------------
# codecs, built once per direction

ENCODER = msgspec.msgpack.Encoder()
CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
SERVER_DECODER = msgspec.msgpack.Decoder(ServerMessage)
COMMAND_DECODER = msgspec.msgpack.Decoder(WorkerCommand)
EVENT_DECODER = msgspec.msgpack.Decoder(WorkerEvent)
FINISH_DECODER = msgspec.msgpack.Decoder(Finish)
WORKER_ERROR_DECODER = msgspec.msgpack.Decoder(WorkerError)

DecodeError = msgspec.DecodeError
"""Raised by every decoder for a malformed frame (``ValidationError`` is a subclass)."""

def encode(message: Struct) -> bytes:
    """Serialise one message to msgpack bytes."""
    return ENCODER.encode(message)


_CLIENT_FIELDS = {cls.__struct_config__.tag: cls.__struct_fields__ for cls in ClientMessage.__args__}
_PATH_INDEX = re.compile(r"`\$\[(\d+)\]")


def explain(error: msgspec.DecodeError, frame: bytes) -> str:
    """The decode error of a client frame, with array positions named by field (``$[4]`` -> ``max_tokens``)."""
    text = str(error)
    match = _PATH_INDEX.search(text)
    if match is None:
        return text
    try:
        field = _CLIENT_FIELDS[frame_head(frame)[0]][int(match.group(1)) - 1]
    except LookupError:
        return text
    return text[: match.start()] + f"`{field}" + text[match.end():]


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


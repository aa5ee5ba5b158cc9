"""The worker channel: what the front and its worker processes tell each other, and the ring's payloads.

The front sends :data:`WorkerCommand` (ZeroMQ PUSH), each worker sends
:data:`WorkerEvent` (PULL in the front); tokens go through the shared-memory
ring (:mod:`ringstream.ipc.ring`), whose FINISH and ERROR records carry a
msgpack-encoded :class:`Finish` or :class:`WorkerError`. A TOKEN record's
payload is its UTF-8 text, or, with the ``FLAG_LOGPROBS`` flag, a
:class:`TokenPayload`; a PROMPT_LOGPROBS record carries a slice of a
request's prompt logprobs (a msgpack list of :class:`TokenLogprob` or None,
its ``seq`` the prompt position of the first). Front and workers
are always one version (the front starts its workers), so these layouts may
change between versions; the encoding is :mod:`ringstream.ipc.protocol`'s,
which re-exports every name here.
"""

from __future__ import annotations

from typing import Union

import msgspec
from msgspec import Struct

from ringstream.ipc.wire import WIRE, ErrorCode, FinishReason, SamplingParams, TokenLogprob

# --------------------------------------------------------------------------
# front -> worker


class Assign(Struct, tag="assign", **WIRE):
    """Start generating request ``handle`` (unique within the daemon run).

    ``sampling`` is the request's ``Generate.sampling``, as the client sent it.
    ``output_token_ids`` are tokens the client has already received (resume
    after preemption or a worker restart); the worker continues at
    ``seq = len(output_token_ids)``.
    """

    handle: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = []
    priority: int = 0
    """The request's priority (lower is more urgent): the engine preempts the least urgent first
    when its KV-cache blocks run out."""


class Abort(Struct, tag="abort", **WIRE):
    """Stop ``handle`` now; the worker answers with a FINISH record (cancelled)."""

    handle: int


class RingSpace(Struct, tag="ring_space", **WIRE):
    """Doorbell: the front freed ring space while the worker waited for it."""


class Shutdown(Struct, tag="shutdown", **WIRE):
    """Finish nothing more; exit now."""


WorkerCommand = Union[Assign, Abort, RingSpace, Shutdown]


# --------------------------------------------------------------------------
# worker -> front


class WorkerCapacity(Struct, **WIRE):
    """What one worker can hold, fixed from its start to its exit: sent in its ``WorkerReady``, held whole by the
    front's scheduler."""

    max_num_seqs: int = 0
    """Sequences it runs at once (batch rows)."""
    max_model_len: int = 0
    """Most tokens (prompt + output) per request."""
    kv_cache_tokens: int = 0
    """Token positions its KV cache holds (a whole number of blocks)."""
    kv_cache_bytes: int = 0
    """Bytes allocated for its KV cache."""
    block_size: int = 1
    """Token positions per KV-cache block."""
    prefix_caching: bool = False
    """The engine reuses the KV blocks of prompt prefixes (the front then places requests by prefix)."""


class WorkerReady(Struct, tag="worker_ready", **WIRE):
    """The worker loaded its model and warmed up; its capacity."""

    worker: int
    pid: int
    device: str
    capacity: WorkerCapacity


class WorkerStarting(Struct, tag="worker_starting", **WIRE):
    """The worker entered a phase of its start (sent before each; ``WorkerReady`` ends the start)."""

    worker: int
    phase: str
    """One of :data:`WORKER_PHASES`' starting phases, e.g. ``loading weights``."""


WORKER_PHASES = ("starting", "importing torch", "loading weights", "sizing the KV cache", "warming up", "ready",
                 "failed", "exited")
"""What a worker is doing, as ``ringstream status`` shows it: ``starting`` from its spawn until its first
message, then each phase the worker reports (:class:`WorkerStarting`), ``ready`` from its ``WorkerReady``,
``failed`` after a ``WorkerStartFailed``, ``exited`` from its exit until its restart."""


class WorkerStartFailed(Struct, tag="worker_start_failed", **WIRE):
    """The worker could not start (bad model path, bad device...)."""

    worker: int
    message: str
    refused: bool = False
    """The engine refused the model (its start check): the daemon's start then exits 2, not 1."""


class Doorbell(Struct, tag="doorbell", **WIRE):
    """Records are waiting in ring ``worker`` and the front was asleep."""

    worker: int


class WorkerHeartbeat(Struct, tag="worker_heartbeat", **WIRE):
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


WorkerEvent = Union[WorkerReady, WorkerStarting, WorkerStartFailed, Doorbell, WorkerHeartbeat]


# --------------------------------------------------------------------------
# ring payloads


class Finish(Struct, **WIRE):
    """Payload of a FINISH ring record: how request ``handle`` ended."""

    finish_reason: FinishReason
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


FLAG_LOGPROBS = 1
"""TOKEN record flag: the payload is a :class:`TokenPayload` (text and logprobs), not plain text."""


class TokenPayload(Struct, **WIRE):
    """Payload of a TOKEN record with ``FLAG_LOGPROBS``: the token's text delta and its logprobs
    (:class:`ringstream.ipc.wire.TokenLogprob`'s fields, the token id being the record's)."""

    text: str
    logprob: float
    top: list[tuple[int, float]] = []


class WorkerError(Struct, **WIRE):
    """Payload of an ERROR ring record: the request failed inside the worker."""

    code: ErrorCode
    message: str


# --------------------------------------------------------------------------
# decoders, built once

COMMAND_DECODER = msgspec.msgpack.Decoder(WorkerCommand)
EVENT_DECODER = msgspec.msgpack.Decoder(WorkerEvent)
FINISH_DECODER = msgspec.msgpack.Decoder(Finish)
WORKER_ERROR_DECODER = msgspec.msgpack.Decoder(WorkerError)
TOKEN_PAYLOAD_DECODER = msgspec.msgpack.Decoder(TokenPayload)
PROMPT_LOGPROBS_DECODER = msgspec.msgpack.Decoder(list[TokenLogprob | None])

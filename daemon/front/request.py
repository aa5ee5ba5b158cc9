"""A request as the front tracks it, with its status in one ordered field; the daemon's own state.

Request statuses, in order (a request only moves forward, except that a
preempted request goes back to ``WAITING`` when its worker confirms)::

    WAITING --assign--> RUNNING --preempt--> PREEMPTING --confirmed--> WAITING
       |                   |                     |
       +------------------ +---- abort ----------+--> ABORTING --confirmed--> FINISHED_*
       +-- ends at once while waiting (cancel, timeout, queue full, shutdown) --> FINISHED_*

``FINISHED_*`` says how it ended; its terminal message (``final``) may still
wait to be delivered to a client that is not reading.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ringstream.ipc import protocol as P

__all__ = ["DaemonState", "Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Where a request stands; ordered, so ``status >= ABORTING`` means "ending or ended"."""

    WAITING = 0
    """Being tokenised, or in the scheduler's queue (first time, or back after a preemption or a worker's exit)."""
    RUNNING = 1
    """Assigned to a worker, streaming."""
    PREEMPTING = 2
    """Its worker was told to drop it for a more urgent request; back to WAITING when it confirms."""
    ABORTING = 3
    """Ending early (``abort_reason``); waits for its worker to confirm, if it has one."""
    FINISHED_STOPPED = 4
    """Ended by EOS, a stop string or a stop token."""
    FINISHED_LENGTH = 5
    """Ended at ``max_tokens`` or the context length."""
    FINISHED_ABORTED = 6
    """Ended early: cancelled, timed out, shut down, or an error during generation."""
    FINISHED_ERROR = 7
    """Refused or failed with an ``Error`` message (never admitted, queue full, worker failed...)."""

    @classmethod
    def of(cls, final: P.Chunk | P.Error) -> "RequestStatus":
        """The finished status a terminal message stands for."""
        if isinstance(final, P.Error):
            return cls.FINISHED_ERROR
        if final.finish_reason == P.FinishReason.STOP:
            return cls.FINISHED_STOPPED
        if final.finish_reason == P.FinishReason.LENGTH:
            return cls.FINISHED_LENGTH
        return cls.FINISHED_ABORTED

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class DaemonState(enum.StrEnum):
    """The front's lifecycle, advanced by events (workers ready, stop signal, the last stream ended, deadlines).

    ``STARTING -> SERVING -> DRAINING -> ABORTING -> FLUSHING -> STOPPED``; a
    start failure goes from ``STARTING`` to ``DRAINING`` at once. While
    draining, running streams finish and new requests get ``SHUTTING_DOWN``;
    at ``drain_timeout_s`` (or when none is left) the rest are aborted;
    flushing delivers the last terminal messages to clients that read slowly.
    """

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    ABORTING = "aborting"
    FLUSHING = "flushing"
    STOPPED = "stopped"

    @property
    def accepts_requests(self) -> bool:
        return self in (DaemonState.STARTING, DaemonState.SERVING)


@dataclass(eq=False, slots=True)
class Request:
    """A client request as the front tracks it (all times from ``time.monotonic``, seconds)."""

    client: bytes
    """Identity to answer; ``b""`` once that client is gone (nothing more is sent)."""
    id: str
    handle: int
    msg: P.Generate
    prompt_token_ids: list[int]
    arrival: float
    status: RequestStatus = RequestStatus.WAITING
    worker: int | None = None
    """The worker whose budget it is charged to (the scheduler's bookkeeping)."""
    last_worker: int | None = None
    """The worker it was last assigned to (where a PREEMPTING or ABORTING request awaits confirmation)."""
    abort_reason: P.FinishReason | None = None
    """Why it is ABORTING."""
    final: P.Chunk | P.Error | None = None
    """Its terminal message once FINISHED_*, until delivered."""
    dispatched: float = 0.0
    first_token: float = 0.0
    next_token_seq: int = 0
    chunk_seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[P.TokenLogprob] = field(default_factory=list)
    """Logprobs of ``pending_ids`` (a request with ``sampling.logprobs``)."""
    prompt_logprobs: list[P.TokenLogprob | None] | None = None
    """Its prompt logprobs as the worker sent them, until the first chunk carries them."""
    timers: list = field(default_factory=list)
    """Its deadline timers (``Ports.call_later`` handles), cancelled when it ends."""
    queue_timer: object | None = None
    started: float = 0.0
    served_on: int | None = None
    sched_token: int = 0
    kv_charge: int = 0
    prefix_hashes: list[bytes] | None = None
    worker_failures: int = 0
    last_token: float = 0.0
    queued_at: float = 0.0
    """When it last entered the queue (arrival, or back after a preemption or a worker's exit); 0 while not queued."""
    queue_time: float = 0.0
    """Seconds spent queued before its earlier dispatches (the whole wait, reported in ``Usage.queue_time_s``)."""

    @property
    def priority(self) -> int:
        return self.msg.priority

    @property
    def preemptible(self) -> bool:
        """Running and not being aborted (a preemption would resume what its client ended)."""
        return self.status == RequestStatus.RUNNING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.msg.sampling.max_tokens

    def usage(self, now: float) -> P.Usage:
        """Its ``Usage`` at ``now``: queue time counts every wait, also after a preemption."""
        return P.Usage(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=len(self.output_token_ids),
            queue_time_s=self.queue_time + (now - self.queued_at if self.queued_at else 0.0),
            ttft_s=(self.first_token - self.arrival) if self.first_token else 0.0, e2e_s=now - self.arrival,
        )

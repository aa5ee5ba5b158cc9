"""The engine interface, free of torch: request, parameter and output types, shared checks.

The worker drives any :class:`BaseEngine` (the paged Hugging Face engine of
:mod:`ringstream.daemon.engine.engine`, the synthetic one of :mod:`ringstream.daemon.engine.synthetic`) through
``add`` / ``abort`` / ``step``. Importing this module loads no torch, so the
synthetic engine starts without it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from ringstream.daemon.common.engine_config import ENGINE_DEFAULTS, EngineConfig
from ringstream.ipc.protocol import SamplingParams, TokenLogprob, WorkerCapacity, check_sampling

__all__ = [
    "ENGINE_DEFAULTS",
    "BaseEngine",
    "EngineConfig",
    "EngineStats",
    "CapacityError",
    "EngineError",
    "EngineRequest",
    "PromptTooLong",
    "RequestError",
    "SamplingParams",
    "TokenLogprob",
    "TokenOutput",
    "check_request",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Temperatures at or below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(slots=True)
class EngineRequest:
    """One generation request.

    Attributes:
        handle: caller-chosen id, unique among the engine's unfinished requests.
        prompt_token_ids: the prompt, already tokenized (BOS included if the
            model expects one).
        params: sampling and stop parameters (the wire's
            :class:`ringstream.ipc.protocol.SamplingParams`, as the client sent them).
        output_token_ids: tokens already generated. On ``add`` they are
            prefilled together with the prompt and generation continues with
            ``seq = len(output_token_ids)``; the detokenizer state is rebuilt so
            no text is repeated. The engine appends each new token to this list.
        priority: lower is more urgent (the front's scale); when KV blocks run
            out the engine preempts the least urgent, most recently started
            request first.
    """

    handle: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0


@dataclass(slots=True)
class TokenOutput:
    """One generated token of one request (one per running request per step).

    Attributes:
        handle: the request's handle.
        seq: 0-based index of this token in the request's output.
        token_id: the token.
        text: text delta, whole UTF-8 characters only (may be "").
        finish_reason: "stop" or "length" on the request's last token, else None.
        stop_reason: the stop string or ``stop_token_ids`` entry that ended the
            request; None for EOS and for "length" (vLLM's convention).
        num_prompt_tokens: prompt length, on the last output only.
        num_output_tokens: output length, on the last output only.
        logprobs: the token's logprobs, for a request with ``params.logprobs`` set, else None.
        prompt_logprobs: on the first output token of a request with
            ``params.prompt_logprobs`` set (and no resumed output): one entry per
            prompt token after the first; else None.
    """

    handle: int
    seq: int
    token_id: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestError:
    """A request the engine ended with an error (its step failed); no further output follows.

    Attributes:
        handle: the request's handle.
        message: what failed, for the client.
        invalid: the request cannot be served as asked (its output constraint does not compile, or its resumed
            output does not meet it): the client's ``INVALID_REQUEST``, not an internal failure.
    """

    handle: int
    message: str
    invalid: bool = False


class EngineError(Exception):
    """Base class of engine errors."""


class PromptTooLong(ValueError):
    """A request whose tokens can never fit the KV cache or ``max_model_len``."""


class CapacityError(EngineError):
    """The engine already holds ``max_num_seqs`` unfinished requests."""


def check_request(req: EngineRequest, max_model_len: int, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """Check what every engine requires of a request; return ``(stop_token_ids, user_stop_token_ids)``.

    ``stop_token_ids`` adds ``eos_token_ids`` to the request's own unless it
    ignores EOS. Raises ValueError for an empty prompt, a token id outside
    ``[0, vocab_size)``, ``params`` that :func:`ringstream.ipc.protocol.check_sampling`
    refuses (a limit of the wire, a stop token id outside the vocabulary), or
    ``output_token_ids`` (a resumed request) that already hold ``max_tokens``
    tokens or end with a stop token; :class:`PromptTooLong` (a ValueError) when
    ``len(prompt) + len(output) >= max_model_len``.
    """
    params = req.params
    prompt = req.prompt_token_ids
    output = req.output_token_ids
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    if len(prompt) + len(output) >= max_model_len:
        raise PromptTooLong(
            f"prompt ({len(prompt)}) + output ({len(output)}) tokens leave no room within max_model_len={max_model_len}"
        )
    if min(min(prompt), min(output, default=0)) < 0 or max(max(prompt), max(output, default=0)) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    check_sampling(params, vocab_size)
    if len(output) >= params.max_tokens:
        raise ValueError(f"output_token_ids already hold max_tokens={params.max_tokens} tokens")
    user_stop_ids = frozenset(params.stop_token_ids)
    stop_ids = user_stop_ids if params.ignore_eos else user_stop_ids | frozenset(eos_token_ids)
    if output and output[-1] in stop_ids:
        raise ValueError("output_token_ids already end with a stop token")
    return stop_ids, user_stop_ids


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One snapshot of an engine's load (requests, KV blocks) and its counters since start."""

    num_running: int
    """Requests running (admitted, holding KV-cache blocks)."""
    num_waiting: int
    """Requests queued for admission."""
    num_blocks: int
    """Usable KV-cache blocks."""
    num_free_blocks: int
    """KV-cache blocks no request holds (cached prefixes included: they are evicted on demand)."""
    num_preemptions: int = 0
    """Requests preempted because KV-cache blocks ran out (counter)."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (counter)."""
    prefix_hits: int = 0
    """Prompt tokens found there (counter)."""

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class BaseEngine(abc.ABC):
    """Interface of a generation backend driven by the worker loop.

    The worker calls ``add`` / ``abort`` between steps and ``step`` in a loop
    while ``has_unfinished()``; each ``step`` returns at most one
    ``TokenOutput`` (or one ``RequestError``) per running request.
    """

    max_num_seqs: int
    max_model_len: int
    block_size: int = 1
    """Token positions per KV-cache block."""
    enable_prefix_caching: bool = False
    """Whether the engine reuses the KV blocks of prompt prefixes it computed before."""

    @property
    @abc.abstractmethod
    def kv_cache_tokens(self) -> int:
        """Token positions the KV cache holds."""

    @property
    @abc.abstractmethod
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV cache."""

    def capacity(self) -> WorkerCapacity:
        """What this engine holds, fixed from its start: the worker's ``WorkerReady`` carries it."""
        return WorkerCapacity(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                              kv_cache_tokens=self.kv_cache_tokens, kv_cache_bytes=self.kv_cache_bytes,
                              block_size=self.block_size, prefix_caching=self.enable_prefix_caching)

    @abc.abstractmethod
    def stats(self) -> "EngineStats":
        """A snapshot of the engine's load and counters (cheap: the worker takes one per heartbeat)."""

    @abc.abstractmethod
    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at a following ``step``."""

    @abc.abstractmethod
    def abort(self, handle: int) -> bool:
        """Drop the request ``handle``; return True if it was unfinished."""

    @abc.abstractmethod
    def step(self) -> list[TokenOutput | RequestError]:
        """Run one engine step; return its outputs ([] when idle)."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Run a tiny request through every code path so the first real one is not slow."""

    def record_kv_events(self) -> None:
        """Start recording what enters and leaves the prefix cache (:meth:`take_kv_events`); call after
        :meth:`warmup`. An engine without a prefix cache records nothing."""

    def take_kv_events(self) -> list:
        """The prefix-cache changes since the last call, oldest first: the block manager's ``BlocksStored`` /
        ``BlocksRemoved`` / ``BlocksCleared`` (:mod:`ringstream.daemon.engine.block_manager`)."""
        return []



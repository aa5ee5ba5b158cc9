"""Synthetic engine: deterministic tokens at a fixed step time, no model compute.

``SyntheticEngine`` implements :class:`ringstream.daemon.engine.engine.BaseEngine` with the same
request semantics as :class:`ringstream.daemon.engine.engine.Engine` as the serving layer sees
them, but without a model: it exists to measure the serving layer (front,
scheduler, rings, sockets, client) on its own, as Triton Inference Server's
``identity`` model does for Triton. With it, any throughput or latency limit a
benchmark finds belongs to the serving layer, since the "model" costs a fixed,
known ``step_time_s`` per step.

What it shares with ``Engine``:

* continuous batching over ``max_num_seqs`` slots: waiting requests are
  admitted FIFO into free slots at each step (including slots freed by
  requests that finish in that step), and every running request yields
  exactly one ``TokenOutput`` per step, the one with a ``finish_reason``
  being its last;
* the finish rule, :func:`ringstream.daemon.common.finish.finish_after_token`
  (the same function as ``Engine``'s): EOS / ``stop_token_ids`` (the token is
  included and adds no text), then ``stop`` strings (the text ends right
  before the first one, which is never emitted, held back across tokens by
  the same :class:`ringstream.daemon.common.stops.StopScanner` as ``Engine``'s detokenizer), then length
  (``max_tokens`` or the context limit ``max_model_len``);
* ``abort``, resume via ``EngineRequest.output_token_ids`` (generation
  continues at ``seq = len(output_token_ids)``), and the same
  ``ValueError`` / ``CapacityError`` for bad or excess requests.

What it does differently: token ``seq`` of the request with handle ``h`` is
``(h * TOKEN_HANDLE_STRIDE + seq) % vocab_size`` whatever the sampling
parameters (they are validated, then ignored: penalties, ``min_p``,
temperature and filters change nothing; ``min_tokens`` keeps a stop token or
stop string from ending the request before it, as in ``Engine``, though the
stop token stays in the output), and its text delta is
``" t<seq>"`` (ASCII), so a client can check the order of a stream from its
text alone. ``step()`` sleeps (``time.sleep``) for what remains of
``step_time_s`` after its own bookkeeping, so a worker loop driving it is
paced like one driving a model whose forward takes ``step_time_s``.

Logprobs are fake and deterministic (:func:`synthetic_logprob`): a token has
logprob ``SYNTHETIC_LOGPROB`` and tops the list, the ``j``-th next entry
being token ``(token_id + j) % vocab_size`` at ``SYNTHETIC_LOGPROB - j``;
prompt token ``i >= 1`` gets the same with its own id.

The engine is not thread-safe: call all methods from one thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ringstream.daemon.common.finish import finish_after_token
from ringstream.daemon.common.stops import StopScanner
from ringstream.daemon.engine.interface import (
    EngineStats,
    BaseEngine,
    CapacityError,
    EngineError,
    EngineRequest,
    TokenLogprob,
    TokenOutput,
    check_request,
)

__all__ = ["SYNTHETIC_LOGPROB", "SyntheticEngine", "synthetic_logprob", "synthetic_text", "synthetic_token_id"]

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_STEP_TIME_S = 0.001
DEFAULT_VOCAB_SIZE = 4096
TOKEN_HANDLE_STRIDE = 31
"""Multiplier of the handle in the token formula; co-prime with typical vocabulary sizes."""
TEXT_PREFIX = " t"
"""Each token's text delta is this prefix followed by the token's ``seq`` in decimal."""


def synthetic_token_id(handle: int, seq: int, vocab_size: int) -> int:
    """Token id number ``seq`` (0-based) of request ``handle``: ``(handle * 31 + seq) % vocab_size``."""
    return (handle * TOKEN_HANDLE_STRIDE + seq) % vocab_size


SYNTHETIC_LOGPROB = -0.5
"""The fake logprob of every generated (and prompt) token."""


def synthetic_logprob(token_id: int, num_top: int, vocab_size: int) -> TokenLogprob:
    """The fake logprobs of ``token_id`` with ``num_top`` top entries (module docstring)."""
    top = [((token_id + j) % vocab_size, SYNTHETIC_LOGPROB - j) for j in range(num_top)]
    return TokenLogprob(token_id, SYNTHETIC_LOGPROB, top)


def synthetic_text(seq: int) -> str:
    """Text delta of output token number ``seq``: ``" t<seq>"``, e.g. ``" t0"``, ``" t1"``."""
    return f"{TEXT_PREFIX}{seq}"


class SyntheticText:
    """The synthetic output's text stream for the finish rule
    (:class:`ringstream.daemon.common.finish.TokenText`): output token ``seq``
    has the text :func:`synthetic_text` ``(seq)``, cut at stop strings by ``scanner``.

    Args:
        output_token_ids: the request's output so far (the list the engine
            appends to); the token fed is its last.
        scanner: the request's stop-string scanner, already fed the text of
            the output before the next token.
    """

    __slots__ = ("_output", "_scanner")

    def __init__(self, output_token_ids: list[int], scanner: StopScanner) -> None:
        self._output = output_token_ids
        self._scanner = scanner

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or None."""
        return self._scanner.stop_string

    def add_token(self, token_id: int, check_stops: bool = True) -> str:
        """Feed the last output token's text (its ``seq`` is ``len(output) - 1``); return the delta to send."""
        return self._scanner.add(synthetic_text(len(self._output) - 1), check_stops)

    def flush(self) -> str:
        """Release the held-back text."""
        return self._scanner.flush()


@dataclass(slots=True, eq=False)
class _Sequence:
    """Engine-side state of one unfinished request."""

    request: EngineRequest
    max_output_tokens: int
    stop_token_ids: frozenset[int]
    user_stop_token_ids: frozenset[int]
    text: SyntheticText


class SyntheticEngine(BaseEngine):
    """Model-free engine with ``Engine``'s serving semantics; see the module docstring.

    Args:
        max_num_seqs: slots = most requests running at once, and the most
            requests waiting + running.
        max_model_len: most tokens (prompt + output) per request.
        step_time_s: wall time of one step that has work, in seconds
            (``>= 0``); ``step()`` sleeps for whatever its bookkeeping left.
        vocab_size: token ids are in ``[0, vocab_size)``, for prompts and
            outputs alike.
        eos_token_ids: ids that end a request (unless ``ignore_eos``).

    Raises:
        ValueError: a size argument out of range.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        eos_token_ids: tuple[int, ...] | list[int] = (),
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if not step_time_s >= 0:
            raise ValueError(f"step_time_s must be >= 0 seconds, got {step_time_s}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_time_s = float(step_time_s)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}
        self._by_handle: dict[int, _Sequence] = {}

    @property
    def kv_cache_tokens(self) -> int:
        """Token capacity the scheduler may budget: ``max_num_seqs * max_model_len``."""
        return self.max_num_seqs * self.max_model_len

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache allocated: none."""
        return 0

    def stats(self) -> EngineStats:
        """Running and waiting requests; no KV cache to fill: every block of ``kv_cache_tokens`` stays free."""
        blocks = self.kv_cache_tokens // self.block_size
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting), num_blocks=blocks,
                           num_free_blocks=blocks)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._running or self._waiting)

    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at the next ``step`` with a free slot.

        Raises:
            ValueError: empty prompt, token id outside ``[0, vocab_size)``,
                ``len(prompt) + len(output) >= max_model_len``, invalid
                sampling parameters, a handle already in use, or
                ``output_token_ids`` that already finish the request.
            CapacityError: ``max_num_seqs`` requests are already waiting or running.
        """
        if req.handle in self._by_handle:
            raise ValueError(f"handle {req.handle} is already in use")
        if len(self._by_handle) >= self.max_num_seqs:
            raise CapacityError(f"engine is full: {self.max_num_seqs} unfinished requests")
        seq = self._make_sequence(req)
        self._by_handle[req.handle] = seq
        self._waiting.append(seq)

    def abort(self, handle: int) -> bool:
        """Drop request ``handle``, freeing its slot at once; True if it was unfinished.

        No further ``TokenOutput`` is produced for it.
        """
        seq = self._by_handle.pop(handle, None)
        if seq is None:
            return False
        if self._running.pop(handle, None) is None:
            self._waiting.remove(seq)
        return True

    def step(self) -> list[TokenOutput]:
        """Emit one token for each running request, then admit waiting ones (their first token too).

        Returns the step's outputs, one per request that produced a token;
        [] at once when idle. A step with work lasts at least ``step_time_s``.
        """
        if not self.has_unfinished():
            return []
        start = time.perf_counter()
        outputs: list[TokenOutput] = []
        for seq in list(self._running.values()):
            self._emit(seq, outputs)
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting.popleft()
            self._running[seq.request.handle] = seq
            self._emit(seq, outputs)
        remaining = self.step_time_s - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        return outputs

    def warmup(self) -> None:
        """Nothing to warm up; checks only that the engine is idle.

        Raises:
            EngineError: the engine is not idle.
        """
        if self.has_unfinished():
            raise EngineError("warmup needs an idle engine")

    def _make_sequence(self, req: EngineRequest) -> _Sequence:
        """Validate ``req`` as ``Engine`` does and build its state."""
        params = req.params
        prompt = req.prompt_token_ids
        output = req.output_token_ids
        stop_ids, user_stop_ids = check_request(req, self.max_model_len, self.vocab_size, self.eos_token_ids)
        if req.params.structured_outputs is not None:
            raise ValueError("structured_outputs: the synthetic engine has no model to constrain; serve a model")
        scanner = StopScanner(params.stop)
        for seq_no in range(len(output)):
            scanner.add(synthetic_text(seq_no), seq_no >= params.min_tokens)
        if scanner.stop_string is not None:
            raise ValueError("output_token_ids already contain a stop string")
        return _Sequence(
            request=req,
            max_output_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            stop_token_ids=stop_ids,
            user_stop_token_ids=user_stop_ids,
            text=SyntheticText(output, scanner),
        )

    def _emit(self, seq: _Sequence, outputs: list[TokenOutput]) -> None:
        """Produce ``seq``'s next token, apply the finish rule, append its ``TokenOutput``.

        The rule is ``Engine``'s (:func:`ringstream.daemon.common.finish.finish_after_token`):
        EOS / stop token, then stop string, then length.
        """
        req = seq.request
        output_ids = req.output_token_ids
        seq_no = len(output_ids)
        token_id = synthetic_token_id(req.handle, seq_no, self.vocab_size)
        output_ids.append(token_id)
        num_output = seq_no + 1
        params = req.params
        text, finish_reason, stop_reason = finish_after_token(
            seq.text, token_id, num_output, seq.stop_token_ids, seq.user_stop_token_ids, params.min_tokens,
            seq.max_output_tokens)
        out = TokenOutput(req.handle, seq_no, token_id, text)
        if params.logprobs is not None:
            out.logprobs = synthetic_logprob(token_id, params.logprobs, self.vocab_size)
        if params.prompt_logprobs is not None and seq_no == 0:
            out.prompt_logprobs = [synthetic_logprob(t, params.prompt_logprobs, self.vocab_size)
                                   for t in req.prompt_token_ids[1:]]
        outputs.append(out)
        if finish_reason is None:
            return
        out.finish_reason, out.stop_reason = finish_reason, stop_reason
        out.num_prompt_tokens, out.num_output_tokens = len(req.prompt_token_ids), num_output
        del self._running[req.handle]
        del self._by_handle[req.handle]

"""The prompt-chunk budget of a step by time: chunks sized so that a step that carries one lasts about a target.

A step's duration is modelled as ``fixed_s + row_s * rows + pair_s * pairs``: ``rows`` are every token the forward
computes (decode rows and prompt tokens alike: on CPU and GPU alike a step first reads every weight, ``fixed_s``,
then pays each row's share of the matmuls, ``row_s``), and ``pairs`` the (query, key) pairs of the prompt chunks'
attention (a chunk of ``n`` tokens from position ``s`` on attends ``n s + n (n + 1) / 2`` of them, so a late chunk
of a long prompt costs more per token than an early one). All three are fitted on the worker's own device:
started by :meth:`StepBudget.calibrate` (the engine times a decode step and two prompt chunks of one internal
request, the second over the first's context, at start), then refined after every step by
:meth:`StepBudget.observe` (moving averages: a decode-only step refines the fixed cost; a step with a chunk the
cost of a row or, where its attention is the larger part, of a pair; each with the others held).
:meth:`StepBudget.chunk_tokens` is then the prompt tokens that fill the target beside the step's decode rows, for
a chunk starting at a given position, within ``[min_chunk_tokens, max_num_batched_tokens - decodes]``; a step
without decode rows stalls no stream and takes the token budget whole (a burst of arrivals prefills in large
steps). Where the decode rows alone already take the target, a chunk may still cost as much as they do (the step
takes at most ``max(target, 2 x decode step)``), so prompts always advance and the weight reads never cost more
than the tokens they serve; and on CPU a chunk has at least ``CPU_MIN_CHUNK_TOKENS`` tokens, as on a slow host the
time fit alone leaves too few to keep the batch full of decoding streams.

Why: with a fixed token budget, a long prompt stalls every decoding stream for as long as its chunk takes, which
depends on the device by two orders of magnitude (2,048 tokens of an 82M-parameter model take seconds on two CPU
cores, milliseconds on a GPU), and on the chunk's place in its prompt (without the attention term, a 4,096-token
prompt's second chunk, 1,618 tokens, took 435 ms against a 100 ms target on two CPU cores). vLLM's chunked
prefill bounds tokens only; Sarathi-Serve (Agrawal et al., OSDI 2024) bounds the step by a latency target, as
here.
"""

from __future__ import annotations

import math

__all__ = ["ACCELERATOR_MAX_STEP_MS", "CPU_MAX_STEP_MS", "CPU_MIN_CHUNK_TOKENS", "CPU_PREFILL_BURST_RATIO",
           "MIN_CHUNK_TOKENS", "StepBudget", "chunk_pairs", "default_max_step_ms", "default_min_chunk_tokens",
           "default_prefill_burst_ratio"]

CPU_MAX_STEP_MS = 50.0
"""Default target of a step with a prompt chunk on CPU, milliseconds: a 4,096-token prompt's chunks then stall 16
decoding streams for 0.23-0.25 of its TTFT on two cores (``ringstream-bench kv``, (c) at the defaults; at 80 ms,
0.37 once the native prefill attention made that prompt's TTFT 481-570 -> 225-254 ms). It costs the
prefill-heavy side-by-side ~4% of its throughput against 80 ms."""
ACCELERATOR_MAX_STEP_MS = 50.0
"""Default target on an accelerator (CUDA), milliseconds."""
MIN_CHUNK_TOKENS = 16
"""Fewest prompt tokens a step may carry while prompts wait (an accelerator's default)."""
CPU_MIN_CHUNK_TOKENS = 64
"""Fewest prompt tokens a CPU step may carry while prompts wait. Where a decode step alone takes about the target
(a slow host: 27-40 ms at 16 streams on a 2-core AVX2 EPYC against the 50 ms target), the time fit leaves a chunk
of ~20 tokens: the linears then run at a fraction of the FMA peak (``bench_linears`` there: 113-148 GFLOPS at 16
rows, 148-157 at 64, 164-175 at 256), every step reads every weight again for them, and prompts advance so slowly
that the batch runs short of decoding streams (about 9 of 16). The float32 prefill-heavy closed loop on that host
(``bench_closed_loop --workloads prefill``): 161-173 tok/s at TTFT p50 1.2-5.6 s with 16, 218 at 0.62 s with 64,
219 at 0.45 s with 128; TPOT p50 52-83 ms with any of them. Where the target leaves more (the AVX-512 host's
~100-token chunks at 16 streams) the floor changes nothing."""
CPU_PREFILL_BURST_RATIO = 0.5
"""Default ``prefill_burst_ratio`` on CPU: a step takes the token budget whole when the prompts to compute are at
least half as many as the decoding streams (and at least two). On CPU a prompt token costs about as much as a
decode row (the linears are compute-bound from ~16 rows on), so a cohort of arrivals prefilled under the time
bound is spread over many steps, and each of its streams then carries the others' chunks between its tokens. The
float32 prefill-heavy closed loop on a 2-core AVX2 EPYC (``bench_closed_loop --threads 2 --workloads prefill
--setting prefill_burst_ratio=R``, alternating, two rounds): off 255.4 / 231.8 tok/s, TTFT p50 440 / 447 ms,
TPOT p50 56.4 / 58.9 ms; 0.5: 255.5 / 285.6 tok/s, 1,983 / 1,857 ms, 44.5 / 41.4 ms; 1.0: 231.9 / 226.9, 2,375 /
2,308 ms, 47.5 / 48.3 ms; 1.2 (TGI's ``waiting_served_ratio``): no burst at this cohort size, as off. A lone
prompt beside decoding streams is never a burst (:data:`ringstream.daemon.engine.scheduler.MIN_BURST_PROMPTS`):
it keeps its time-bounded chunks, though a second prompt the step can take makes the two a burst. Off on an
accelerator: not measured there."""
SMOOTHING = 0.2
"""Weight of the newest step in the moving estimates (they follow about the last five steps)."""
ROW_PAIRS = 512
"""Attention pairs that weigh at least one row when :meth:`StepBudget.observe` decides which cost a chunk's time
refits: a chunk whose tokens attend 512 positions on average or more refits the pairs' cost. Both costs scale with
the model's width and depth alike; a pair cost ~1/630 of a row on two CPU cores for the model of
``ringstream-bench kv`` (79 ns against 50 us)."""


def default_max_step_ms(device_type: str) -> float:
    """The target for a device type (``"cpu"``, ``"cuda"``, ...), milliseconds."""
    return CPU_MAX_STEP_MS if device_type == "cpu" else ACCELERATOR_MAX_STEP_MS


def default_prefill_burst_ratio(device_type: str) -> float:
    """The ``prefill_burst_ratio`` for a device type when the setting is unset (0: off)."""
    return CPU_PREFILL_BURST_RATIO if device_type == "cpu" else 0.0


def default_min_chunk_tokens(device_type: str) -> int:
    """The fewest prompt tokens a step carries while prompts wait, for a device type."""
    return CPU_MIN_CHUNK_TOKENS if device_type == "cpu" else MIN_CHUNK_TOKENS


class StepBudget:
    """How many prompt tokens the next step may carry.

    Args:
        max_step_ms: the target duration of a step with a prompt chunk, milliseconds (> 0).
        max_num_batched_tokens: the token budget of a step (decodes included): the upper bound.
        min_chunk_tokens: the fewest prompt tokens a step carries while prompts wait, whatever the target
            (:func:`default_min_chunk_tokens`), >= 1.

    Raises:
        ValueError: ``max_step_ms`` is not > 0 and finite, or ``min_chunk_tokens`` < 1.
    """

    def __init__(self, max_step_ms: float, max_num_batched_tokens: int,
                 min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> None:
        if not 0 < max_step_ms < math.inf:
            raise ValueError(f"max_step_ms = {max_step_ms}: must be > 0 and finite")
        if min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens = {min_chunk_tokens}: must be >= 1")
        self.target_s = max_step_ms / 1000
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_chunk_tokens = min_chunk_tokens
        self.fixed_s: float | None = None
        """What a step costs before its rows (the weight reads), seconds; None until calibrated."""
        self.row_s: float | None = None
        """What each row (decode or prompt token) adds, seconds; None until calibrated."""
        self.pair_s = 0.0
        """What each (query, key) pair of a prompt chunk's attention adds, seconds (0 until measured)."""

    def calibrate(self, decode_step_s: float, prompt_tokens: int, prompt_step_s: float,
                  second_chunk_s: float | None = None, second_start: int | None = None) -> None:
        """Start values: a one-row decode step took ``decode_step_s`` seconds, a step of the first ``prompt_tokens``
        (> 1) tokens of a prompt ``prompt_step_s``, and, where given, a step of ``prompt_tokens`` more from
        position ``second_start`` of it (default ``prompt_tokens``: the next ones; they attend all before them
        too) ``second_chunk_s``."""
        n = max(prompt_tokens, 1)
        first_pairs = chunk_pairs(0, n)
        if second_chunk_s is not None:  # as many rows as the first chunk, and more pairs
            extra = chunk_pairs(n if second_start is None else second_start, n) - first_pairs
            self.pair_s = max((second_chunk_s - prompt_step_s) / max(extra, 1), 0.0)
        self.row_s = max((prompt_step_s - self.pair_s * first_pairs - decode_step_s) / max(n - 1, 1), 1e-9)
        self.fixed_s = max(decode_step_s - self.row_s, 0.0)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, pairs: int = 0) -> None:
        """Refine the model with a step of ``decodes`` decode rows and ``prompt_tokens`` prompt tokens whose chunks
        attended ``pairs`` (query, key) pairs (:func:`chunk_pairs`) and that took ``seconds``: a decode-only step
        updates the fixed cost; a step with a chunk the cost of a row, or of a pair where the pairs are the larger
        part of the step's modelled cost, a pair counted as at least 1 / ``ROW_PAIRS`` of a row there (so that a
        pair cost measured as 0 at start, where timing noise hid it, is still refitted by deep chunks); each with
        the others held, so none is charged to another."""
        if self.fixed_s is None or self.row_s is None:
            return
        rows = decodes + prompt_tokens
        if prompt_tokens == 0:
            fixed = max(seconds - self.row_s * rows, 0.0)
            self.fixed_s += SMOOTHING * (fixed - self.fixed_s)
        elif pairs and max(self.pair_s, self.row_s / ROW_PAIRS) * pairs > self.row_s * rows:
            pair = max(seconds - self.fixed_s - self.row_s * rows, 0.0) / pairs
            self.pair_s += SMOOTHING * (pair - self.pair_s)
        elif rows:
            row = max(seconds - self.fixed_s - self.pair_s * pairs, 0.0) / rows
            self.row_s = max(self.row_s + SMOOTHING * (row - self.row_s), 1e-9)

    def observe_step(self, scheduled: dict, seconds: float) -> None:
        """:meth:`observe` a step from its schedule, ``{sequence: new tokens}`` (each sequence with ``token_ids``
        and ``num_computed`` as they were before the step): one new token that completes a sequence is a decode
        row, the others are prompt chunks, whose pairs are counted from where each starts."""
        decodes = pairs = 0
        for seq, n in scheduled.items():
            if len(seq.token_ids) - seq.num_computed == n == 1:
                decodes += 1
            else:
                pairs += chunk_pairs(seq.num_computed, n)
        self.observe(decodes, sum(scheduled.values()) - decodes, seconds, pairs)

    def describe(self) -> str:
        """The target and the fitted costs, in words (the worker logs it at start)."""
        if self.fixed_s is None or self.row_s is None:
            return f"{self.target_s * 1e3:.0f} ms a step with a prompt chunk (max_step_ms); not measured"
        return (f"{self.target_s * 1e3:.0f} ms a step with a prompt chunk (max_step_ms); measured "
                f"{self.fixed_s * 1e3:.2f} ms a step + {self.row_s * 1e3:.3f} ms a row + "
                f"{self.pair_s * 1e6:.3f} ms per 1,000 attention pairs")

    def chunk_tokens(self, decodes: int, start: int = 0) -> int:
        """Prompt tokens the next step may carry beside ``decodes`` decode rows, for a chunk whose first token is
        at position ``start`` of its prompt (>= 1)."""
        room = max(1, self.max_num_batched_tokens - decodes)
        if self.fixed_s is None or self.row_s is None or decodes == 0:
            return room  # no stream decodes: none stalls, the token budget alone bounds the step
        decode_step_s = self.fixed_s + self.row_s * decodes
        # the chunk's share: what the target leaves, or as much as the decode rows' own step
        share_s = max(self.target_s - decode_step_s, decode_step_s)
        # the largest n with row_s n + pair_s (n start + n (n + 1) / 2) <= share_s
        a = self.pair_s / 2
        b = self.row_s + self.pair_s * (start + 0.5)
        n = share_s / b if a == 0 else (math.sqrt(b * b + 4 * a * share_s) - b) / (2 * a)
        return max(min(self.min_chunk_tokens, room), int(min(room, n)))


def chunk_pairs(start: int, tokens: int) -> int:
    """The (query, key) pairs a causal chunk of ``tokens`` tokens from position ``start`` on attends:
    ``tokens * start + tokens * (tokens + 1) / 2``."""
    return tokens * start + tokens * (tokens + 1) // 2

"""The prompt-chunk budget of a step by time: chunks sized so that a step that carries one lasts about a target.

A step's duration is modelled as ``fixed_s + row_s * rows``, ``rows`` being every token the forward computes
(decode rows and prompt tokens alike: on CPU and GPU alike a step first reads every weight, ``fixed_s``, then
pays each row's share of the matmuls and attention, ``row_s``). Both are fitted on the worker's own device:
started by :meth:`StepBudget.calibrate` (the engine times a one-row decode step and a prompt step at start), then
refined after every step by :meth:`StepBudget.observe` (moving averages: a decode-only step refines the fixed
cost, a step with a chunk the cost of a row, each with the other held).
:meth:`StepBudget.chunk_tokens` is then the prompt tokens that fill the target beside the step's decode rows,
within ``[MIN_CHUNK_TOKENS, max_num_batched_tokens - decodes]``; a step without decode rows stalls no stream
and takes the token budget whole (a burst of arrivals prefills in large steps). Where the decode rows alone
already take the target, a chunk may still cost as much as they do (the step takes at most ``max(target, 2 x decode step)``), so
prompts always advance and the weight reads never cost more than the tokens they serve.

Why: with a fixed token budget, a long prompt stalls every decoding stream for as long as its chunk takes, which
depends on the device by two orders of magnitude (2,048 tokens of an 82M-parameter model take seconds on two CPU
cores, milliseconds on a GPU). vLLM's chunked prefill bounds tokens only; Sarathi-Serve (Agrawal et al., OSDI
2024) bounds the step by a latency target, as here.
"""

from __future__ import annotations

__all__ = ["ACCELERATOR_MAX_STEP_MS", "CPU_MAX_STEP_MS", "MIN_CHUNK_TOKENS", "StepBudget", "default_max_step_ms"]

CPU_MAX_STEP_MS = 250.0
"""Default target of a step with a prompt chunk on CPU, milliseconds."""
ACCELERATOR_MAX_STEP_MS = 50.0
"""Default target on an accelerator (CUDA), milliseconds."""
MIN_CHUNK_TOKENS = 16
"""Fewest prompt tokens a step may carry while prompts wait."""
SMOOTHING = 0.2
"""Weight of the newest step in the moving estimates (they follow about the last five steps)."""


def default_max_step_ms(device_type: str) -> float:
    """The target for a device type (``"cpu"``, ``"cuda"``, ...), milliseconds."""
    return CPU_MAX_STEP_MS if device_type == "cpu" else ACCELERATOR_MAX_STEP_MS


class StepBudget:
    """How many prompt tokens the next step may carry.

    Args:
        max_step_ms: the target duration of a step with a prompt chunk, milliseconds (> 0).
        max_num_batched_tokens: the token budget of a step (decodes included): the upper bound.

    Raises:
        ValueError: ``max_step_ms`` is not > 0.
    """

    def __init__(self, max_step_ms: float, max_num_batched_tokens: int) -> None:
        if not max_step_ms > 0:
            raise ValueError(f"max_step_ms = {max_step_ms}: must be > 0")
        self.target_s = max_step_ms / 1000
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fixed_s: float | None = None
        """What a step costs before its rows (the weight reads), seconds; None until calibrated."""
        self.row_s: float | None = None
        """What each row (decode or prompt token) adds, seconds; None until calibrated."""

    def calibrate(self, decode_step_s: float, prompt_tokens: int, prompt_step_s: float) -> None:
        """Start values: a one-row decode step took ``decode_step_s`` seconds, a step of ``prompt_tokens`` (> 1)
        prompt tokens ``prompt_step_s``."""
        self.row_s = max((prompt_step_s - decode_step_s) / max(prompt_tokens - 1, 1), 1e-9)
        self.fixed_s = max(decode_step_s - self.row_s, 0.0)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """Refine the model with a step of ``decodes`` decode rows and ``prompt_tokens`` prompt tokens that took
        ``seconds``: a decode-only step updates the fixed cost, a step with a chunk the cost of a row (each with
        the other held, so neither is charged to the other)."""
        if self.fixed_s is None or self.row_s is None:
            return
        rows = decodes + prompt_tokens
        if prompt_tokens == 0:
            fixed = max(seconds - self.row_s * rows, 0.0)
            self.fixed_s += SMOOTHING * (fixed - self.fixed_s)
        elif rows:
            row = max(seconds - self.fixed_s, 0.0) / rows
            self.row_s = max(self.row_s + SMOOTHING * (row - self.row_s), 1e-9)

    def chunk_tokens(self, decodes: int) -> int:
        """Prompt tokens the next step may carry beside ``decodes`` decode rows (>= 1)."""
        room = max(1, self.max_num_batched_tokens - decodes)
        if self.fixed_s is None or self.row_s is None or decodes == 0:
            return room  # no stream decodes: none stalls, the token budget alone bounds the step
        fixed_s, row_s = self.fixed_s, self.row_s
        rows = max((self.target_s - fixed_s) / row_s, fixed_s / row_s + 2 * decodes)  # the target, or 2 x decodes
        return max(min(MIN_CHUNK_TOKENS, room), min(room, int(rows) - decodes))

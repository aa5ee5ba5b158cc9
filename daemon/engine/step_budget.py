"""The prompt-chunk budget of a step by time: chunks sized so that a step that carries one lasts about a target.

A step's cost is modelled as ``base + token_s * prompt_tokens``: ``base`` is what a decode-only step of the running
batch costs (reading every weight once, the decode rows' attention), ``token_s`` what each prompt token adds (its
share of the matmuls, its attention over the context so far). Both are measured on the worker's own device: at
start by :meth:`StepBudget.calibrate` (the engine times a decode step and a prompt forward), then refined after
every step by :meth:`StepBudget.observe` (exponential moving averages, so a longer context's dearer tokens are
followed). :meth:`StepBudget.chunk_tokens` is then ``(target - base) / token_s``, within ``[MIN_CHUNK_TOKENS,
max_num_batched_tokens - decodes]``: the token setting stays the upper bound, and a target below ``base`` still
lets prompts advance: a chunk may always cost as much as ``base`` (so a step with a chunk takes at most
``max(target, 2 * base)``, and the weight reads never cost more than the prompt tokens they serve).

Why: with a fixed token budget, a long prompt stalls every decoding stream for as long as its chunk takes, which
depends on the device by two orders of magnitude (2,048 tokens of an 82M-parameter model take ~3 s on two CPU
cores, ~10 ms on a GPU). vLLM's chunked prefill bounds tokens only; Sarathi-Serve (Agrawal et al., OSDI 2024)
bounds the step by a latency target, as here.
"""

from __future__ import annotations

__all__ = ["CPU_MAX_STEP_MS", "ACCELERATOR_MAX_STEP_MS", "MIN_CHUNK_TOKENS", "StepBudget", "default_max_step_ms"]

CPU_MAX_STEP_MS = 100.0
"""Default target of a step with a prompt chunk on CPU, milliseconds."""
ACCELERATOR_MAX_STEP_MS = 50.0
"""Default target on an accelerator (CUDA), milliseconds."""
MIN_CHUNK_TOKENS = 16
"""Fewest prompt tokens a step may carry while prompts wait (so they advance even past the target)."""
SMOOTHING = 0.25
"""Weight of the newest observation in the moving averages."""


def default_max_step_ms(device_type: str) -> float:
    """The target for a device type (``"cpu"``, ``"cuda"``, ...), milliseconds."""
    return CPU_MAX_STEP_MS if device_type == "cpu" else ACCELERATOR_MAX_STEP_MS


class StepBudget:
    """How many prompt tokens the next step may carry.

    Args:
        max_step_ms: the target duration of a step with a prompt chunk, milliseconds (> 0).
        max_num_batched_tokens: the token budget of a step (decodes included): the upper bound.
    """

    def __init__(self, max_step_ms: float, max_num_batched_tokens: int) -> None:
        if not max_step_ms > 0:
            raise ValueError(f"max_step_ms = {max_step_ms}: must be > 0")
        self.target_s = max_step_ms / 1000
        self.max_num_batched_tokens = max_num_batched_tokens
        self.base_s: float | None = None
        """Cost of a decode-only step, seconds (None until measured)."""
        self.token_s: float | None = None
        """Cost each prompt token adds to a step, seconds (None until measured)."""

    def calibrate(self, decode_step_s: float, prompt_tokens: int, prompt_step_s: float) -> None:
        """Start values: a decode-only step took ``decode_step_s``; a step of ``prompt_tokens`` prompt tokens (and
        no decodes) took ``prompt_step_s``."""
        self.base_s = max(decode_step_s, 0.0)
        self.token_s = max(prompt_step_s - self.base_s, 1e-9) / max(prompt_tokens, 1)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """Refine the model with a step that ran ``decodes`` decode rows and ``prompt_tokens`` prompt tokens in
        ``seconds``."""
        if prompt_tokens == 0:
            if decodes:
                self.base_s = seconds if self.base_s is None else self.base_s + SMOOTHING * (seconds - self.base_s)
            return
        base = self.base_s if self.base_s is not None and decodes else 0.0
        token_s = max(seconds - base, 0.0) / prompt_tokens
        self.token_s = token_s if self.token_s is None else self.token_s + SMOOTHING * (token_s - self.token_s)

    def chunk_tokens(self, decodes: int) -> int:
        """Prompt tokens the next step may carry beside ``decodes`` decode rows (>= 1)."""
        room = max(1, self.max_num_batched_tokens - decodes)
        if self.token_s is None:
            return room
        base = self.base_s or 0.0
        spare = max(self.target_s - base, base)
        tokens = int(spare / self.token_s) if self.token_s > 0 else room
        return max(min(MIN_CHUNK_TOKENS, room), min(room, tokens))

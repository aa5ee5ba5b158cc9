"""One worker's engine settings, declared once: built from the daemon's Config by the front, carried whole in the
worker spec, taken whole by the engine (nano-vllm's ``Config``, vLLM's ``VllmConfig``). No torch.

It lives here rather than in the engine package because the front builds it and the front never imports the
engine; :mod:`ringstream.daemon.engine.interface` re-exports it as the engine's interface type.

Adding an engine setting is a two-place edit: a field here (with its default and check) and the same-named field
of :class:`ringstream.daemon.common.config.Config` (with its user-facing docstring), whose default is read from
:data:`ENGINE_DEFAULTS`.
"""

from __future__ import annotations

import math

from typing import Literal

import msgspec

__all__ = ["ENGINE_DEFAULTS", "EngineConfig", "MAX_BLOCK_SIZE"]

MAX_BLOCK_SIZE = 1024
"""Largest ``block_size``, tokens."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The settings of one worker's engine. :meth:`check` raises ValueError naming the bad value."""

    backend: Literal["hf", "synthetic"] = "hf"
    """``hf``: paged continuous batching over a transformers model; ``synthetic``: tokens at a fixed step time."""
    device: str = "cpu"
    """torch device string of the worker: ``cpu``, ``cuda:0``, ..."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights and activations dtype (resolved: never ``auto`` here)."""
    threads: int = 0
    """torch intra-op threads of a CPU worker; 0 = leave torch's default."""
    max_num_seqs: int = 64
    """Most sequences running at once (batch rows)."""
    max_model_len: int | None = None
    """Most tokens (prompt + output) per sequence; None = the model's context."""
    max_num_batched_tokens: int = 2048
    """Most new tokens one step computes (decodes first, then prompt chunks)."""
    max_step_ms: float | None = None
    """Target duration of a step that carries a prompt chunk, milliseconds: chunks are sized from the measured
    cost of a prompt token on the worker's device (:mod:`ringstream.daemon.engine.step_budget`), within
    ``max_num_batched_tokens``. None: the device's default (50 ms on CPU and on an accelerator); 0: the token
    budget alone."""
    prefill_burst_ratio: float | None = None
    """When the requests with prompts still to compute (that the batch can take) number at least this many times
    the decoding ones, and at least two, a step's prompt tokens are bounded by ``max_num_batched_tokens`` alone,
    not by ``max_step_ms``: a burst of arrivals is prefilled in a few large steps and its streams then decode
    together, with no prompt chunks between their tokens (a lower TPOT), at the cost of their first tokens (TTFT)
    and of long steps for the streams already decoding. None: the device's default (0.5 on CPU, off on an
    accelerator: :func:`ringstream.daemon.engine.step_budget.default_prefill_burst_ratio`); 0: off, every step
    with a prompt chunk is bounded by ``max_step_ms``."""
    block_size: int = 16
    """Token positions per KV-cache block."""
    num_blocks: int | None = None
    """KV-cache blocks (the null block included); None = from ``kv_cache_bytes`` or ``memory_utilization``."""
    kv_cache_bytes: int | None = None
    """KV pool size in bytes; None = from ``memory_utilization``."""
    memory_utilization: float = 0.85
    """Fraction of the memory left after the weights and a profiling forward that the KV pool may take."""
    enable_prefix_caching: bool = True
    """Share and keep KV blocks by their prefix key (chained block hashes, LRU eviction)."""
    native_kernels: bool = True
    """On CPU: decode attention (and, on AVX-512 hosts, prompt-chunk attention) by the native kernels that read
    the paged KV pool in place (built on the first
    start with the host's C++ compiler and cached; without one the pure-torch path serves it), float32 and
    bfloat16 linear layers by the native GEMM over packed weights (q/k/v and gate/up fused; oneDNN's packed
    matmul without the kernels), RMSNorm and SiLU-and-mul fused for Llama-exact modules. False: plain PyTorch
    everywhere (the reference path)."""
    seed: int = 0
    """Seed of the sampling generator for requests that give none."""
    synthetic_step_s: float = 0.001
    """Step time of the synthetic backend, seconds."""

    def check(self) -> "EngineConfig":
        """Validate every field; returns self. Raises ValueError naming the bad value."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens = {self.max_num_batched_tokens}: must be >= max_num_seqs "
                             f"({self.max_num_seqs}), each running request needs its token every step")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size = {self.block_size}: must be in [1, {MAX_BLOCK_SIZE}] tokens")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len = {self.max_model_len}: must be >= 2 tokens (or unset)")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization = {self.memory_utilization}: must be in (0, 1]")
        if self.max_step_ms is not None and not 0 <= self.max_step_ms < math.inf:
            raise ValueError(f"max_step_ms = {self.max_step_ms}: must be >= 0 milliseconds (0: off) and finite, "
                             "or unset")
        if self.prefill_burst_ratio is not None and not 0 <= self.prefill_burst_ratio < math.inf:
            raise ValueError(f"prefill_burst_ratio = {self.prefill_burst_ratio}: must be >= 0 and finite (0: off), "
                             "or unset")
        if self.threads < 0:
            raise ValueError(f"threads = {self.threads}: must be >= 0")
        if not self.synthetic_step_s >= 0:
            raise ValueError(f"synthetic_step_s = {self.synthetic_step_s}: must be >= 0 seconds")
        return self

    @classmethod
    def from_settings(cls, settings: object, **resolved) -> "EngineConfig":
        """The engine config of a daemon config: every field of this struct that ``settings`` has, by name, with
        ``resolved`` (the per-worker values: ``device``, ``dtype``, ``threads``, ...) taking precedence."""
        values = {name: getattr(settings, name) for name in cls.__struct_fields__ if hasattr(settings, name)}
        return cls(**(values | resolved))


ENGINE_DEFAULTS = EngineConfig()
"""The defaults, read by the daemon's Config for its engine fields."""

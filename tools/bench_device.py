"""What ``ringstream-bench compare`` measures about the device itself: the memory roofline and the KV capacity.

* **Roofline** of a decode step: a step of ``B`` rows reads every weight once
  (the input embedding only for its ``B`` rows, so an untied input embedding
  is not counted) and each row's keys and values once. At the device's copy
  bandwidth (:func:`copy_bandwidth`: ``dst.copy_(src)`` of a large buffer,
  bytes read plus bytes written over the time) no decode can be faster than
  ``bytes / bandwidth``, so ``B * bandwidth / bytes`` tokens/s is the most any
  system of the comparison can reach at that batch and context (the context
  taken is the workload's mean during decode: prompt plus half the new tokens).
* **Capacity**: how many sequences of a given length the engine's KV pool holds
  at once, from its block count (each sequence takes whole blocks).
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["capacity", "copy_bandwidth", "decode_step_bytes", "kv_bytes_per_token", "roofline", "synchronize"]

COPY_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}
"""Buffer size of the bandwidth measurement by device type (large enough to leave every cache)."""
COPY_REPEATS = 5


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = COPY_REPEATS) -> float:
    """Device memory bandwidth in bytes/s: best of ``repeats`` ``dst.copy_(src)``, ``2 * nbytes`` moved each."""
    device = torch.device(device)
    nbytes = nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token position takes across all layers."""
    from ringstream.daemon.engine.families import kv_shape

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_heads, head_dim, value_dim = kv_shape(config)
    itemsize = next(model.parameters()).element_size()
    return config.num_hidden_layers * kv_heads * (head_dim + (value_dim or head_dim)) * itemsize


def decode_step_bytes(model, batch: int, context: float) -> dict:
    """Bytes one decode step of ``batch`` rows at mean ``context`` positions reads: weights and KV."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight.data_ptr() != embedding.data_ptr():
        weights -= embedding.numel() * embedding.element_size()
    kv = int(batch * context * kv_bytes_per_token(model))
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv}


def roofline(model, batch: int, prompt_len: int, max_tokens: int, device: torch.device | str,
             bandwidth: float | None = None) -> dict:
    """The decode roofline of the workload (module docstring): tokens/s and the figures it comes from."""
    bandwidth = bandwidth or copy_bandwidth(device)
    context = prompt_len + max_tokens / 2
    figures = decode_step_bytes(model, batch, context)
    step_s = figures["bytes"] / bandwidth
    return figures | {"tok_s": batch / step_s, "step_ms": step_s * 1e3, "bandwidth_gb_s": bandwidth / 1e9,
                      "batch": batch, "mean_context": context}


def capacity(engine, sequence_tokens: int) -> dict:
    """The engine's KV pool and how many sequences of ``sequence_tokens`` positions it holds at once."""
    per_sequence = -(-sequence_tokens // engine.block_size)
    return {
        "kv_cache_bytes": engine.kv_cache_bytes, "kv_cache_tokens": engine.kv_cache_tokens,
        "block_size": engine.block_size, "max_model_len": engine.max_model_len,
        "sequence_tokens": sequence_tokens, "sequences": engine.stats().num_blocks // per_sequence,
    }

"""How many bytes a worker's KV pool may take: memory left after the weights and a profiling forward.

vLLM sizes its KV cache the same way (``gpu_worker.determine_available_memory``):
load the weights, run one forward at the largest batch the engine will run,
measure its peak activation memory, and give the KV cache a fraction of what
is left. On CUDA the figures come from ``torch.cuda.mem_get_info`` and the
allocator's peak statistics; on CPU from ``psutil`` (available RAM, and the
process's resident-set growth over the forward as its activation peak).
"""

from __future__ import annotations

import psutil
import torch

from ringstream.daemon.common.model_dir import ModelRefused

__all__ = ["kv_cache_budget", "pool_blocks"]


def kv_cache_budget(model, device: torch.device, num_tokens: int, memory_utilization: float) -> int:
    """Bytes the KV pool may take: ``memory_utilization * available - activation peak``, at least 0.

    Args:
        model: the loaded model (weights already on ``device``); its attention
            is set to SDPA for the profiling forward.
        device: the model's device.
        num_tokens: tokens of the profiling forward (the step budget, ``max_num_batched_tokens``).
        memory_utilization: fraction in (0, 1] of the memory available after the weights.

    Returns:
        Bytes (int).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_tokens = min(num_tokens, config.max_position_embeddings)
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        try:
            model.set_attn_implementation("sdpa")
        except ValueError:
            model.set_attn_implementation("eager")  # refuses SDPA (e.g. softcapping): profile its eager attention
    input_ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
        available = torch.cuda.mem_get_info(device)[0]
    else:
        process = psutil.Process()
        available = psutil.virtual_memory().available
        before = process.memory_info().rss
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        peak = max(0, process.memory_info().rss - before)
    return max(0, int(available * memory_utilization) - peak)


def pool_blocks(model, config, max_model_len: int, device: torch.device, block_bytes: int) -> int:
    """Blocks of the KV pool (the null block included): the engine config's ``num_blocks``, else
    ``kv_cache_bytes // block_bytes``, else what :func:`kv_cache_budget` leaves, at most ``max_num_seqs``
    sequences of ``max_model_len`` tokens (more would only feed the prefix cache).

    Raises:
        ModelRefused: the pool sized by ``num_blocks`` or ``kv_cache_bytes`` cannot hold one sequence of
            ``max_model_len`` tokens (naming the largest that fits and the bytes one would need): the settings
            are at odds with the model, exit 2.
        ValueError: the same for a pool sized from the free memory (exit 1: memory may be freed).
    """
    block_size = config.block_size
    num_blocks = config.num_blocks
    sized_by_settings = num_blocks is not None or config.kv_cache_bytes is not None
    if num_blocks is None and config.kv_cache_bytes is not None:
        num_blocks = config.kv_cache_bytes // block_bytes
    elif num_blocks is None:
        budget = kv_cache_budget(model, device, config.max_num_batched_tokens, config.memory_utilization)
        most = -(-config.max_num_seqs * max_model_len // block_size) + 1
        num_blocks = min(most, budget // block_bytes)
    largest = max(num_blocks - 1, 0) * block_size
    if largest < max_model_len:
        needed = (-(-max_model_len // block_size) + 1) * block_bytes
        raise (ModelRefused if sized_by_settings else ValueError)(
            f"the KV cache ({max(num_blocks - 1, 0)} usable blocks of {block_size} tokens, {block_bytes} bytes "
            f"each, plus the null block) cannot hold one sequence of max_model_len={max_model_len} tokens; the "
            f"largest that fits is {largest}: lower max_model_len, or give the KV cache at least {needed} bytes "
            f"(kv_cache_bytes, or more memory_utilization)"
        )
    return num_blocks

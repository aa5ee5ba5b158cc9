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

__all__ = ["kv_cache_budget"]


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

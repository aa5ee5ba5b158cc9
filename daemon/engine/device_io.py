"""Host <-> device copies of an engine step, without stalls on an accelerator.

On CUDA a plain ``torch.tensor(data, device=...)`` or ``tensor.tolist()`` is a
synchronous copy from or into pageable memory: the host waits for every
kernel queued before it. A step's inputs go up through pinned memory with
``non_blocking=True`` (:func:`to_device`), and its results (sampled ids, and
logprobs when asked) come down in one copy into pinned memory followed by one
event wait (:func:`to_host`): one device-to-host transfer per step. On CPU both are
the plain calls they replace.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host"]

_PACKED = torch.float64
"""Dtype several results travel in together: exact for int64 token ids below 2**53 and for float32 values."""


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``; on CUDA through pinned memory, asynchronously."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> list[list]:
    """``[t.tolist() for t in tensors]``; on CUDA one copy into pinned memory and one wait.

    Several tensors are packed into one float64 buffer on the device and
    unpacked to their own dtypes on the host (token ids and indices must be
    below 2**53, values float32 or narrower, as every engine result is).
    """
    if not tensors:
        return []
    device = tensors[0].device
    if device.type != "cuda":
        return [t.tolist() for t in tensors]
    if len(tensors) == 1:
        source = tensors[0]
    else:
        source = torch.cat([t.reshape(-1).to(_PACKED) for t in tensors])
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    host.copy_(source, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()  # an event wait: not one of the implicit syncs torch.cuda.set_sync_debug_mode reports
    if len(tensors) == 1:
        return [host.tolist()]
    out, at = [], 0
    for t in tensors:
        part = host[at:at + t.numel()].view(t.shape)
        out.append(part.to(t.dtype).tolist())
        at += t.numel()
    return out

"""The engine's decode attention: one query token per row, as two batched matmuls.

PyTorch's CPU ``scaled_dot_product_attention`` runs a flash-attention kernel
built for long queries; with one query token per row (decode) and bfloat16 it
spends most of its time on per-block set-up and conversions. Measured on a
2-core AMD EPYC (torch 2.13, built-in model, 64 rows, 65 keys, 4 layers, one
thread): a whole bfloat16 decode step takes 12.1 ms with SDPA and 8.4 ms with
this function (``python -m tools.bench_engine --dtype bfloat16`` shows the
effect on the engine). In float32 both take the same time, so float32 models
keep SDPA, whose output ``generate()`` reproduces token for token.

Prefill (more than one query token) always goes to SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

DECODE_ATTENTION = "ringstream_decode"
"""Name under which :func:`decode_attention` is registered with transformers' ``AttentionInterface``."""


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' attention-function protocol (``ALL_ATTENTION_FUNCTIONS``).

    Args:
        query: ``[b, heads, q, head_dim]``.
        key, value: ``[b, kv_heads, T, head_dim]`` (grouped-query attention when
            ``kv_heads < heads``; query head ``i`` reads kv head ``i // (heads / kv_heads)``,
            as ``repeat_kv`` does).
        attention_mask: additive, broadcastable to ``[b, 1, q, T]``, or None.
        scaling: score scale (default ``head_dim ** -0.5``).

    Returns:
        ``([b, q, heads, head_dim], None)``. Scores and softmax are computed in
        float32, as transformers' eager attention does, whatever the input dtype.
    """
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    if scaling is None:
        scaling = head_dim ** -0.5
    q = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [b, kv_heads, group, T]
    scores.mul_(scaling)
    if attention_mask is not None:
        scores.add_(attention_mask[..., -1:, :])  # [b|1, 1, 1, T]: the mask row of the one query
    probs = scores.softmax(dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv_heads, group, head_dim]
    return out.reshape(batch, 1, heads, head_dim), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)


def use_decode_attention(model) -> bool:
    """Switch ``model`` to :func:`decode_attention` unless it runs in float32; True if switched.

    Only models whose attention layers look up ``config._attn_implementation``
    at each call (transformers' own architectures) are switched; a model
    that does not support switching keeps its attention.
    """
    if next(model.parameters()).dtype == torch.float32:
        return False
    try:
        model.set_attn_implementation(DECODE_ATTENTION)
    except (ValueError, AttributeError, NotImplementedError):
        return False
    return True

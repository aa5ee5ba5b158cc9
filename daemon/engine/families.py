"""What the engine can serve exactly, read from a model's config. No torch.

The engine calls :func:`unsupported_feature` at start and refuses a model
with the feature named rather than serve tokens that differ from
``generate()``; :func:`sliding_window` tells which window the layers must
pass to the attention (a model that applies it elsewhere is refused by the
engine's start check).
"""

from __future__ import annotations

__all__ = ["configured_window", "kv_shape", "sliding_window", "unsupported_feature"]

FULL_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def kv_shape(config) -> tuple[int, int, int]:
    """``(kv_heads, key_head_dim, value_head_dim)`` of the keys and values a layer stores."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim, head_dim


def sliding_window(config, max_model_len: int) -> int | None:
    """The sliding window the config's layers use, if some sequence can outgrow it; else None.

    A config with ``layer_types`` uses it only if some layer is ``sliding_attention`` (configs that carry a
    ``sliding_window`` beside all-full layers never window); one without uses it unless
    ``use_sliding_window`` is false.
    """
    window = configured_window(config, max_model_len)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        uses_window = "sliding_attention" in layer_types
    else:
        uses_window = getattr(config, "use_sliding_window", True)
    return window if uses_window else None


def configured_window(config, max_model_len: int) -> int | None:
    """Any ``sliding_window`` the config carries below ``max_model_len``, used or not (the start check's
    prompt is made longer than it, so that a model whose mask and attention disagree on it is caught)."""
    window = getattr(config, "sliding_window", None)
    usable = isinstance(window, int) and not isinstance(window, bool) and window >= 1  # 0: no window
    return window if usable and window < max_model_len else None


def unsupported_feature(config, max_model_len: int, max_num_batched_tokens: int = 0) -> str | None:
    """What in ``config`` the engine would compute differently from the model, or None.

    Checked at start, so that such a model is refused with the feature named
    instead of serving different tokens: chunked attention with chunks
    smaller than ``max_model_len`` (``attention_chunk_size``) and
    non-attention layers (state-space, linear attention). Sliding windows,
    logit softcapping and attention sinks are served (:func:`ringstream.daemon.engine.attention.paged_attention`); RoPE
    whose factors depend on the sequence length is fixed at ``max_model_len``
    (:mod:`ringstream.daemon.engine.rope`).
    """
    layer_types = getattr(config, "layer_types", None) or ()
    others = sorted({t for t in layer_types if t not in FULL_ATTENTION_LAYER_TYPES})
    if others:
        return (f"layers of type {', '.join(others)} (state-space, convolution or linear-attention layers; only "
                "attention layers are supported)")
    if getattr(config, "kv_lora_rank", None):
        return ("multi-head latent attention (kv_lora_rank): transformers caches the compressed latent and expands "
                "it inside the layer over the whole cache, which a paged KV pool cannot hand it")
    window = sliding_window(config, max_model_len)
    if window is not None and window < 2:
        return (f"sliding_window={window} (transformers' sliding cache keeps window - 1 = {window - 1} tokens, "
                "a degenerate window generate() itself serves inconsistently)")
    if getattr(config, "attn_temperature_tuning", False):
        floor = getattr(config, "floor_scale", 0) or 0
        if floor <= max(max_model_len, max_num_batched_tokens):
            return (f"attention temperature tuning (floor_scale={floor}): its NoPE layers take positions from "
                    "the cache's length, which a packed step of many sequences does not have; serve it with "
                    f"max_model_len and max_num_batched_tokens below {floor}")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and chunk < max_model_len:
        return f"chunked attention (attention_chunk_size={chunk}); serve it with max_model_len <= {chunk}"
    return None

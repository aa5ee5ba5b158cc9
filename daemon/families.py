"""What the engine can serve exactly, read from a model's config. No torch.

The engine calls :func:`unsupported_feature` at start and refuses a model
with the feature named rather than serve tokens that differ from
``generate()``; :func:`sliding_window` tells which window the layers must
pass to the attention (a model that applies it elsewhere is refused by the
engine's start check).
"""

from __future__ import annotations

__all__ = ["sliding_window", "unsupported_feature"]

FULL_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(value) -> list[str]:
    """Every ``rope_type`` in a config's ``rope_parameters`` / ``rope_scaling`` (nested per layer type or not)."""
    if not isinstance(value, dict):
        return []
    found = [value["rope_type"]] if isinstance(value.get("rope_type"), str) else []
    found += [value["type"]] if isinstance(value.get("type"), str) else []
    for inner in value.values():
        found += _rope_types(inner)
    return found


def sliding_window(config, max_model_len: int) -> int | None:
    """The sliding window the config asks for, if some sequence can outgrow it; else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    uses_window = "sliding_attention" in layer_types or getattr(config, "use_sliding_window", True)
    return window if isinstance(window, int) and uses_window and window < max_model_len else None


def unsupported_feature(config, max_model_len: int) -> str | None:
    """What in ``config`` the engine would compute differently from the model, or None.

    Checked at start, so that such a model is refused with the feature named
    instead of serving different tokens: chunked attention with chunks
    smaller than ``max_model_len`` (``attention_chunk_size``), key/value heads
    of different sizes (MLA), non-attention layers (state-space, linear
    attention), and RoPE variants whose factors depend on the sequence length.
    Sliding windows, logit softcapping and attention sinks are served
    (:func:`daemon.attention.paged_attention`).
    """
    layer_types = getattr(config, "layer_types", None) or ()
    others = sorted({t for t in layer_types if t not in FULL_ATTENTION_LAYER_TYPES})
    if others:
        return f"layers of type {', '.join(others)} (only attention layers are supported)"
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and chunk < max_model_len:
        return f"chunked attention (attention_chunk_size={chunk}); serve it with max_model_len <= {chunk}"
    if getattr(config, "kv_lora_rank", None):
        return "multi-head latent attention (kv_lora_rank: key and value head dims differ)"
    rope = _rope_types(getattr(config, "rope_parameters", None)) + _rope_types(getattr(config, "rope_scaling", None))
    dynamic = sorted({t for t in rope if t in LENGTH_DEPENDENT_ROPE})
    if dynamic:
        return f"RoPE scaling whose factors depend on the sequence length ({', '.join(dynamic)})"
    return None

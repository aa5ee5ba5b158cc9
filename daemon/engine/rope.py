"""RoPE whose frequencies depend on the sequence length, fixed once per engine.

transformers' ``dynamic_rope_update`` recomputes the inverse frequencies of
``dynamic`` (NTK) and ``longrope`` (Phi-3) rotary embeddings in every forward
from the batch's largest position: in a continuous batch one long companion
would switch every row to the long-context frequencies, so a request's tokens
would depend on who it shares a step with. As vLLM does, the engine chooses
the frequencies once from ``max_model_len``
(``rope_init_fn(config, seq_len=max_model_len)``) and keeps them for every
request:

- ``longrope``: the long factors when ``max_model_len`` exceeds
  ``original_max_position_embeddings``, else the short ones.
- ``dynamic``: the NTK base scaled for ``max_model_len`` when it exceeds
  ``max_position_embeddings``, else the original frequencies.

Where ``max_model_len`` stays within the original context both equal
``generate()``. Beyond it, ``generate()`` of a prompt shorter than the
original context starts with the short frequencies (and switches mid-stream
once it grows past it, with keys already cached under the old ones); the
engine uses the long ones from the first token.
"""

from __future__ import annotations

import torch

__all__ = ["LENGTH_DEPENDENT_ROPE", "check_batch_independent", "fix_rope_frequencies"]

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _length_dependent(rope_type) -> bool:
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def fix_rope_frequencies(model: torch.nn.Module, max_model_len: int) -> list[str]:
    """Fix every length-dependent rotary embedding of ``model`` at ``max_model_len``.

    Returns:
        One description per fixed embedding (module name, RoPE type, which
        frequencies), for the start log; empty when the model has none.

    Raises:
        ValueError: a rotary embedding still changes its frequencies with the
            position afterwards (a transformers version whose update this
            does not know): refused rather than served length-dependent.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fixed = []
    for name, module in model.named_modules():
        rope_type = getattr(module, "rope_type", None)
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "inv_freq") and not isinstance(rope_type, dict):
            continue
        layer_types = list(rope_type) if isinstance(rope_type, dict) else [None]
        for layer_type in layer_types:
            kind = rope_type[layer_type] if layer_type is not None else rope_type
            if not _length_dependent(kind):
                continue
            prefix = f"{layer_type}_" if layer_type is not None else ""
            buffer = getattr(module, f"{prefix}inv_freq")
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, buffer.device, seq_len=max_model_len, **kwargs)
            inv_freq = inv_freq.to(buffer.dtype)
            with torch.no_grad():
                if buffer.shape == inv_freq.shape:
                    buffer.copy_(inv_freq)
                else:
                    module.register_buffer(f"{prefix}inv_freq", inv_freq, persistent=False)
            if layer_type is None:
                module.rope_type = "default"
                module.attention_scaling = scaling
            else:
                module.rope_type = {**module.rope_type, layer_type: "default"}
            original = _original_context(config, layer_type, kind)
            which = "long" if max_model_len > original else "original"
            fixed.append(f"{name or 'model'}: {kind} RoPE fixed at max_model_len={max_model_len} "
                         f"({which} frequencies; original context {original})")
            _check_fixed(module, layer_type, max_model_len, inv_freq)
    return fixed


def check_batch_independent(model: torch.nn.Module, max_model_len: int, probe: int = 8) -> None:
    """Require every rotary embedding to give a position the same cos/sin whatever else is in the batch.

    Runs each module that has an ``inv_freq`` buffer on positions ``[0, probe)``
    alone and together with position ``max_model_len - 1``, and compares. This
    catches rotary code that takes a scale from the batch's largest position
    on its own (PhiMoE's LongRoPE ``short_mscale`` / ``long_mscale``), which
    :func:`fix_rope_frequencies` cannot reach. A module that cannot be called
    this way is left to the engine's start check.

    Raises:
        ValueError: a rotary embedding depends on the batch, naming the module.
    """
    for name, module in model.named_modules():
        buffer = getattr(module, "inv_freq", None)
        if not isinstance(buffer, torch.Tensor) or max_model_len <= probe:
            continue
        x = torch.zeros(1, device=buffer.device)
        alone = torch.arange(probe, device=buffer.device).unsqueeze(0)
        together = torch.cat([alone, torch.tensor([[max_model_len - 1]], device=buffer.device)], dim=1)
        try:
            with torch.inference_mode():
                first, second = module(x, alone), module(x, together)
        except Exception:  # another signature: the start check against the model's own forward covers it
            continue
        if not isinstance(first, tuple):
            continue
        for a, b in zip(first, second):
            if not torch.equal(a[..., :probe, :], b[..., :probe, :]):
                raise ValueError(f"{name or 'model'} ({type(module).__name__}) gives positions other values when a "
                                 "longer sequence shares the batch (a RoPE scale taken from the batch's largest "
                                 "position); it cannot be served exactly")


def _original_context(config, layer_type: str | None, kind: str) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    if kind == "longrope":
        return int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    return int(config.max_position_embeddings)


def _check_fixed(module, layer_type: str | None, max_model_len: int, want: torch.Tensor) -> None:
    """Run the embedding at the first and last position and require its frequencies unchanged."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    buffer = getattr(module, f"{prefix}inv_freq")
    x = torch.zeros(1, device=buffer.device)
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    for position in (0, max_model_len - 1):
        with torch.inference_mode():
            module(x, torch.tensor([[position]], device=buffer.device), **kwargs)
        if not torch.equal(getattr(module, f"{prefix}inv_freq"), want):
            raise ValueError(f"{type(module).__name__} changes its RoPE frequencies with the position even when "
                             "fixed (an unknown transformers RoPE update); it cannot be served exactly")

"""Loading a resolved model directory's weights as a transformers causal LM (torch)."""

from __future__ import annotations

from ringstream.daemon.common.model_dir import SUPPORTED_DTYPES, ModelError, ModelInfo

__all__ = ["load_model"]


def load_model(info: ModelInfo, device: str = "cpu", dtype: str = "float32"):
    """Load the causal LM of a resolved model directory for inference.

    Imports torch and transformers on first use; only the engine process
    should call this.

    Args:
        info: from :func:`resolve_model_dir`.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.
        dtype: parameter dtype, one of ``"float32"``, ``"float16"``,
            ``"bfloat16"``.  Stored weights are converted on load (the default
            model is stored in bfloat16 and upcast to float32 on CPU).

    Returns:
        A transformers ``PreTrainedModel`` for causal LM, in eval mode, on
        ``device``, using SDPA attention (eager for a model that refuses SDPA).

    Raises:
        ModelError: ``dtype`` is unsupported, or the weights cannot be loaded
            or moved to ``device``.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelError(
            f"unsupported dtype {dtype!r}; expected one of {', '.join(SUPPORTED_DTYPES)}"
        )

    import torch
    from transformers import AutoModelForCausalLM

    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                info.path, dtype=getattr(torch, dtype), attn_implementation="sdpa", local_files_only=True)
        except ValueError as exc:
            if "attn_implementation" not in str(exc) and "scaled_dot_product_attention" not in str(exc):
                raise
            # Gemma 2 (softcapping), GPT-OSS (sinks), and models with attention of their own refuse SDPA: load
            # them with their eager attention; the engine then serves or refuses them by what they are.
            model = AutoModelForCausalLM.from_pretrained(
                info.path, dtype=getattr(torch, dtype), attn_implementation="eager", local_files_only=True)
        model.to(device)
    except Exception as exc:  # transformers and torch raise many unrelated types
        raise ModelError(f"cannot load model {info.path} on {device} as {dtype}: {exc}") from exc
    model.eval()
    return model

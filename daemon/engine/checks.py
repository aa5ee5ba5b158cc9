"""What :class:`ringstream.daemon.engine.engine.Engine` refuses or warns about at start.

* :func:`check_servable`: model features the engine cannot serve exactly,
  known from the model's class and config before anything is allocated.
* :func:`ignored_generation_defaults`: logits processors the checkpoint's
  ``generation_config.json`` switches on for ``generate()`` that the engine
  does not apply.
* :func:`check_against_model`: after warmup, one request through the engine
  must give the model's own logits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ringstream.daemon.engine.attention import use_paged_attention
from ringstream.daemon.engine.interface import SamplingParams
from ringstream.daemon.engine.families import configured_window, kv_shape, sliding_window, unsupported_feature
from ringstream.daemon.common.model_dir import ModelRefused

__all__ = [
    "CHECK_TOKENS",
    "CHECK_TOLERANCE",
    "GENERATION_DEFAULTS_IGNORED",
    "check_against_model",
    "check_model",
    "check_servable",
    "ignored_generation_defaults",
    "kv_layout",
]

CHECK_TOKENS = 4
"""Decode steps of the start-up check against the model's own forward (:func:`check_against_model`)."""
CHECK_FIRST_TOKEN = 3
CHECK_TOLERANCE = {True: 1e-3, False: 1e-1}
"""Largest logit difference allowed by that check, relative to the logits' scale: float32, then bf16/fp16
(reduced-precision kernels of different batch shapes round apart by up to a few 1e-2)."""

GENERATION_DEFAULTS_IGNORED = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "suppress_tokens": None, "begin_suppress_tokens": None, "bad_words_ids": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
}
"""Logits processors a checkpoint's ``generation_config.json`` may switch on for ``generate()`` (with their
neutral values); the engine does not apply them, and says so at start."""

TracedRun = Callable[[list[int], SamplingParams, int], tuple[list[int], torch.Tensor, set]]
"""``(prompt, params, max_num_batched_tokens) -> (output token ids, logits, windows seen)``: one request served
alone through the engine with that token budget; the logits (float32, ``[sampled positions, vocab]``) of every
position it sampled, and the sliding windows its attention calls were given."""


def routes_attention(model) -> bool:
    """Whether the model's layers call their attention through transformers' ``AttentionInterface``
    (``ALL_ATTENTION_FUNCTIONS``), where the engine's paged attention takes over: its class says so
    (``_supports_attention_backend``), or its modeling module looks the function up there though the class
    does not claim it (StableLM in transformers 5). Either way :func:`check_against_model` then compares the
    engine's logits with the model's own forward before anything is served."""
    if getattr(type(model), "_supports_attention_backend", False):
        return True
    module = sys.modules.get(type(model).__module__)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def check_servable(model, config, max_model_len: int | None, max_num_batched_tokens: int) -> None:
    """Refuse a model the engine cannot serve exactly, from its class and text ``config``.

    Raises:
        ModelRefused: a feature named by :func:`ringstream.daemon.engine.families.unsupported_feature`,
            attention not routed through transformers' AttentionInterface, or
            no ``max_position_embeddings``.
    """
    max_positions = getattr(config, "max_position_embeddings", None)
    problem = unsupported_feature(config, max_model_len or sys.maxsize, max_num_batched_tokens)
    if problem is None and not routes_attention(model):
        problem = ("it does not route its attention through transformers' AttentionInterface (its layers run "
                   "their own attention and cache code)")
    if problem is None and not isinstance(max_positions, int):
        problem = "its config has no max_position_embeddings"
    if problem is not None:
        raise ModelRefused(f"{type(model).__name__} cannot be served exactly: {problem}")


def check_model(model, text_config, config) -> int:
    """Refuse what cannot be served exactly (:func:`check_servable`); the ``max_model_len`` in force (the
    engine config's, else ``max_position_embeddings``). ValueError when it is outside ``[2, that]``."""
    max_positions = getattr(text_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len if config.max_model_len is not None else max_positions
    check_servable(model, text_config, max_model_len, config.max_num_batched_tokens)
    if not 2 <= max_model_len <= max_positions:
        raise ValueError(f"max_model_len must be in [2, {max_positions}], got {max_model_len}")
    return max_model_len


def kv_layout(model, text_config) -> tuple[int, int, int]:
    """``(kv heads, key head dim, value head dim)``; ModelRefused when they differ between layers."""
    try:
        return kv_shape(text_config)
    except Exception as exc:  # e.g. transformers' AmbiguousGlobalPerLayerAttributeError
        raise ModelRefused(f"{type(model).__name__} cannot be served exactly: its key/value shape is not one per "
                           f"model (per-layer head_dim or kv heads: {exc})") from exc


def ignored_generation_defaults(model) -> list[str]:
    """``key=value`` of each :data:`GENERATION_DEFAULTS_IGNORED` entry the model's generation config sets."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    return [f"{key}={getattr(config, key)!r}" for key, neutral in GENERATION_DEFAULTS_IGNORED.items()
            if getattr(config, key, neutral) not in (neutral, None)]


def check_against_model(model, config, run: TracedRun, *, block_size: int, max_model_len: int, vocab_size: int,
                        device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an architecture whose logits through the engine differ from its own forward.

    A prompt of a few blocks is prefilled in chunks and decoded for
    :data:`CHECK_TOKENS` tokens through the engine (``run``); the model's own
    eager forward (no cache) over the same tokens must give the same logits at
    every sampled position, within :data:`CHECK_TOLERANCE` of the logits'
    scale. This catches layers that bypass the engine's cache or attention
    (recurrent, stateful or custom attention code) before they serve wrong
    tokens. ``config`` is the model's text config.

    Raises:
        ModelRefused: the logits differ (naming by how much), or a configured
            sliding window never reaches the attention.
    """
    want = 2 * block_size + 3
    window = configured_window(config, max_model_len)
    if window is not None:  # past any window the config carries: its mask and its attention must agree
        want = max(want, window + 2 * block_size + 3)
    length = max(1, min(want, max_model_len - CHECK_TOKENS - 1))
    prompt = [(CHECK_FIRST_TOKEN + 7 * i) % vocab_size for i in range(length)]
    params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
    output, got, seen_windows = run(prompt, params, max(1, length // 2))
    window = sliding_window(config, max_model_len)
    if window is not None and window not in seen_windows:
        raise ModelRefused(
            f"{type(model).__name__}: its config has sliding_window={window} but no layer passes it to the "
            "attention function (the window would be applied by a mask the engine does not build); serve it with "
            f"max_model_len <= {window}"
        )
    tokens = prompt + output[:-1]
    try:
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([tokens], device=device), use_cache=False)
        want = out.logits[0, length - 1:].float()
    finally:
        use_paged_attention(model)
    tolerance = CHECK_TOLERANCE[dtype == torch.float32]
    diff = float((got - want).abs().max())
    scale = max(1.0, float(want.abs().max()))
    if got.shape != want.shape or not diff <= tolerance * scale:
        raise ModelRefused(
            f"{type(model).__name__}: logits through the engine differ from the model's own forward "
            f"(max |difference| {diff:.3g} at logit scale {scale:.3g}); its layers do not use the engine's "
            "cache and attention as it needs, so it cannot be served exactly"
        )

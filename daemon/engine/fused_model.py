"""One loop over a Llama-exact model's layers for an engine step (CPU, native kernels).

A step through a transformers model's own forward spends about 1 ms on the host in Python alone (12 layers, on this
project's 2-core reference host): the decorated ``forward`` of the causal LM, the model and each decoder layer, ~90
module ``__call__`` s (the loop keeps ~30), keyword plumbing and output dataclasses, the causal mask that the paged
attention ignores. :class:`FusedCausalLM` computes the same step as one loop over the layers' fused calls
(:mod:`ringstream.daemon.engine.fused`): RMSNorm, the q / k / v GEMM with ``rope_store`` and the paged attention,
``o_proj``, the residual adds, RMSNorm, the gated MLP; then the final norm and ``lm_head`` over the kept rows. The
tensors and the operations on them are the model's own, in its order, so the logits are bit-identical to the model's
forward in the same step (the engine's start check compares them with the model's forward over its own cache,
:func:`ringstream.daemon.engine.checks.check_against_model`). vLLM's model definitions are such loops
(``LlamaModel.forward`` in ``vllm/model_executor/models/llama.py``).

:func:`fuse_model` installs it only where the forwards it stands for are transformers' Llama code itself
(``LlamaForCausalLM``, ``LlamaModel`` and ``LlamaDecoderLayer``, or subclasses that keep their forwards: no copy,
override, wrapper or patch), every norm, attention block and MLP got its fused forward
(:func:`~ringstream.daemon.engine.fused.fuse_elementwise`, :func:`~ringstream.daemon.engine.fused.fuse_attention`)
and no module has hooks; the engine checks before each step that no hook or forward was added since
(:meth:`FusedCausalLM.usable`). Any other model is run by its own forward, as before.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn
from torch.nn.modules import module as _module

from ringstream.daemon.engine.attention import AttentionMetadata
from ringstream.daemon.engine.fused import _mlp_forward, _transformers_own, attention_step, fused_kind
from ringstream.daemon.engine.kv_cache import PagedKVCache

__all__ = ["FusedCausalLM", "fuse_model"]


def _llamas_own(function, qualname: str) -> bool:
    """Whether ``function`` is ``qualname`` (``"LlamaModel.forward"``...) of transformers' ``modeling_llama`` under
    transformers' own decorators only: not a copy, a subclass's override, a wrapper or a patch of it."""
    from transformers.models.llama import modeling_llama

    inner = inspect.unwrap(function) if _transformers_own(function) else None
    code = getattr(inner, "__code__", None)
    return (code is not None and getattr(inner, "__qualname__", None) == qualname
            and os.path.abspath(code.co_filename) == os.path.abspath(inspect.getfile(modeling_llama)))


class FusedCausalLM:
    """An engine step's forward over a Llama-exact causal LM whose layers are fused (see the module docstring).

    Call it as ``(input_ids [T] int64, position_ids [T] int64, keep [R] int64, paged, cache) -> logits
    [R, vocab]``: ``keep`` the packed rows whose logits are wanted, ``paged`` the step's
    :class:`~ringstream.daemon.engine.attention.AttentionMetadata`, ``cache`` the engine's
    :class:`~ringstream.daemon.engine.kv_cache.PagedKVCache` (its ``slot_mapping`` set for the step). Raises what
    the kernels raise (RuntimeError under autograd: they have no backward).
    """

    def __init__(self, model: nn.Module, ops) -> None:
        inner = model.model
        self._ops = ops
        self._embed, self._rotary, self._lm_head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self._norm = (inner.norm.weight, inner.norm.variance_epsilon)
        layers = list(inner.layers[: model.config.num_hidden_layers])
        self._layers = [(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, layer.self_attn,
                         layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                         layer.mlp) for layer in layers]
        self._hookable = [model, inner, self._embed, self._rotary, self._lm_head, inner.norm]
        self._hookable += [m for layer in layers for m in layer.modules()]
        fused_parts = [inner.norm] + [getattr(layer, name) for layer in layers
                                      for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")]
        # the forwards the loop stands for, as they are now: on the instances (None: the class's; the fused
        # modules' own) and on the classes
        self._instance_forwards = [(m, m.__dict__.get("forward")) for m in [model, inner, *layers, *fused_parts]]
        self._class_forwards = [(cls, cls.forward) for cls in {type(m) for m in [model, inner, *layers]}]

    def usable(self) -> bool:
        """Whether the loop still stands for the model's forward: no module has a forward hook (nor the global
        registry) and no forward it stands for was replaced (on an instance or a class) since :func:`fuse_model`.
        Checked by the engine before each step (~13 us at 12 layers), which otherwise runs the model's forward: a
        hook added to a running engine's model runs as it would in the model's own code.

        The modules and weights themselves are the engine's from its start, as its packed linears are: a module
        or a weight swapped into a running engine's model is not seen, with this loop or without it."""
        return (not any(m._forward_hooks or m._forward_pre_hooks for m in self._hookable)
                and all(m.__dict__.get("forward") is forward for m, forward in self._instance_forwards)
                and all(cls.forward is forward for cls, forward in self._class_forwards) and not _hooked_globally())

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
                 paged: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        ops = self._ops
        hidden = self._embed(input_ids)  # [T, hidden]
        cos, sin = self._rotary(hidden.unsqueeze(0), position_ids=position_ids.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        for in_weight, in_eps, attention, post_weight, post_eps, mlp in self._layers:
            out = attention_step(ops, attention, ops.rms_norm(hidden, in_weight, in_eps), cos, sin, cache,
                                 paged=paged)
            hidden = hidden + out  # the decoder layer's ``residual + hidden_states``
            hidden = hidden + _mlp_forward(ops, mlp, ops.rms_norm(hidden, post_weight, post_eps))
        weight, eps = self._norm
        return self._lm_head(ops.rms_norm(hidden, weight, eps).index_select(0, keep))


def fuse_model(model: nn.Module, ops) -> FusedCausalLM | None:
    """A :class:`FusedCausalLM` over ``model`` where it computes the model's own step exactly (the causal LM's,
    model's and decoder layers' forwards transformers' Llama code; every layer's norms, attention and MLP fused by
    :func:`~ringstream.daemon.engine.fused.fuse_elementwise` and
    :func:`~ringstream.daemon.engine.fused.fuse_attention`, in the model's dtype; no hooks); else None."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if (inner is None or config is None or not isinstance(getattr(config, "num_hidden_layers", None), int)
            or not _llamas_own(type(model).forward, "LlamaForCausalLM.forward")
            or not _llamas_own(type(inner).forward, "LlamaModel.forward")
            or not isinstance(getattr(model, "lm_head", None), nn.Module)):
        return None
    embed = getattr(inner, "embed_tokens", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(layers, nn.ModuleList) or fused_kind(
            getattr(inner, "norm", nn.Identity())) != "norm" or not isinstance(getattr(inner, "rotary_emb", None),
                                                                             nn.Module):
        return None
    dtype = embed.weight.dtype
    layers = list(layers[: config.num_hidden_layers])
    for layer in layers:
        parts = [getattr(layer, name, None) for name in ("input_layernorm", "self_attn", "post_attention_layernorm",
                                                          "mlp")]
        if (not _llamas_own(type(layer).forward, "LlamaDecoderLayer.forward") or any(p is None for p in parts)
                or [fused_kind(p) for p in parts] != ["norm", "attention", "norm", "mlp"]
                or parts[0].weight.dtype != dtype or parts[2].weight.dtype != dtype):
            return None
    if inner.norm.weight.dtype != dtype:
        return None
    loop = FusedCausalLM(model, ops)
    return loop if loop.usable() else None


def _hooked_globally() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)

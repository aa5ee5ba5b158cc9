"""Fused elementwise steps for the decoder layers that compute them exactly as Llama's modules do (CPU, float32;
bfloat16 rounded where the modules' bfloat16 code rounds).

A Hugging Face RMSNorm is six tensor ops (``to``, ``pow``, ``mean``, ``add``, ``rsqrt``, two ``mul``), each a
pass over memory and a dispatch; the gated MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` two more after the
projections. :func:`fuse_elementwise` gives such modules a forward that calls the engine's native kernels
(``torch.ops.ringstream.rms_norm`` and ``silu_and_mul``, ``csrc/elementwise.cpp``) instead, as vLLM's model
definitions call its ``RMSNorm`` and ``SiluAndMul`` custom ops.

Which modules: those whose class's ``forward`` is, token for token, Llama's (``LlamaRMSNorm.forward``,
``LlamaMLP.forward``): transformers' modular model files copy these into Mistral, Qwen2, Qwen3, and others, so
the check follows the code rather than a list of class names. A family that changes the formula (Gemma's
``1 + weight``, a bias, another activation) keeps its own forward. Results equal the modules' to float32
rounding (the sum of squares is accumulated in another order).

:func:`fuse_attention` does the same for attention blocks whose forward, ``apply_rotary_pos_emb`` and
``rotate_half`` are Llama's: in an engine step (the paged KV cache and the step's metadata present) the block runs
the fused q / k / v projection, then ``torch.ops.ringstream.rope_store`` (``csrc/rope_store.cpp``: the rotary
embedding of queries and keys and the keys' and values' store into the pool, bit-identical to the module's ops
for every result that is a number), then :func:`~ringstream.daemon.engine.attention.paged_attention` and
``o_proj``: one native call where the module makes about twenty small tensor ops and a cache update, as vLLM's
``rotary_embedding`` and ``reshape_and_cache`` ops serve its model definitions. Anywhere else (``generate()``'s
own cache, a forward without the step's metadata) the block runs its own forward.

transformers releases that depend on the ``kernels`` package mark these functions for replacement by a hub
kernel: ``apply_rotary_pos_emb`` becomes a module whose forward calls the function, and the attention class's
forward a wrapper that routes it to a per-block copy. Those wrappers run the function itself until
``kernels.kernelize`` swaps a copy's forward; :func:`_unwrapped` reads through them while nothing is swapped, and
a block whose copy was swapped keeps its own forward.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types

import torch
import transformers
from torch import nn

from ringstream.daemon.engine.attention import paged_attention
from ringstream.daemon.engine.kv_cache import PagedKVCache
from ringstream.daemon.engine.linear import FusedLinearSlice, refuse_autograd

__all__ = ["FUSED_DTYPES", "attention_step", "fuse_attention", "fuse_elementwise", "fused_kind"]

FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the native elementwise kernels compute: bfloat16 in float32, rounded where the modules' own
bfloat16 code rounds (``csrc/elementwise.cpp``)."""


def _tokens(function) -> tuple[str, ...] | None:
    """The source tokens of ``function`` with its block structure (statement ends, indents and dedents as
    markers, whatever their width), comments and line breaks inside brackets dropped; None where the source
    cannot be read or ``function`` is wrapped by code outside transformers (``inspect.getsource`` would read the
    wrapped function and hide the wrapper)."""
    function = _unwrapped(function)
    return _source_tokens(function) if _transformers_own(function) else None


def _source_tokens(function) -> tuple[str, ...] | None:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING}
    markers = {tokenize.NEWLINE: "<newline>", tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>"}
    try:
        return tuple(markers.get(tok.type, tok.string)
                     for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)
                     if tok.type not in skip)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None


def _transformers_own(function) -> bool:
    """Whether ``function`` and every function it wraps (``__wrapped__``, as ``functools.wraps`` sets) are defined in
    transformers' package: its own decorators only, and ``kernels``' ``use_kernelized_func`` wrapper (see the
    module docstring; :func:`_kernelized` tells whether a block's copies were swapped)."""
    package = os.path.dirname(inspect.getfile(transformers)) + os.sep
    seen = 0
    while function is not None and seen < 16:
        code = getattr(function, "__code__", None)
        if code is None or not (os.path.abspath(code.co_filename).startswith(package) or _kernels_wrapper(code)):
            return False
        function, seen = getattr(function, "__wrapped__", None), seen + 1
    return function is None


def _kernels_wrapper(code: types.CodeType) -> bool:
    """Whether ``code`` is the forward wrapper of ``kernels``' ``use_kernelized_func`` (kernels 0.1x)."""
    return (code.co_qualname == "use_kernelized_func.<locals>.decorator.<locals>.new_forward"
            and os.sep + os.path.join("kernels", "_internals", "layer", "layer.py") in os.path.abspath(
                code.co_filename))


def _unwrapped(function):
    """The function a ``kernels`` hub function module stands for (``use_kernel_forward_from_hub`` on a function:
    an ``nn.Module`` whose class forward calls it), while neither that instance's forward was swapped nor its
    class's replaced; else ``function`` itself (a plain function, or anything else, which then fails the
    token comparison)."""
    if not isinstance(function, nn.Module) or not hasattr(type(function), "kernel_layer_name"):
        return function
    forward = type(function).forward
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None) or ()
    if (code is None or "forward" in function.__dict__ or "func" not in code.co_freevars
            or code.co_qualname != "_create_func_module.<locals>.Func.forward"):
        return function
    return cells[code.co_freevars.index("func")].cell_contents


def _kernelized(module: nn.Module) -> bool:
    """Whether ``kernels.kernelize`` swapped the forward of one of ``module``'s per-block function copies
    (``use_kernelized_func``'s ``_kernel_funcs``): the block then computes another kernel's code."""
    copies = module.__dict__.get("_kernel_funcs") or {}
    return any(not isinstance(copy, nn.Module) or _unwrapped(copy) is copy for copy in copies.values())


@functools.cache
def _reference_tokens() -> dict[str, tuple[str, ...] | None]:
    from transformers.models.llama import modeling_llama

    return {"norm": _tokens(modeling_llama.LlamaRMSNorm.forward), "mlp": _tokens(modeling_llama.LlamaMLP.forward),
            "attention": _tokens(modeling_llama.LlamaAttention.forward),
            "apply_rotary_pos_emb": _tokens(modeling_llama.apply_rotary_pos_emb),
            "rotate_half": _tokens(modeling_llama.rotate_half)}


def _same_code(function, kind: str) -> bool:
    reference = _reference_tokens()[kind]
    return reference is not None and function is not None and _tokens(function) == reference


@functools.cache
def _same_forward(cls: type, kind: str) -> bool:
    return _same_code(cls.forward, kind)


@functools.cache
def _llama_attention(cls: type) -> bool:
    """Whether ``cls``'s forward and the RoPE functions it calls (its module's globals) are Llama's."""
    namespace = vars(sys.modules.get(cls.__module__, types.ModuleType("none")))
    return (_same_forward(cls, "attention")
            and all(_same_code(namespace.get(name), name) for name in ("apply_rotary_pos_emb", "rotate_half")))


def _is_silu(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _norm_forward(ops, module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != module.weight.dtype:  # fused where both are float32 or both bfloat16
        return type(module).forward(module, hidden_states)
    refuse_autograd(hidden_states, module.weight)
    return ops.rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _mlp_forward(ops, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    group = module.gate_proj.group
    fused = group.kernel.apply(x, group.packed, group.bias, group.out_features)  # [..., gate | up]; checks autograd
    return module.down_proj(ops.silu_and_mul(fused))


def fuse_elementwise(model: nn.Module, ops) -> int:
    """Give ``model``'s Llama-exact RMSNorm modules (float32 or bfloat16 weight) and gated SiLU MLPs (whose
    ``gate_proj`` and ``up_proj`` are one :class:`~ringstream.daemon.engine.linear.FusedLinearGroup`, in that
    order, after ``pack_linears``) forwards over ``ops`` (``torch.ops.ringstream`` with the native kernels); returns
    how many modules were changed. Nothing else changes: weights, names and state dicts stay as they were.
    """
    changed = 0
    for module in model.modules():
        cls = type(module)
        if ("RMSNorm" in cls.__name__ and isinstance(getattr(module, "weight", None), torch.Tensor)
                and module.weight.dtype in FUSED_DTYPES and module.weight.dim() == 1
                and isinstance(getattr(module, "variance_epsilon", None), float) and _same_forward(cls, "norm")):
            module.forward = types.MethodType(functools.partial(_norm_forward, ops), module)
            changed += 1
        elif (isinstance(getattr(module, "gate_proj", None), FusedLinearSlice)
              and isinstance(getattr(module, "up_proj", None), FusedLinearSlice)
              and module.gate_proj.group is module.up_proj.group
              and module.gate_proj.group.packed.dtype in FUSED_DTYPES
              and (module.gate_proj.index, module.up_proj.index) == (0, 1)
              and module.gate_proj.out_features == module.up_proj.out_features
              and _is_silu(getattr(module, "act_fn", None)) and _same_forward(cls, "mlp")):
            module.forward = types.MethodType(functools.partial(_mlp_forward, ops), module)
            changed += 1
    return changed


def _attention_forward(ops, module: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                       attention_mask: torch.Tensor | None = None, cache=None, **kwargs):
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    paged = kwargs.get("paged")
    if paged is None or not isinstance(cache, PagedKVCache) or position_embeddings is None:  # not an engine step
        return type(module).forward(module, hidden_states, position_embeddings=position_embeddings,
                                    attention_mask=attention_mask, cache=cache, **kwargs)
    cos, sin = position_embeddings
    return attention_step(ops, module, hidden_states, cos, sin, cache, attention_mask, **kwargs), None


def attention_step(ops, module: nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: PagedKVCache, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """A fused attention block's output in an engine step (``kwargs`` holds ``paged=``, the step's metadata):
    ``hidden_states [..., T, hidden]``, ``cos`` / ``sin`` the rotary embedding of the rows' positions
    (``[..., T, head_dim]``) -> ``[..., T, hidden]``."""
    group = module.q_proj.group
    qkv = group.kernel.apply(hidden_states, group.packed, group.bias, group.out_features)  # checks autograd
    keys, values = cache.key_cache[module.layer_idx], cache.value_cache[module.layer_idx]
    head_dim = keys.shape[-1]
    query = ops.rope_store(qkv, cos, sin, keys, values, cache.slot_mapping, group.splits[0] // head_dim,
                           group.splits[1] // head_dim)  # [T, heads, head_dim]
    out, _ = paged_attention(module, query.unsqueeze(0).transpose(1, 2), keys, values, attention_mask,
                             scaling=module.scaling, **kwargs)
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


def fuse_attention(model: nn.Module, ops) -> int:
    """Give ``model``'s Llama-exact attention blocks whose ``q_proj`` / ``k_proj`` / ``v_proj`` are one
    :class:`~ringstream.daemon.engine.linear.FusedLinearGroup` (float32 or bfloat16, after ``pack_linears``) a
    forward that, in an engine step, stores keys and values and applies RoPE with ``ops.rope_store`` (see the
    module docstring); returns how many blocks were changed. Weights, names and state dicts stay as they were.
    """
    changed = 0
    for module in model.modules():
        projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if (not all(isinstance(p, FusedLinearSlice) for p in projections) or not _llama_attention(type(module))
                or _kernelized(module)):
            continue
        group = projections[0].group
        head_dim = getattr(module, "head_dim", None)
        if (all(p.group is group for p in projections) and [p.index for p in projections] == [0, 1, 2]
                and len(group.splits) == 3 and group.packed.dtype in FUSED_DTYPES and isinstance(head_dim, int)
                and head_dim >= 2 and head_dim % 2 == 0 and group.splits[1] == group.splits[2]
                and group.splits[0] % head_dim == 0 and group.splits[1] % head_dim == 0
                and isinstance(getattr(module, "layer_idx", None), int)):
            module.forward = types.MethodType(functools.partial(_attention_forward, ops), module)
            changed += 1
    return changed


def fused_kind(module: nn.Module) -> str | None:
    """Which fused forward :func:`fuse_elementwise` or :func:`fuse_attention` gave ``module``: ``"norm"``,
    ``"mlp"``, ``"attention"``, or None (its own)."""
    func = getattr(getattr(module.__dict__.get("forward"), "__func__", None), "func", None)
    return {_norm_forward: "norm", _mlp_forward: "mlp", _attention_forward: "attention"}.get(func)

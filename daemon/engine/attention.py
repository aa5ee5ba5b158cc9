"""The engine's attention: packed rows over the paged KV pool (see :mod:`ringstream.daemon.engine.kv_cache`).

Registered with transformers' ``AttentionInterface`` as :data:`PAGED_ATTENTION`;
the engine switches its model to it. Each layer's call reads the step's
:class:`ringstream.daemon.engine.kv_cache.AttentionMetadata` (keyword ``paged``):

* decode groups: the rows' contexts are gathered from the pool into
  ``[g, kv_heads, T, head_dim]`` (``T`` = the group's longest context) and
  attended in one batched call with a validity mask. In float32 that call is
  PyTorch's ``scaled_dot_product_attention``, whose output ``generate()``
  reproduces token for token; in bfloat16 / float16 it is two matmuls with
  float32 scores and softmax, as transformers' eager attention computes them,
  over the ``[kv_heads, g]`` batch order the gather leaves
  (:func:`decode_matmul_kv_major`: no hidden copy of the context):
  PyTorch's CPU SDPA runs a flash kernel built for long queries and spends a
  one-token query's time on per-block set-up (measured on a 2-core AMD EPYC,
  torch 2.13, built-in model at batch 64: a bfloat16 decode step took 12.1 ms
  with SDPA and 8.4 ms with the matmuls).
* prefill chunks: one SDPA call per chunk (split when the mask would exceed
  :data:`ringstream.daemon.engine.kv_cache.MAX_MASK_ELEMENTS`), causal over the chunk and full
  over the context before it. A chunk that starts its sequence uses
  ``is_causal`` and builds no mask at all.

Per layer, what the model passes is honoured: ``sliding_window`` (a query
reads the last ``sliding_window`` positions, itself included, as
transformers' ``sliding_window_causal_mask``), ``softcap`` (Gemma 2's logit
softcapping) and ``s_aux`` (GPT-OSS's attention sinks); the last two go to
:func:`eager_attention`, as SDPA has neither.

On CPU, decode groups take the engine's native kernel when it is built
(``torch.ops.ringstream.paged_decode``, :mod:`ringstream.daemon.engine.kernels`):
it reads each row's blocks in place, with no gather copy, scores and softmax in
float32 (float32 results equal to SDPA's to ~1e-6; the model zoo's greedy
tokens stay equal to ``generate()``). Without it (no compiler, or
``native_kernels = false``) the gather copies each row's context once per
layer, which costs about what the attention reads. CUDA takes the gather path
(then SDPA or the two matmuls); a paged / varlen FlashAttention kernel reading
the blocks in place is not used.

On CPU hosts with AVX-512, prompt chunks whose head sizes are multiples of 16
take the native prefill kernel (``torch.ops.ringstream.paged_prefill``,
``csrc/paged_prefill.cpp``): FlashAttention's online softmax over the chunk's
blocks read in place, causal and windowed by position, with no mask. On a
2-core AMD EPYC, 82M-parameter Llama (12 query / 4 KV heads of 64), a step of
16 decode rows and 496 prompt tokens: float32 232 -> 213 ms, bfloat16 165 ->
141 ms; with the prompt chunk deep in an 1,800-token prompt, 359 -> 272 ms.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ringstream.daemon.engine.kv_cache import AttentionMetadata

__all__ = ["PAGED_ATTENTION", "decode_matmul_kv_major", "dense_attention", "eager_attention", "paged_attention",
           "use_paged_attention"]

PAGED_ATTENTION = "ringstream_paged"
"""Name under which :func:`paged_attention` is registered with transformers' ``AttentionInterface``."""


class _Step:
    """The metadata of the engine step being computed, for layers that do not pass ``paged=`` on (set by
    :mod:`ringstream.daemon.engine.model_runner` around each forward; None outside one)."""

    metadata: AttentionMetadata | None = None


STEP = _Step()


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    *, paged: AttentionMetadata | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' attention-function protocol (``ALL_ATTENTION_FUNCTIONS``).

    Args:
        query: ``[1, heads, N, head_dim]``, the packed rows of the step.
        key, value: the layer's pool buffers ``[kv_heads, slots, head_dim]``
            (values may have their own head size ``value_dim``, as in MLA)
            (from :meth:`ringstream.daemon.engine.kv_cache.PagedKVCache.update`), the step's new
            keys and values already stored.
        attention_mask: ignored (the metadata holds the structure).
        scaling: score scale (default ``head_dim ** -0.5``).
        paged: the step's metadata. Without it (a forward that is not an
            engine step, e.g. a bare decode loop over a contiguous cache) this
            is :func:`dense_attention`.

    Returns:
        ``([1, N, heads, value_dim], None)``.
    """
    if paged is None and key.dim() == 3:
        # the keys are the pool's (the engine's cache answered): an engine step whose layers do not hand their
        # keyword arguments on to the attention (StableLM's decoder layer drops them) still has its metadata
        paged = STEP.metadata
    if paged is None:
        return dense_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    _, heads, num_tokens, head_dim = query.shape
    kv_heads, value_dim = key.shape[0], value.shape[-1]
    if scaling is None:
        scaling = head_dim ** -0.5
    window = kwargs.get("sliding_window")
    if paged.seen_windows is not None:
        paged.seen_windows.add(window)
    if window is not None and window >= paged.max_context:
        window = None  # no sequence of the step reaches past the window: full attention is the same
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    eager = softcap is not None or sinks is not None
    block_size = paged.block_size
    key_blocks = key.view(kv_heads, -1, block_size * head_dim)
    value_blocks = value.view(kv_heads, -1, block_size * value_dim)
    q = query[0].transpose(0, 1)  # [N, heads, head_dim]
    out = torch.empty_like(q) if value_dim == head_dim else q.new_empty(num_tokens, heads, value_dim)
    gqa = heads != kv_heads
    reduced = query.dtype != torch.float32
    # The native kernel reads the standard layout only; a model passing anything else (its own head split, a
    # query batch of its own) takes the torch path, where the start checks judge it as before.
    standard = query.shape[0] == 1 and key.dim() == 3 and value.dim() == 3 and heads % kv_heads == 0 \
        and query.dtype == key.dtype == value.dtype
    native = paged.native if not eager and standard else None
    for group in paged.decode_groups:
        rows = group.rows
        if native is not None:  # reads the pool in place: no gather
            native.paged_decode(out, q, key, value, group.block_index, group.lengths, rows, block_size, scaling,
                                window or 0)
            continue
        g = rows.shape[0]
        length = group.kv_valid.shape[-1]
        # [kv_heads, g * nb, bs * D] -> [kv_heads, g, T, D], contiguous in KV-head-major batch order
        k_major, v_major = _gather(key_blocks, value_blocks, group.block_index, paged.scratch)
        k_major = k_major.view(kv_heads, g, length, head_dim)
        v_major = v_major.view(kv_heads, g, length, value_dim)
        qg = q.index_select(0, rows)  # [g, heads, head_dim]
        valid = group.valid(window)
        if reduced and not eager:
            out[rows] = decode_matmul_kv_major(qg, k_major, v_major, valid, scaling)
            continue
        k, v = k_major.transpose(0, 1), v_major.transpose(0, 1)  # [g, kv_heads, T, D] views
        if eager:
            out[rows] = eager_attention(qg.unsqueeze(2), k, v, valid, scaling, softcap, sinks).squeeze(2)
        else:
            o = F.scaled_dot_product_attention(qg.unsqueeze(2), k, v, attn_mask=valid, scale=scaling,
                                               enable_gqa=gqa)
            out[rows] = o.squeeze(2)
    prefill_native = native is not None and _prefill_supported(native, head_dim, value_dim)
    for chunk in paged.prefill_chunks:
        if prefill_native:  # reads the pool in place: no gather, no mask
            native.paged_prefill(out, q, key, value, chunk.block_index, chunk.start, chunk.num_query,
                                 chunk.context_start, block_size, scaling, window or 0)
            continue
        k_all, v_all = _gather(key_blocks, value_blocks, chunk.block_index, paged.scratch)
        k_all = k_all.view(1, kv_heads, -1, head_dim)
        v_all = v_all.view(1, kv_heads, -1, value_dim)
        for split, (q_begin, q_end, kv_end, _) in enumerate(chunk.splits):
            rows = slice(chunk.start + q_begin, chunk.start + q_end)
            mask = chunk.mask(split, window)
            qc, kc, vc = query[:, :, rows], k_all[:, :, :kv_end], v_all[:, :, :kv_end]
            if eager:
                if mask is None:
                    mask = torch.ones(q_end - q_begin, kv_end, dtype=torch.bool, device=query.device).tril_()
                o = eager_attention(qc, kc, vc, mask, scaling, softcap, sinks)
            else:
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                                   enable_gqa=gqa)
            out[rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


@functools.cache
def _prefill_supported(native, head_dim: int, value_dim: int) -> bool:
    """Whether ``native.paged_prefill`` serves these head sizes on this host (AVX-512, multiples of 16)."""
    return bool(native.paged_prefill_supported(head_dim, value_dim))


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out, for what SDPA cannot do: logit softcapping and attention sinks.

    Args:
        q: ``[b, heads, q, D]``; k, v: ``[b, kv_heads, T, D]`` (query head ``i``
            reads kv head ``i // (heads / kv_heads)``).
        valid: bool, broadcastable to ``[b, heads, q, T]``, True where a key may be read.
        scaling: score scale.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking
            (Gemma 2, as transformers' ``eager_attention_forward`` of that model).
        sinks: ``[heads]`` logits of a per-head sink that takes probability mass
            and gives no value (GPT-OSS, as its eager attention).

    Returns:
        ``[b, heads, q, D]`` in ``v``'s dtype; scores and softmax in float32.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, heads, 1, 1).expand(scores.shape[0], heads, scores.shape[2], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = logits.softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _gather(key_blocks: torch.Tensor, value_blocks: torch.Tensor, index: torch.Tensor,
            scratch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``index`` of ``[kv_heads, num_blocks, block_elements]`` keys and values, into ``scratch`` if given."""
    if scratch is None:
        return key_blocks.index_select(1, index), value_blocks.index_select(1, index)
    heads, count = key_blocks.shape[0], index.numel()
    key_size = heads * count * key_blocks.shape[2]
    value_size = heads * count * value_blocks.shape[2]
    k = scratch[:key_size].view(heads, count, key_blocks.shape[2])
    v = scratch[key_size:key_size + value_size].view(heads, count, value_blocks.shape[2])
    torch.index_select(key_blocks, 1, index, out=k)
    torch.index_select(value_blocks, 1, index, out=v)
    return k, v


def dense_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The same kernels over contiguous ``key, value [b, kv_heads, T, head_dim]`` and ``query [b, heads, q, head_dim]``.

    One-token queries in reduced precision take the two matmuls (``attention_mask``
    additive, broadcastable to ``[b, 1, 1, T]``); everything else takes
    transformers' SDPA path. Returns ``([b, q, heads, value_dim], None)``.
    """
    if query.shape[2] != 1 or query.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, head_dim = query.shape
    valid = torch.ones((1, 1, 1, key.shape[2]), dtype=torch.bool, device=query.device)
    if attention_mask is not None:
        valid = attention_mask[..., -1:, :] == 0
    out = _decode_matmul(query.view(batch, heads, head_dim), key, value, valid, scaling or head_dim ** -0.5)
    return out.view(batch, 1, heads, value.shape[-1]), None


def decode_matmul_kv_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """:func:`_decode_matmul` over gathered keys and values in KV-head-major batch order, as the gather leaves
    them: ``q [g, heads, D]``, ``k [kv_heads, g, T, D]``, ``v [kv_heads, g, T, Dv]`` (contiguous), ``valid``
    ``[g, 1, 1, T]`` bool -> ``[g, heads, Dv]``.

    The two batched matmuls then run over ``[kv_heads, g]`` batches that are contiguous in memory; in the
    ``[g, kv_heads]`` order of the transposed views, ``torch.matmul`` first copies the whole gathered context
    into a contiguous tensor (its batch dimensions must collapse), which moves the keys and values twice more.
    Only the query (``g x heads x D``) and the output are permuted. Same scores, softmax and sums per (row, head)
    as :func:`_decode_matmul`.
    """
    g, heads, head_dim = q.shape
    kv_heads, length = k.shape[0], k.shape[2]
    qh = q.view(g, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [kv_heads, g, group, D]
    scores = torch.matmul(qh, k.transpose(-1, -2)).float()  # [kv_heads, g, group, T]
    scores.mul_(scaling)
    scores.masked_fill_(~valid.view(1, g, 1, length), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(g, heads, v.shape[-1])


def _decode_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """One-token attention as two matmuls: ``q [g, heads, D]``, ``k [g, kv_heads, T, D]``, ``v [g, kv_heads, T, Dv]``
    -> ``[g, heads, Dv]``.

    Query head ``i`` reads kv head ``i // (heads / kv_heads)``, as ``repeat_kv`` does.
    """
    g, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qh = q.view(g, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(qh, k.transpose(-1, -2)).float()  # [g, kv_heads, group, T]
    scores.mul_(scaling)
    scores.masked_fill_(~valid, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(g, heads, v.shape[-1])


AttentionInterface.register(PAGED_ATTENTION, paged_attention)


def use_paged_attention(model) -> None:
    """Switch ``model`` to :func:`paged_attention`.

    Raises:
        ValueError: the model's attention layers cannot switch implementation
            (not a transformers architecture that looks up
            ``config._attn_implementation`` at each call).
    """
    try:
        model.set_attn_implementation(PAGED_ATTENTION)
    except (ValueError, AttributeError, NotImplementedError) as exc:
        raise ValueError(f"{type(model).__name__} cannot use the paged attention: {exc}") from exc

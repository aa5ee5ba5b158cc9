"""The fused attention block: ``torch.ops.ringstream.rope_store`` (RoPE of queries and keys, the keys' and values'
store into the pool) bit for bit against transformers' ``apply_rotary_pos_emb`` and the cache's ``index_copy_``
(NaN for NaN), its refusals, which blocks :func:`fuse_attention` takes, and the engine's tokens with it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ringstream.daemon.engine.fused import fuse_attention, fuse_elementwise
from ringstream.daemon.engine.linear import pack_linears
from tests.daemon.native_helpers import (greedy_outputs, native_ops_or_skip, tiny,  # noqa: F401 (fixture)
                                         tiny_family_model)
from tests.factories import load_model


@pytest.fixture(scope="module")
def ops():
    return native_ops_or_skip()


def rope_case(seed, rows, heads, kv_heads, head_dim, dtype, slots=97, scale=3.0):
    """qkv rows ``[1, rows, (heads + 2 kv_heads) * head_dim]``, Llama's cos / sin at random positions, and distinct
    random slots of a pool of ``slots``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=g) * scale).to(dtype)
    positions = torch.randint(0, 5000, (rows,), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = (emb.cos() * 1.25)[None].to(dtype), (emb.sin() * 1.25)[None].to(dtype)  # with attention_scaling
    slot_mapping = torch.randperm(slots, generator=g)[:rows]
    return qkv, cos, sin, slot_mapping


def reference(qkv, cos, sin, slot_mapping, heads, kv_heads, head_dim, pool_slots):
    """What the module and the cache compute: the rotated queries ``[rows, heads, D]`` and the pools."""
    rows = qkv.shape[1]
    q = qkv[..., :heads * head_dim].view(1, rows, heads, head_dim).transpose(1, 2)
    k = qkv[..., heads * head_dim:(heads + kv_heads) * head_dim].view(1, rows, kv_heads, head_dim).transpose(1, 2)
    v = qkv[..., (heads + kv_heads) * head_dim:].view(1, rows, kv_heads, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys = torch.full((kv_heads, pool_slots, head_dim), 7.0, dtype=qkv.dtype)
    values = keys.clone()
    keys.index_copy_(1, slot_mapping, k[0])
    values.index_copy_(1, slot_mapping, v[0])
    return q[0].transpose(0, 1), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(1, 4, 4, 16), (16, 12, 4, 64), (37, 8, 1, 128),
                                                         (300, 6, 2, 32), (5, 2, 1, 2)])
def test_rope_store_is_bit_identical_to_the_modules_ops(ops, dtype, rows, heads, kv_heads, head_dim):
    qkv, cos, sin, slot_mapping = rope_case(rows * head_dim, rows, heads, kv_heads, head_dim, dtype, slots=400)
    want_q, want_keys, want_values = reference(qkv, cos, sin, slot_mapping, heads, kv_heads, head_dim, 400)
    keys = torch.full((kv_heads, 400, head_dim), 7.0, dtype=dtype)
    values = keys.clone()
    query = ops.rope_store(qkv, cos, sin, keys, values, slot_mapping, heads, kv_heads)
    assert query.shape == (rows, heads, head_dim) and query.dtype == dtype
    assert torch.equal(query, want_q)  # bit for bit: no fused multiply-add, bfloat16 rounded as the ops round
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)  # other slots untouched


def test_rope_store_propagates_nan_and_inf_as_the_ops_do(ops):
    qkv, cos, sin, slot_mapping = rope_case(1, 4, 2, 1, 16, torch.float32, slots=8)
    qkv[0, 1, 3] = float("nan")
    qkv[0, 2, 20] = float("inf")
    want_q, want_keys, _ = reference(qkv, cos, sin, slot_mapping, 2, 1, 16, 8)
    keys = torch.full((1, 8, 16), 7.0)
    values = keys.clone()
    query = ops.rope_store(qkv, cos, sin, keys, values, slot_mapping, 2, 1)
    torch.testing.assert_close(query, want_q, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(keys, want_keys, equal_nan=True, atol=0, rtol=0)


def test_rope_store_refuses_bad_shapes_and_slots_and_writes_nothing(ops):
    qkv, cos, sin, slot_mapping = rope_case(2, 3, 2, 1, 16, torch.float32, slots=8)
    keys, values = torch.zeros(1, 8, 16), torch.zeros(1, 8, 16)

    def call(**change):
        args = dict(qkv=qkv, cos=cos, sin=sin, key_pool=keys, value_pool=values, slot_mapping=slot_mapping,
                    heads=2, kv_heads=1) | change
        return ops.rope_store(*args.values())

    for slots, message in ((torch.tensor([0, 8, 1]), "slot 8 of row 1 is outside the pool's 8 slots"),
                           (torch.tensor([0, 1, -1]), "slot -1 of row 2"),
                           (torch.tensor([0, 1]), r"slot_mapping must be int64 \[3\]"),
                           (torch.tensor([0, 1, 2], dtype=torch.int32), "slot_mapping must be int64")):
        with pytest.raises(RuntimeError, match=message):
            call(slot_mapping=slots)
    with pytest.raises(RuntimeError, match="last dimension must be"):
        call(heads=3)
    with pytest.raises(RuntimeError, match="heads and kv_heads must be >= 1"):
        call(kv_heads=0)
    with pytest.raises(RuntimeError, match="cos and sin must hold"):
        call(cos=cos[:, :2])
    with pytest.raises(RuntimeError, match="one dtype"):
        call(sin=sin.double())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(qkv=qkv.half(), cos=cos.half(), sin=sin.half(), key_pool=keys.half(), value_pool=values.half())
    with pytest.raises(RuntimeError, match="the pools must be contiguous"):
        call(value_pool=torch.zeros(1, 9, 16))
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        odd = torch.zeros(1, 8, 15)
        call(qkv=torch.zeros(1, 3, 60), cos=torch.zeros(1, 3, 15), sin=torch.zeros(1, 3, 15), key_pool=odd,
             value_pool=odd.clone())
    with pytest.raises(RuntimeError, match="overflows int64"):  # the row width wraps to 0: no division by it
        call(qkv=torch.zeros(3, 0), heads=2 ** 63 - 2)
    with pytest.raises(RuntimeError, match="overflows int64"):
        call(heads=2 ** 62)  # the sum fits, its product with head_dim does not
    with pytest.raises(RuntimeError, match="must not require grad"):
        call(key_pool=torch.zeros(1, 8, 16, requires_grad=True))
    assert not keys.any() and not values.any()  # every refusal came before a write


def test_rope_store_refuses_a_pool_that_overlaps_its_inputs(ops):
    storage = torch.zeros(1000)
    qkv = storage[:3 * 64].view(1, 3, 64)  # heads 2, kv_heads 1, head_dim 16
    keys = storage[100:100 + 8 * 16].view(1, 8, 16)  # a later row of qkv: writing row 0's key would change it
    cos, sin = torch.ones(1, 3, 16), torch.zeros(1, 3, 16)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        ops.rope_store(qkv, cos, sin, keys, torch.zeros(1, 8, 16), torch.tensor([0, 1, 2]), 2, 1)
    assert not storage.any()


def test_fuse_attention_takes_llamas_blocks_only_and_leaves_plain_forwards_alone(ops):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM
    ids = torch.randint(0, 300, (2, 11))
    counts = {}
    for name, model in (("llama", tiny_family_model(LlamaConfig, LlamaForCausalLM)),
                        ("qwen3", tiny_family_model(Qwen3Config, Qwen3ForCausalLM)),
                        ("mistral", tiny_family_model(MistralConfig, MistralForCausalLM))):
        with torch.no_grad():
            want = model(ids).logits
        pack_linears(model, ops)
        fuse_elementwise(model, ops)
        counts[name] = fuse_attention(model, ops)
        with torch.no_grad():  # no paged KV cache: the blocks run their own forward
            torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    # Qwen3 normalises q and k before RoPE, Mistral passes its sliding window: their own forwards stay
    assert counts == {"llama": 2, "qwen3": 0, "mistral": 0}


def test_unpacked_projections_are_not_fused(ops):
    from transformers import LlamaConfig, LlamaForCausalLM
    model = tiny_family_model(LlamaConfig, LlamaForCausalLM)
    assert fuse_attention(model, ops) == 0  # q / k / v are not one packed group


def test_engine_steps_take_the_fused_block_and_keep_their_tokens(ops, tiny, monkeypatch):  # noqa: F811
    model_dir, tokenizer = tiny
    plain = greedy_outputs(load_model(model_dir), tokenizer, native=False)
    calls = []
    rope_store = ops.rope_store
    monkeypatch.setattr(ops, "rope_store", lambda *args: calls.append(args[0].shape) or rope_store(*args),
                        raising=False)
    fast = greedy_outputs(load_model(model_dir), tokenizer, native=True)
    assert fast == plain and all(len(tokens) == 24 for tokens in fast.values())
    assert len(calls) >= 2 * 24  # two layers, every step
    assert any(shape[1] > 1 for shape in calls)  # prompt chunks as well as decode rows


def test_kernels_hub_wrappers_are_read_through_until_a_block_is_kernelized(ops):
    # transformers releases that depend on `kernels` wrap apply_rotary_pos_emb (a module calling the function)
    # and LlamaAttention.forward (routing it to a per-block copy); unswapped, both run Llama's own code
    from transformers import LlamaConfig, LlamaForCausalLM
    from ringstream.daemon.engine.fused import _tokens, _unwrapped

    model = tiny_family_model(LlamaConfig, LlamaForCausalLM)
    blocks = [layer.self_attn for layer in model.model.layers]
    copies = [copy for block in blocks for copy in (block.__dict__.get("_kernel_funcs") or {}).values()]
    if not copies:
        pytest.skip("this transformers does not wrap its functions for the kernels hub")
    assert _tokens(apply_rotary_pos_emb) is not None and callable(_unwrapped(apply_rotary_pos_emb))
    # what kernels.kernelize does to a block's copy: an instance forward of another kernel's code
    (swapped,) = blocks[1].__dict__["_kernel_funcs"].values()
    swapped.forward = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)
    pack_linears(model, ops)
    assert fuse_attention(model, ops) == 1  # the first block only
    assert blocks[0].__dict__.get("forward") is not None and "forward" not in blocks[1].__dict__

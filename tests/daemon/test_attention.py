"""The engine's decode attention equals SDPA; it replaces SDPA only outside float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from daemon.attention import DECODE_ATTENTION, decode_attention, use_decode_attention
from daemon.engine import Engine, EngineRequest, SamplingParams
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir


class _Module:
    num_key_value_groups = 1
    is_causal = True
    training = False


def _reference(query, key, value, mask, scaling):
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask.float(),
                                         scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype, heads, kv_heads, tol", [
    (torch.float32, 8, 8, 1e-5), (torch.float32, 8, 2, 1e-5), (torch.bfloat16, 4, 4, 2e-2),
])
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, tol):
    torch.manual_seed(0)
    rows, keys, head_dim = 5, 17, 16
    query = torch.randn(rows, heads, 1, head_dim, dtype=dtype)
    key = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype)
    value = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype)
    lengths = torch.tensor([1, 4, 9, 16, 17])
    mask = torch.zeros(rows, 1, 1, keys, dtype=dtype)
    mask.masked_fill_((torch.arange(keys) >= lengths.unsqueeze(1)).view(rows, 1, 1, keys), float("-inf"))
    out, weights = decode_attention(_Module(), query, key, value, mask, scaling=head_dim ** -0.5)
    assert weights is None and out.shape == (rows, 1, heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(query, key, value, mask, head_dim ** -0.5), atol=tol, rtol=tol)
    # a row may attend to its first key only: masked keys must have no weight at all
    torch.testing.assert_close(out[0, 0].float(), value[0, :, 0].float().repeat_interleave(heads // kv_heads, 0),
                               atol=tol, rtol=tol)


def test_prefill_goes_to_sdpa():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 4, 6, 8) for _ in range(3))
    causal = torch.full((6, 6), float("-inf")).triu_(1).view(1, 1, 6, 6)
    out, _ = decode_attention(_Module(), query, key, value, causal, scaling=8 ** -0.5)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=8 ** -0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_only_reduced_precision_models_switch_and_a_bfloat16_engine_decodes_with_it(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path)
    model = load_model(model_dir)
    stock = model.config._attn_implementation
    assert not use_decode_attention(model) and model.config._attn_implementation == stock
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]

    def greedy(engine_model) -> list[list[int]]:
        engine = Engine(engine_model, load_tokenizer(model_dir), max_num_seqs=4)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
        for request in requests:
            engine.add(request)
        while engine.has_unfinished():
            engine.step()
        return [r.output_token_ids for r in requests]

    model.to(torch.bfloat16)
    tokens = greedy(model)
    assert model.config._attn_implementation == DECODE_ATTENTION and all(len(t) == 12 for t in tokens)
    ids = torch.tensor([prompts[2]])
    with torch.inference_mode():
        ours = model(input_ids=ids).logits[0, -1].float()  # prefill: SDPA inside decode_attention
        one = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], cache=one.past_key_values).logits[0, -1].float()
    torch.testing.assert_close(step, ours, atol=0.05, rtol=0.05)  # the decode path reproduces the last position

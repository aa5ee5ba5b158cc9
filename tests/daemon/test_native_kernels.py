"""The CPU fast paths: the native paged decode kernel against the torch reference, packed linear layers, the
fallback when the kernel cannot be built, and the engine's tokens with and without them."""

from __future__ import annotations

import importlib.util
import logging
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringstream.daemon.engine import kernels
from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from ringstream.daemon.engine.linear import PackedLinear, pack_linears
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

BUILDABLE = shutil.which("c++") is not None and importlib.util.find_spec("ninja") is not None


@pytest.fixture(scope="module")
def ops():
    ops = kernels.native_ops()
    if ops is None:
        if BUILDABLE:
            pytest.fail("a C++ compiler and ninja are here, yet the native kernels did not build")
        pytest.skip("no C++ compiler or ninja: the native kernels cannot be built here")
    return ops


def reference(query, key, value, tables, lengths, block_size, scale, window):
    """SDPA over each row's gathered context: ``query [g, heads, D]``, pool ``[kv_heads, slots, D]``."""
    out = []
    for i, (table, length) in enumerate(zip(tables, lengths)):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(length)])
        first = max(0, length - window) if window else 0
        k, v = key[:, slots[first:]].float(), value[:, slots[first:]].float()
        o = F.scaled_dot_product_attention(query[i].float().unsqueeze(1).unsqueeze(0), k.unsqueeze(0),
                                           v.unsqueeze(0), scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


def pool_and_tables(rng, kv_heads, head_dim, value_dim, lengths, block_size, dtype):
    num_blocks = sum(-(-n // block_size) for n in lengths) + 8
    key = torch.randn(kv_heads, num_blocks * block_size, head_dim).to(dtype)
    value = torch.randn(kv_heads, num_blocks * block_size, value_dim).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    index = torch.tensor([b for t in tables for b in t + [0] * (width - len(t))], dtype=torch.long)
    return key, value, tables, index


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_equals_attention_over_the_gathered_context(ops, group, dtype):
    rng = random.Random(group)
    kv_heads, head_dim, block_size = 2, 40, 16  # a head size that is no multiple of 16: the scalar tail runs
    lengths = [1, 15, 16, 17, 200, 63]
    key, value, tables, index = pool_and_tables(rng, kv_heads, head_dim, head_dim, lengths, block_size, dtype)
    heads = kv_heads * group
    rows = torch.tensor([4, 0, 5, 1, 3, 2])  # the group's rows, in any order, into a larger batch
    query = torch.randn(heads, 8, head_dim).to(dtype).transpose(0, 1)  # [N, heads, D], not contiguous
    out = torch.full((8, heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    ops.paged_decode(out, query, key, value, index, torch.tensor(lengths), rows, block_size, scale, 0)
    want = reference(query[rows], key, value, tables, lengths, block_size, scale, 0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), want, atol=tolerance, rtol=tolerance)
    assert out[[6, 7]].isnan().all()  # rows outside the group are not written


def test_paged_decode_sliding_window_and_value_head_size(ops):
    rng = random.Random(7)
    lengths = [5, 40, 129]
    key, value, tables, index = pool_and_tables(rng, 2, 32, 24, lengths, 8, torch.float32)
    query = torch.randn(3, 4, 32)
    out = torch.empty(3, 4, 24)
    ops.paged_decode(out, query, key, value, index, torch.tensor(lengths), torch.arange(3), 8, 0.2, 16)
    torch.testing.assert_close(out, reference(query, key, value, tables, lengths, 8, 0.2, 16), atol=1e-5, rtol=1e-5)


def test_paged_decode_refuses_what_it_cannot_read(ops):
    key = torch.zeros(2, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        ops.paged_decode(torch.empty(1, 3, 16), torch.zeros(1, 3, 16), key, key, torch.zeros(2, dtype=torch.long),
                         torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 16, 1.0, 0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode(torch.empty(1, 2, 16), torch.zeros(1, 2, 16), key, key, torch.zeros(2, dtype=torch.int32),
                         torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 16, 1.0, 0)


def test_an_unbuildable_kernel_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)  # nothing built before: the build path runs
    def no_compiler(**_):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="ringstream.engine"):
        assert kernels.native_ops.__wrapped__() is None
    assert "pure-torch attention: Ninja is required" in caplog.text
    assert not list(tmp_path.iterdir())  # no library kept


def test_a_kept_library_is_loaded_without_a_build(ops, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("rebuilt a kept library"))
    assert kernels.native_ops.__wrapped__() is torch.ops.ringstream


def test_packed_linear_equals_linear_and_keeps_only_shared_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.Linear(64, 50, bias=False))
    model[2].weight = nn.Parameter(torch.randn(50, 64))
    tied = nn.Linear(32, 50, bias=False)
    tied.weight = model[0].weight  # shaped like a tied LM head
    model.append(nn.Identity())
    model.head = tied
    x = torch.randn(3, 7, 32)
    want_mlp, want_head = model[2](model[1](x)), tied(x)
    assert pack_linears(model) == 3
    assert all(isinstance(m, PackedLinear) for m in (model[1], model[2], model.head))
    torch.testing.assert_close(model[2](model[1](x)), want_mlp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.head(x), want_head, atol=1e-4, rtol=1e-4)
    assert model.head.weight is model[0].weight  # shared with the embedding: kept
    assert model[1].weight.numel() == 0 and model[1].weight.dtype == torch.float32  # released, dtype kept


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("native"))
    return model_dir, load_tokenizer(model_dir)


def greedy_outputs(model, tokenizer, native: bool) -> dict[int, list[int]]:
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
                                                   num_blocks=256, native_kernels=native), eos_token_ids=(1,))
    engine.warmup()
    rng = random.Random(3)
    for handle in range(6):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 60))]
        engine.add(EngineRequest(handle, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.handle, []).append(out.token_id)
    return outputs


def test_engine_tokens_are_the_same_with_and_without_the_fast_paths(ops, tiny):
    model_dir, tokenizer = tiny
    plain = greedy_outputs(load_model(model_dir), tokenizer, native=False)
    fast = greedy_outputs(load_model(model_dir), tokenizer, native=True)
    assert fast == plain and all(len(tokens) == 24 for tokens in fast.values())

"""The native prefill attention (``torch.ops.ringstream.paged_prefill``): a prompt chunk's causal attention read in
place from the paged pool, against float64 attention over the gathered context, its refusals, and the engine's
tokens and attention calls with it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.daemon.native_helpers import greedy_outputs, native_ops_or_skip, tiny  # noqa: F401 (fixture)
from tests.factories import load_model


@pytest.fixture(scope="module")
def ops():
    ops = native_ops_or_skip()
    if not ops.paged_prefill_supported(64, 64):
        pytest.skip("the native prefill attention needs AVX-512")
    return ops


def chunk_case(seed, kv_heads, group, head_dim, value_dim, context_start, num_query, block_size, dtype,
               row_start=3, extra_rows=2):
    """A pool holding one sequence's ``context_start + num_query`` positions in shuffled blocks, and a query batch
    whose rows ``[row_start, row_start + num_query)`` are the chunk (``[N, heads, D]``, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    length = context_start + num_query
    blocks = -(-length // block_size)
    pool_blocks = blocks + 5
    table = torch.randperm(pool_blocks, generator=g)[:blocks].long()
    key = torch.randn(kv_heads, pool_blocks * block_size, head_dim, generator=g).to(dtype)
    value = torch.randn(kv_heads, pool_blocks * block_size, value_dim, generator=g).to(dtype)
    rows = row_start + num_query + extra_rows
    query = torch.randn(1, kv_heads * group, rows, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    slots = (table.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:length]
    return query, key, value, table, slots


def reference(query, key, value, slots, context_start, scale, window):
    """float64 SDPA of ``query [n, heads, D]`` at positions ``context_start ...`` over the gathered context."""
    n = query.shape[0]
    k, v = key[:, slots].double(), value[:, slots].double()
    query_pos = torch.arange(context_start, context_start + n).unsqueeze(1)
    key_pos = torch.arange(k.shape[1]).unsqueeze(0)
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(query.double().transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, heads, value_dim]


def run(ops, query, key, value, table, row_start, num_query, context_start, block_size, scale, window=0, out=None):
    if out is None:
        out = torch.full((query.shape[0], query.shape[1], value.shape[-1]), float("nan"), dtype=query.dtype)
    ops.paged_prefill(out, query, key, value, table, row_start, num_query, context_start, block_size, scale, window)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("context_start, num_query", [(0, 1), (0, 33), (0, 256), (17, 16), (100, 65), (500, 31)])
def test_paged_prefill_equals_attention_over_the_gathered_context(ops, dtype, group, context_start, num_query):
    # query tiles of 32 positions and key tiles of 64: chunks on and off those edges, contexts inside a block
    query, key, value, table, slots = chunk_case(group * 1000 + num_query, 2, group, 64, 64, context_start, num_query,
                                                 16, dtype)
    out = run(ops, query, key, value, table, 3, num_query, context_start, 16, 0.125)
    want = reference(query[3:3 + num_query], key, value, slots, context_start, 0.125, 0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[3:3 + num_query].double(), want, atol=tolerance, rtol=tolerance)
    assert out[:3].isnan().all() and out[3 + num_query:].isnan().all()  # rows outside the chunk are not written


@pytest.mark.parametrize("head_dim, value_dim, window, block_size", [(16, 16, 1, 1), (32, 48, 5, 4), (128, 64, 100, 16),
                                                                     (64, 16, 64, 32), (48, 32, 0, 3)])
def test_paged_prefill_sliding_window_block_size_and_value_head_size(ops, head_dim, value_dim, window, block_size):
    for seed, (context_start, num_query) in enumerate([(0, 70), (130, 40), (7, 1)]):
        query, key, value, table, slots = chunk_case(seed, 3, 2, head_dim, value_dim, context_start, num_query,
                                                     block_size, torch.float32)
        out = run(ops, query, key, value, table, 3, num_query, context_start, block_size, 0.3, window)
        want = reference(query[3:3 + num_query], key, value, slots, context_start, 0.3, window)
        torch.testing.assert_close(out[3:3 + num_query].double(), want, atol=1e-5, rtol=1e-5)


def test_a_window_wider_than_any_position_is_full_causal_attention(ops):
    query, key, value, table, slots = chunk_case(3, 2, 2, 64, 64, 100, 40, 16, torch.float32, row_start=0,
                                                 extra_rows=0)
    want = reference(query, key, value, slots, 100, 0.125, 0)
    for window in (140, 2 ** 31, 2 ** 32 + 5, 2 ** 40):  # past int32 too: never wrapped into a narrow window
        out = run(ops, query, key, value, table, 0, 40, 100, 16, 0.125, window)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_paged_prefill_fuzz_against_float64(ops):
    rng = random.Random(11)
    for case in range(60):
        kv_heads, group = rng.choice([1, 2, 5]), rng.choice([1, 2, 3, 4, 7])
        head_dim = rng.choice([16, 32, 64, 128])
        value_dim = rng.choice([head_dim, 16, 48])
        context_start, num_query = rng.choice([0, 1, 15, 63, 64, 65, 300]), rng.choice([1, 2, 31, 32, 33, 97])
        block_size, window = rng.choice([1, 5, 16, 32]), rng.choice([0, 0, 1, 7, 64])
        query, key, value, table, slots = chunk_case(case, kv_heads, group, head_dim, value_dim, context_start,
                                                     num_query, block_size, torch.float32, row_start=0, extra_rows=0)
        out = run(ops, query, key, value, table, 0, num_query, context_start, block_size, head_dim ** -0.5, window)
        want = reference(query, key, value, slots, context_start, head_dim ** -0.5, window)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"case {case}: {m}")


@pytest.mark.parametrize("where", ["query", "visible_key", "inf_score"])
def test_paged_prefill_propagates_nan_and_inf_as_attention_does(ops, where):
    query, key, value, table, slots = chunk_case(5, 1, 2, 16, 16, 0, 40, 16, torch.float32, row_start=0,
                                                 extra_rows=0)
    query = query.abs()
    want = reference(query, key, value, slots, 0, 0.25, 0)  # what the rows that never see the bad value give
    if where == "query":
        query[20, 1, 3] = float("nan")
        want[20, 1] = float("nan")
    elif where == "visible_key":
        key[0, slots[30], 2] = float("nan")  # seen by positions 30 and after only
        want[30:] = float("nan")
    else:  # a score of +inf: inf - inf in the softmax, for positions 10 and after
        key[0, slots[10], 2] = float("inf")
        want[10:] = float("nan")
    out = run(ops, query, key, value, table, 0, 40, 0, 16, 0.25)
    assert torch.equal(out.isnan(), want.isnan())
    torch.testing.assert_close(out[~out.isnan()].double(), want[~want.isnan()], atol=1e-5, rtol=1e-5)


def test_paged_prefill_refuses_shapes_and_indices_it_would_read_past(ops):
    query, key, value, table, _ = chunk_case(1, 2, 2, 16, 16, 10, 20, 8, torch.float32, row_start=0, extra_rows=0)

    def call(**changed):
        args = dict(out=torch.empty(20, 4, 16), query=query, key=key, value=value, table=table, row_start=0,
                    num_query=20, context_start=10, block_size=8)
        args.update(changed)
        ops.paged_prefill(args["out"], args["query"], args["key"], args["value"], args["table"], args["row_start"],
                          args["num_query"], args["context_start"], args["block_size"], 0.25, 0)

    call()  # the unchanged call is fine
    with pytest.raises(RuntimeError, match="out must be"):
        call(out=torch.empty(20, 4, 8))
    with pytest.raises(RuntimeError, match="outside the 20 query rows"):
        call(row_start=1)
    with pytest.raises(RuntimeError, match="cannot hold 33 positions"):
        call(context_start=13)
    with pytest.raises(RuntimeError, match="outside the pool"):
        call(table=torch.tensor([0, 1, 99, 2], dtype=torch.long))
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        call(query=torch.zeros(20, 3, 16), out=torch.empty(20, 3, 16))
    with pytest.raises(RuntimeError, match="multiples of 16"):
        call(query=torch.zeros(20, 4, 24), key=torch.zeros(2, key.shape[1], 24))
    with pytest.raises(RuntimeError, match="block_size must be > 0"):
        call(block_size=0)
    with pytest.raises(RuntimeError, match="kv_heads"):
        call(key=torch.empty(0, 64, 16), value=torch.empty(0, 64, 16))
    guard = torch.full((21, 4, 16), 7.0)  # out = guard[1:]: a write before row 0 would land in guard[0]
    with pytest.raises(RuntimeError, match="outside the 20 query rows"):  # row_start + num_query overflows int64
        call(out=guard[1:], row_start=2 ** 63 - 1, num_query=1)
    assert (guard[0] == 7.0).all()
    with pytest.raises(RuntimeError, match="context_start"):  # context_start + num_query overflows
        call(context_start=2 ** 63 - 1, num_query=1)
    assert not ops.paged_prefill_supported(40, 40) and not ops.paged_prefill_supported(64, 40)


class Spy:
    """``torch.ops.ringstream`` with its ``paged_prefill`` calls counted."""

    def __init__(self, ops):
        self.ops, self.prefill_calls = ops, 0

    def paged_prefill(self, *args):
        self.prefill_calls += 1
        return self.ops.paged_prefill(*args)

    def __getattr__(self, name):
        return getattr(self.ops, name)


def test_engine_prompt_chunks_take_the_native_prefill_and_keep_their_tokens(ops, tiny):  # noqa: F811
    # the tiny model's heads are 16 wide: its chunks (32 tokens a step, prompts up to 60) take the kernel, some at
    # a context start past 0; its greedy tokens equal the engine's without native kernels
    model_dir, tokenizer = tiny
    plain = greedy_outputs(load_model(model_dir), tokenizer, native=False)
    spies = []

    def wrap(engine):
        spies.append(Spy(engine._runner.native))
        engine._runner.native = spies[-1]

    fast = greedy_outputs(load_model(model_dir), tokenizer, native=True, before_run=wrap)
    assert fast == plain and all(len(tokens) == 24 for tokens in fast.values())
    assert spies[0].prefill_calls >= 2 * 6  # two layers, six prompts of at least one chunk each

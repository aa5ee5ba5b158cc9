"""The engine's attention (daemon.attention) and its metadata (daemon.kv_cache).

* ``dense_attention`` (a forward that is not an engine step) equals SDPA;
* ``paged_attention`` over a hand-built :class:`PagedKVCache` equals attention
  of each sequence over its own contiguous keys and values: decode rows of
  very different lengths (several decode groups), prefill chunks that start a
  sequence or continue it after a cached prefix, grouped-query attention,
  float32 and bfloat16;
* a fresh pool is zeroed, whatever memory it reuses;
* ``build_metadata`` groups decode rows by the rule of ``DECODE_GROUP_RATIO`` /
  ``DECODE_GROUP_MIN_TOKENS`` and maps each token to its slot;
* ``use_paged_attention`` switches a model; a bfloat16 engine runs.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import ringstream.daemon.engine.kv_cache as kv_cache
from ringstream.daemon.engine.attention import PAGED_ATTENTION, dense_attention, paged_attention, use_paged_attention
from ringstream.daemon.engine.block_manager import NULL_BLOCK
from ringstream.daemon.engine.engine import Engine, EngineRequest, SamplingParams, EngineConfig
from ringstream.daemon.engine.kv_cache import DECODE_GROUP_MIN_TOKENS, DECODE_GROUP_RATIO, PagedKVCache, build_metadata
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class _Module:
    """The attributes transformers' SDPA path reads from an attention layer."""

    is_causal = True
    training = False

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.num_key_value_groups = heads // kv_heads


def _reference(query, key, value, allowed, scaling):
    """Attention in float64 of ``query [b, heads, q, D]`` over ``key, value [b, kv_heads, T, D]``.

    ``allowed`` (bool, broadcastable to ``[b, heads, q, T]``) marks the keys each query sees.
    Query head ``i`` reads kv head ``i // (heads / kv_heads)``. Returns ``[b, q, heads, D]``.
    """
    group = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(group, dim=1)
    value = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ key.transpose(-1, -2) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ value).transpose(1, 2)


def _causal(num_query: int, start: int, kv_len: int) -> torch.Tensor:
    """``[num_query, kv_len]``: query ``i`` (at position ``start + i``) sees positions ``<= start + i``."""
    return torch.arange(kv_len).unsqueeze(0) <= torch.arange(start, start + num_query).unsqueeze(1)


# ---------------------------------------------------------------- dense_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_dense_decode_matches_sdpa(dtype, heads, kv_heads):
    """One-token queries over padded rows (additive mask): SDPA in float32, the two matmuls in bfloat16."""
    torch.manual_seed(0)
    rows, keys, head_dim = 5, 17, 16
    query = torch.randn(rows, heads, 1, head_dim, dtype=dtype)
    key = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype)
    value = torch.randn(rows, kv_heads, keys, head_dim, dtype=dtype)
    lengths = torch.tensor([1, 4, 9, 16, 17])
    allowed = (torch.arange(keys) < lengths.unsqueeze(1)).view(rows, 1, 1, keys)
    mask = torch.zeros(rows, 1, 1, keys, dtype=dtype).masked_fill(~allowed, float("-inf"))
    out, weights = dense_attention(_Module(heads, kv_heads), query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (rows, 1, heads, head_dim) and out.dtype == dtype
    expected = _reference(query, key, value, allowed, 0.3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # a row that may attend to its first key only: masked keys get no weight at all
    torch.testing.assert_close(out[0, 0].float(), value[0, :, 0].float().repeat_interleave(heads // kv_heads, 0),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_decode_without_mask_attends_every_key(dtype):
    torch.manual_seed(1)
    query = torch.randn(3, 8, 1, 16, dtype=dtype)
    key, value = (torch.randn(3, 2, 11, 16, dtype=dtype) for _ in range(2))
    out, _ = dense_attention(_Module(8, 2), query, key, value, None)  # default scale head_dim ** -0.5
    expected = _reference(query, key, value, torch.ones(1, 1, 1, 11, dtype=torch.bool), 16 ** -0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_prefill_is_causal_sdpa(dtype):
    torch.manual_seed(2)
    query = torch.randn(2, 4, 6, 8, dtype=dtype)
    key, value = (torch.randn(2, 2, 6, 8, dtype=dtype) for _ in range(2))
    out, _ = dense_attention(_Module(4, 2), query, key, value, None, scaling=8 ** -0.5)
    expected = _reference(query, key, value, _causal(6, 0, 6), 8 ** -0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------- paged_attention

BLOCK_SIZE = 4
DECODE_LENGTHS = [601, 250, 100, 17, 3, 1, 240]
"""Context lengths (the new token included) of the decode rows: 601 | 250, 240 | 100, 17, 3, 1."""
PREFILLS = [(0, 9), (16, 7), (5, 6), (0, 1), (33, 1)]
"""``(start, num_query)`` of the prefill chunks: from position 0; after a cached prefix of four blocks;
after an earlier chunk that ended mid-block; a one-token prompt; one token after a prefix."""


class PagedCase:
    """A KV pool holding one sequence per decode row and prefill chunk, with each sequence's contiguous K/V.

    Every sequence has random keys and values for all its positions and a
    block table of pool blocks in random order. Positions before the step's
    new tokens are written to the pool beforehand; the new tokens' keys and
    values go through :meth:`PagedKVCache.update`, as in a forward.
    Unused pool slots hold ``fill`` (keys and values left by earlier sequences).
    """

    def __init__(self, dtype, heads, kv_heads, head_dim=8, fill=1e4, seed=0, value_head_dim=None) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.value_head_dim = value_head_dim = value_head_dim or head_dim
        lengths = DECODE_LENGTHS + [start + n for start, n in PREFILLS]
        starts = [n - 1 for n in DECODE_LENGTHS] + [start for start, _ in PREFILLS]
        need = [math.ceil(n / BLOCK_SIZE) for n in lengths]
        num_blocks = 1 + sum(need) + 10
        ids = list(range(1, num_blocks))
        rng.shuffle(ids)
        self.tables = []
        for n in need:
            self.tables.append(ids[:n])
            ids = ids[n:]
        self.cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, CPU, value_head_dim)
        keys, values = self.cache.key_cache[0], self.cache.value_cache[0]
        keys[:, BLOCK_SIZE:] = fill
        values[:, BLOCK_SIZE:] = fill
        self.k = [torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(kv_heads, n, value_head_dim, generator=gen).to(dtype) for n in lengths]
        self.starts, self.lengths = starts, lengths
        for table, start, k, v in zip(self.tables, starts, self.k, self.v):
            slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start)],
                                 dtype=torch.long)
            keys[:, slots] = k[:, :start]
            values[:, slots] = v[:, :start]
        n_dec = len(DECODE_LENGTHS)
        self.meta = build_metadata(
            [(self.tables[i], starts[i]) for i in range(n_dec)],
            [(self.tables[n_dec + j], start, n) for j, (start, n) in enumerate(PREFILLS)],
            BLOCK_SIZE, CPU,
        )
        # packed rows: decodes, then each chunk's tokens
        self.rows = [(i, starts[i], 1) for i in range(n_dec)]
        self.rows += [(n_dec + j, start, n) for j, (start, n) in enumerate(PREFILLS)]
        num_tokens = sum(n for _, _, n in self.rows)
        self.query = torch.randn(1, heads, num_tokens, head_dim, generator=gen).to(dtype)

    def attend(self, scaling=None):
        self.cache.slot_mapping = self.meta.slot_mapping
        new_k = torch.cat([self.k[s][:, start:start + n] for s, start, n in self.rows], dim=1).unsqueeze(0)
        new_v = torch.cat([self.v[s][:, start:start + n] for s, start, n in self.rows], dim=1).unsqueeze(0)
        keys, values = self.cache.update(new_k, new_v, 0)
        assert keys.data_ptr() == self.cache.key_cache[0].data_ptr()
        module = _Module(self.heads, self.kv_heads)
        return paged_attention(module, self.query, keys, values, None, scaling=scaling, paged=self.meta)

    def expected(self, scaling):
        """Per sequence: its new queries over its own contiguous K/V, causally."""
        parts, row = [], 0
        for s, start, n in self.rows:
            q = self.query[:, :, row:row + n]
            k, v = self.k[s].unsqueeze(0), self.v[s].unsqueeze(0)
            parts.append(_reference(q, k, v, _causal(n, start, start + n), scaling)[0])
            row += n
        return torch.cat(parts, dim=0).unsqueeze(0)


@pytest.mark.parametrize("max_mask_elements", [kv_cache.MAX_MASK_ELEMENTS, 40], ids=["one-piece", "split"])
@pytest.mark.parametrize("dtype, heads, kv_heads", [
    (torch.float32, 4, 2), (torch.float32, 2, 2), (torch.bfloat16, 4, 2), (torch.bfloat16, 8, 1),
])
def test_paged_attention_matches_per_sequence_attention(monkeypatch, dtype, heads, kv_heads, max_mask_elements):
    monkeypatch.setattr(kv_cache, "MAX_MASK_ELEMENTS", max_mask_elements)
    case = PagedCase(dtype, heads, kv_heads)
    assert len(case.meta.decode_groups) == 3
    if max_mask_elements == 40:
        assert all(len(chunk.splits) > 1 for chunk in case.meta.prefill_chunks if chunk.num_query > 1)
    out, weights = case.attend()
    assert weights is None
    assert out.shape == (1, case.meta.num_tokens, heads, case.head_dim) and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), case.expected(case.head_dim ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_may_have_their_own_head_size(dtype):
    """Keys of 8 and values of 12 per head (as in MLA's expanded form): the output has the values' size."""
    case = PagedCase(dtype, 4, 2, value_head_dim=12)
    assert case.cache.value_cache[0].shape[-1] == 12
    assert PagedKVCache.bytes_per_block(1, BLOCK_SIZE, 2, 8, dtype.itemsize, 12) == case.cache.nbytes // case.cache.num_blocks
    out, _ = case.attend()
    assert out.shape == (1, case.meta.num_tokens, 4, 12)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), case.expected(8 ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("value_head_dim", [None, 12])
def test_paged_attention_reuses_a_scratch_buffer(value_head_dim):
    """Gathers into one dirty, oversized buffer shared by every call give the same result, call after call."""
    case = PagedCase(torch.float32, 4, 2, value_head_dim=value_head_dim)
    scratch = case.cache.scratch(case.meta.max_gather_blocks + 7)
    scratch.fill_(float("nan"))
    assert case.cache.scratch(case.meta.max_gather_blocks) is scratch  # grown, never shrunk
    case.meta.scratch = scratch
    expected = case.expected(case.head_dim ** -0.5)
    for _ in range(2):
        out, _ = case.attend()
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_uses_the_given_scale():
    case = PagedCase(torch.float32, 4, 2)
    out, _ = case.attend(scaling=0.1)
    torch.testing.assert_close(out.double(), case.expected(0.1), atol=1e-5, rtol=1e-5)


def test_update_writes_new_keys_at_their_slots_only():
    case = PagedCase(torch.float32, 4, 2, fill=0.5)
    before = case.cache.key_cache[0].clone()
    case.attend()
    after = case.cache.key_cache[0]
    written = case.meta.slot_mapping
    changed = (after != before).any(dim=2).any(dim=0).nonzero().flatten()
    assert set(changed.tolist()) <= set(written.tolist())
    for s, start, n in case.rows:
        table = case.tables[s]
        for p in range(start, start + n):
            slot = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            torch.testing.assert_close(after[:, slot], case.k[s][:, p])
    assert not after[:, :BLOCK_SIZE].any()  # the null block stays zero


def test_fresh_pool_is_zeroed_over_dirty_memory():
    """Decode rows read whole blocks; slots past a row's end must hold zeros (or a model's old keys), never NaN.

    Buffers of the pool's size full of NaN are freed first, so the allocator has dirty memory to hand out.
    """
    junk = [torch.full((2, 64 * BLOCK_SIZE, 8), float("nan")) for _ in range(8)]
    del junk
    cache = PagedKVCache(2, 64, BLOCK_SIZE, 2, 8, torch.float32, CPU)
    for buf in cache.key_cache + cache.value_cache:
        assert buf.shape == (2, 64 * BLOCK_SIZE, 8)
        assert torch.count_nonzero(buf) == 0  # NaN counts as non-zero
    assert cache.nbytes == 4 * 2 * 64 * BLOCK_SIZE * 8 * 4
    assert cache.nbytes == 64 * PagedKVCache.bytes_per_block(2, BLOCK_SIZE, 2, 8, 4)


# ---------------------------------------------------------------- build_metadata


def _tables(lengths, block_size):
    """Disjoint block tables (ids from 1) for sequences of ``lengths`` positions."""
    tables, next_id = [], 1
    for n in lengths:
        count = math.ceil(n / block_size)
        tables.append(list(range(next_id, next_id + count)))
        next_id += count
    return tables


def _joins(length, longest):
    return length >= longest * DECODE_GROUP_RATIO or longest - length <= DECODE_GROUP_MIN_TOKENS


@pytest.mark.parametrize("lengths, groups", [
    (DECODE_LENGTHS, [[601], [250, 240], [100, 17, 3, 1]]),
    # at the ratio, one token under it
    ([4 * DECODE_GROUP_MIN_TOKENS, 2 * DECODE_GROUP_MIN_TOKENS, 2 * DECODE_GROUP_MIN_TOKENS - 1],
     [[4 * DECODE_GROUP_MIN_TOKENS, 2 * DECODE_GROUP_MIN_TOKENS], [2 * DECODE_GROUP_MIN_TOKENS - 1]]),
    # within DECODE_GROUP_MIN_TOKENS of the longest, one token further
    ([DECODE_GROUP_MIN_TOKENS + 10, 10, 9], [[DECODE_GROUP_MIN_TOKENS + 10, 10], [9]]),
    # all short: one group
    ([5, 1, 77, 128, 3], [[128, 77, 5, 3, 1]]),
])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_groups_follow_the_rule(lengths, groups, block_size):
    tables = _tables(lengths, block_size)
    meta = build_metadata([(t, n - 1) for t, n in zip(tables, lengths)], [], block_size, CPU)
    got = [[lengths[r] for r in group.rows.tolist()] for group in meta.decode_groups]
    assert got == groups
    assert sorted(r for group in meta.decode_groups for r in group.rows.tolist()) == list(range(len(lengths)))
    for index, group in enumerate(meta.decode_groups):
        members = group.rows.tolist()
        longest = lengths[members[0]]
        # no row pads beyond the rule, and the next group's longest row could not have joined
        assert all(_joins(lengths[r], longest) for r in members)
        if index + 1 < len(meta.decode_groups):
            assert not _joins(lengths[meta.decode_groups[index + 1].rows[0].item()], longest)
        width = math.ceil(longest / block_size)
        assert group.kv_valid.shape == (len(members), 1, 1, width * block_size)
        assert group.kv_valid.dtype == torch.bool
        blocks = group.block_index.view(len(members), width).tolist()
        for i, r in enumerate(members):
            n = lengths[r]
            assert group.kv_valid[i, 0, 0].tolist() == [p < n for p in range(width * block_size)]
            used = math.ceil(n / block_size)
            assert blocks[i] == tables[r][:used] + [NULL_BLOCK] * (width - used)
    assert meta.num_tokens == len(lengths) and meta.prefill_chunks == []


def test_slot_mapping_and_chunk_layout():
    block_size = 4
    decodes = [([7, 3], 5), ([9], 0)]
    prefills = [([2, 8, 6], 3, 6), ([5, 1], 0, 5)]
    meta = build_metadata(decodes, prefills, block_size, CPU)
    expected = [3 * 4 + 1, 9 * 4 + 0]  # decode rows
    expected += [2 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 6 * 4 + 0]  # positions 3..8
    expected += [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0]  # positions 0..4
    assert meta.slot_mapping.tolist() == expected
    assert meta.num_tokens == 13 and meta.block_size == block_size
    first, second = meta.prefill_chunks
    assert (first.start, first.num_query, first.block_index.tolist()) == (2, 6, [2, 8, 6])
    assert (second.start, second.num_query, second.block_index.tolist()) == (8, 5, [5, 1])
    # a chunk after earlier positions needs a mask; one that starts its sequence is causal as it is
    ((q_begin, q_end, kv_end, mask),) = first.splits
    assert (q_begin, q_end, kv_end) == (0, 6, 9)
    assert torch.equal(mask, _causal(6, 3, 9))
    assert second.splits == [(0, 5, 5, None)]


def test_long_prefill_mask_is_split(monkeypatch):
    monkeypatch.setattr(kv_cache, "MAX_MASK_ELEMENTS", 100)
    meta = build_metadata([], [(list(range(1, 11)), 10, 30)], 4, CPU)
    (chunk,) = meta.prefill_chunks
    pieces = [(q0, q1, kv) for q0, q1, kv, _ in chunk.splits]
    assert pieces == [(q, q + 2, 12 + q) for q in range(0, 30, 2)]  # 2 queries x at most 40 keys
    for q0, q1, kv_end, mask in chunk.splits:
        assert mask.numel() <= 100
        assert torch.equal(mask, _causal(q1 - q0, 10 + q0, kv_end))


# ---------------------------------------------------------------- models


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


def test_use_paged_attention_switches_the_model(model_dir):
    model = load_model(model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        stock = model(input_ids=ids).logits
    assert model.config._attn_implementation == "sdpa"
    use_paged_attention(model)
    assert model.config._attn_implementation == PAGED_ATTENTION
    # without engine metadata the model still runs: dense attention, the same logits
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, stock)
    with pytest.raises(ValueError, match="cannot use the paged attention"):
        use_paged_attention(object())


def test_bfloat16_engine_runs(model_dir):
    model = load_model(model_dir).to(torch.bfloat16)
    finite = []
    hook = model.register_forward_hook(lambda module, args, out: finite.append(bool(out.logits.isfinite().all())))
    config = EngineConfig(max_num_seqs=5, max_num_batched_tokens=8, block_size=4, num_blocks=64, max_model_len=128)
    engine = Engine(model, load_tokenizer(model_dir), config)
    assert model.config._attn_implementation == PAGED_ATTENTION
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], list(range(20, 45)), list(range(20, 39)) + [3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
    try:
        for request in requests[:4]:
            engine.add(request)
        for _ in range(3):
            engine.step()
        engine.add(requests[4])  # shares blocks with request 3
        while engine.has_unfinished():
            engine.step()
    finally:
        hook.remove()
    assert finite and all(finite)
    vocab = model.config.vocab_size
    assert all(len(r.output_token_ids) == 12 and all(0 <= t < vocab for t in r.output_token_ids) for r in requests)
    assert engine.stats().prefix_hits > 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks

    # the dense path of the switched model: one decode step reproduces the prefill's last position
    ids = torch.tensor([prompts[2]])
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1].float()
        first = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], cache=first.past_key_values).logits[0, -1].float()
    assert step.isfinite().all()
    torch.testing.assert_close(step, full, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,group,rows,length,head_dim,value_dim",
                         [(4, 3, 16, 96, 64, 64), (2, 1, 5, 33, 32, 16), (1, 8, 3, 40, 16, 16), (8, 4, 1, 17, 8, 8)])
def test_kv_head_major_decode_matmul_matches_the_row_major_one(dtype, kv_heads, group, rows, length, head_dim,
                                                              value_dim):
    from ringstream.daemon.engine.attention import _decode_matmul, decode_matmul_kv_major

    torch.manual_seed(kv_heads * 100 + length)
    q = torch.randn(rows, kv_heads * group, head_dim).to(dtype)
    k = torch.randn(kv_heads, rows, length, head_dim).to(dtype)
    v = torch.randn(kv_heads, rows, length, value_dim).to(dtype)
    valid = torch.rand(rows, 1, 1, length) > 0.3
    valid[:, ..., 0] = True  # every row reads one position at least
    got = decode_matmul_kv_major(q, k, v, valid, 0.125)
    assert got.shape == (rows, kv_heads * group, value_dim) and got.dtype == dtype
    # the same sums in another batch layout: equal, or a rounding apart where the CPU's reduced-precision matmul
    # kernel accumulates a layout in another order (float16 on one thread, on some hosts)
    want = _decode_matmul(q, k.transpose(0, 1), v.transpose(0, 1), valid, 0.125)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

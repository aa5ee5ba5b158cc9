"""Block manager driven by hand-made token lists: paging, prefix caching, reference counts, eviction. No torch."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringstream.daemon.engine.block_manager import (
    NULL_BLOCK, BlockManager, BlocksCleared, BlocksRemoved, BlocksStored, NoFreeBlocks,
)
from ringstream.daemon.common.prefix_hash import block_hashes, hash_block_tokens

BS = 4  # block size of the hand-made cases


def make(num_blocks=9, block_size=BS, caching=True):
    return BlockManager(num_blocks, block_size, enable_prefix_caching=caching)


def prompt(bm, seq_id, tokens, max_cached=None):
    """Allocate a prompt the way the engine does: the last token is always computed."""
    hashes = block_hashes(tokens, bm.block_size)
    return bm.allocate(seq_id, len(tokens), hashes, len(tokens) - 1 if max_cached is None else max_cached)


def run(bm, seq_id, tokens, max_cached=None):
    """Allocate a prompt, compute all of it and register its full blocks."""
    cached = prompt(bm, seq_id, tokens, max_cached)
    bm.cache_blocks(seq_id, tokens, len(tokens))
    return cached


def toks(start, n):
    return list(range(start, start + n))


def snapshot(bm):
    """Everything the manager holds, for 'nothing changed' checks."""
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in bm._blocks],
        [b.block_id for b in bm._free_uncached],
        list(bm._free_cached),
        {key: b.block_id for key, b in bm._cached.items()},
        {s: ([b.block_id for b in t.blocks], list(t.hashes)) for s, t in bm._tables.items()},
        bm.prefix_queries,
        bm.prefix_hits,
    )


def check_accounting(bm):
    live = [block for seq_id in bm._tables for block in bm.block_table(seq_id)]
    free = [b.block_id for b in bm._free_uncached] + list(bm._free_cached)
    assert NULL_BLOCK not in live and NULL_BLOCK not in free
    assert len(free) == len(set(free)) == bm.num_free_blocks
    assert not set(free) & set(live)
    assert bm.num_free_blocks + len(set(live)) == bm.num_usable_blocks
    assert 0.0 <= bm.usage <= 1.0


# -- construction and figures ---------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(1, 16), (0, 16), (-3, 16), (4, 0), (4, -1)])
def test_constructor_rejects_sizes_out_of_range(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_smallest_pool_has_one_usable_block():
    bm = BlockManager(2, 1)
    assert bm.num_usable_blocks == bm.num_free_blocks == 1 and bm.usage == 0.0
    assert bm.allocate(0, 1) == 0
    assert bm.block_table(0) == [1] and bm.usage == 1.0 and bm.num_free_blocks == 0
    assert not bm.can_allocate(1)


def test_default_block_size_is_sixteen():
    assert BlockManager(4).block_size == 16


@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (400, 100)])
def test_blocks_for_rounds_up(num_tokens, blocks):
    assert make().blocks_for(num_tokens) == blocks


# -- allocate / block_table / free ----------------------------------------------


def test_allocate_hands_out_unique_blocks_never_the_null_block():
    bm = make(num_blocks=17)
    sizes = {0: 1, 1: 4, 2: 5, 3: 13, 4: 8, 5: 9}
    for seq_id, n in sizes.items():
        assert bm.allocate(seq_id, n) == 0
        assert len(bm.block_table(seq_id)) == bm.num_blocks_of(seq_id) == bm.blocks_for(n)
        check_accounting(bm)
    ids = [b for seq_id in sizes for b in bm.block_table(seq_id)]
    assert len(ids) == len(set(ids)) == sum(bm.blocks_for(n) for n in sizes.values()) == 13
    assert NULL_BLOCK not in ids and all(0 < b < bm.num_blocks for b in ids)
    assert bm.num_free_blocks == 16 - 13
    assert bm.usage == pytest.approx(13 / 16)


def test_usage_runs_from_zero_to_one_and_back():
    bm = make(num_blocks=5)
    assert bm.usage == 0.0
    for seq_id in range(4):
        bm.allocate(seq_id, BS)
        assert bm.usage == pytest.approx((seq_id + 1) / 4)
    assert bm.usage == 1.0 and bm.num_free_blocks == 0
    for seq_id in range(4):
        bm.free(seq_id)
    assert bm.usage == 0.0 and bm.num_free_blocks == 4


def test_block_table_is_a_copy_and_unknown_ids_are_reported():
    bm = make()
    bm.allocate(7, 9)
    table = bm.block_table(7)
    table.append(99)
    assert len(bm.block_table(7)) == 3
    assert 7 in bm and 8 not in bm
    assert bm.num_blocks_of(8) == 0
    with pytest.raises(KeyError):
        bm.block_table(8)
    with pytest.raises(KeyError):
        bm.append_slots(8, 4)
    with pytest.raises(KeyError):
        bm.cache_blocks(8, toks(0, 4), 4)


def test_free_returns_every_block_and_ignores_unknown_ids():
    bm = make()
    bm.allocate(0, 10)
    bm.allocate(1, 3)
    bm.free(0)
    assert 0 not in bm and bm.num_free_blocks == 8 - 1
    check_accounting(bm)
    before = snapshot(bm)
    bm.free(0)  # already freed
    bm.free(42)  # never known
    assert snapshot(bm) == before
    bm.free(1)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_freed_blocks_are_handed_out_again():
    bm = make(num_blocks=3)
    bm.allocate(0, 2 * BS)
    first = bm.block_table(0)
    bm.free(0)
    bm.allocate(1, 2 * BS)
    assert sorted(bm.block_table(1)) == sorted(first)


def test_allocate_rejects_a_known_sequence_and_empty_allocations():
    bm = make()
    bm.allocate(0, 5)
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.allocate(0, 5)
    with pytest.raises(ValueError):
        bm.allocate(1, 0)
    with pytest.raises(ValueError):
        bm.allocate(2, -1)
    assert snapshot(bm) == before and 1 not in bm and 2 not in bm


def test_no_free_blocks_changes_nothing():
    bm = make(num_blocks=5)
    bm.allocate(0, 2 * BS)
    before = snapshot(bm)
    assert not bm.can_allocate(2 * BS + 1)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1, 2 * BS + 1)
    assert snapshot(bm) == before and 1 not in bm
    assert bm.can_allocate(2 * BS)
    bm.allocate(1, 2 * BS)
    assert bm.num_free_blocks == 0


def test_no_free_blocks_with_a_cached_prefix_keeps_the_prefix_on_the_free_list():
    bm = make(num_blocks=5)
    tokens = toks(0, 2 * BS)
    run(bm, 0, tokens)
    bm.free(0)
    before = snapshot(bm)
    longer = tokens + toks(100, 3 * BS)  # 5 blocks, 2 of them cached: more than the 4 usable
    assert not bm.can_allocate(len(longer), block_hashes(longer, BS), len(longer) - 1)
    with pytest.raises(NoFreeBlocks):
        prompt(bm, 1, longer)
    assert snapshot(bm) == before
    assert prompt(bm, 2, tokens + [9]) == 2 * BS


# -- append_slots -----------------------------------------------------------------


def test_append_slots_grows_on_block_boundaries_only():
    bm = make()
    bm.allocate(0, 1)
    table = bm.block_table(0)
    for n in range(1, BS + 1):
        assert bm.append_slots(0, n)
        assert bm.block_table(0) == table
    assert bm.append_slots(0, BS + 1)
    grown = bm.block_table(0)
    assert grown[:1] == table and len(grown) == 2 and grown[1] not in (NULL_BLOCK, table[0])
    assert bm.append_slots(0, 4 * BS + 1)  # several blocks at once
    assert len(bm.block_table(0)) == 5 and bm.block_table(0)[:2] == grown
    assert bm.append_slots(0, 3)  # fewer positions than held: no shrink
    assert len(bm.block_table(0)) == 5
    check_accounting(bm)


def test_append_slots_out_of_blocks_returns_false_and_changes_nothing():
    bm = make(num_blocks=4)
    bm.allocate(0, BS)
    bm.allocate(1, BS)
    before = snapshot(bm)
    assert not bm.append_slots(0, 2 * BS + 1)  # needs 2 more, 1 free
    assert snapshot(bm) == before
    assert bm.append_slots(0, 2 * BS)
    assert bm.num_free_blocks == 0
    before = snapshot(bm)
    assert not bm.append_slots(1, BS + 1)
    assert snapshot(bm) == before
    assert bm.append_slots(1, BS)  # already held


def test_append_slots_evicts_cached_blocks_when_needed():
    bm = make(num_blocks=3)
    run(bm, 0, toks(0, BS))
    bm.free(0)
    bm.allocate(1, 1)
    assert bm.append_slots(1, BS + 1)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    assert bm.cached_prefix(block_hashes(toks(0, BS), BS), BS) == 0


# -- prefix keys -------------------------------------------------------------------


def test_block_key_is_a_sha256_digest_of_parent_and_tokens():
    key = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(key, bytes) and len(key) == 32
    assert key == hash_block_tokens(None, (1, 2, 3, 4))
    assert key != hash_block_tokens(None, [1, 2, 3, 5])
    assert key != hash_block_tokens(None, [4, 3, 2, 1])
    assert key != hash_block_tokens(hash_block_tokens(None, [0] * 4), [1, 2, 3, 4])


def test_keys_are_chained_through_the_parent():
    a = toks(0, BS) + toks(100, BS)
    b = toks(50, BS) + toks(100, BS)  # same second block, different first block
    ka, kb = block_hashes(a, BS), block_hashes(b, BS)
    assert ka[1] != kb[1]
    assert ka[1] == hash_block_tokens(ka[0], toks(100, BS))
    assert ka[0] == hash_block_tokens(None, toks(0, BS))


def test_block_hashes_ignore_a_partial_tail():
    tokens = toks(0, 3 * BS)
    full = block_hashes(tokens, BS)
    assert len(full) == 3
    for extra in range(1, BS):
        assert block_hashes(tokens + toks(500, extra), BS) == full
    assert block_hashes(tokens[:BS - 1], BS) == []
    assert block_hashes([], BS) == []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**63 - 1), max_size=40), block_size=st.integers(1, 6), data=st.data())
def test_block_hashes_continued_from_a_parent_equal_the_full_computation(tokens, block_size, data):
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    start = data.draw(st.integers(0, len(full)), label="start")
    parent = full[start - 1] if start else None
    assert block_hashes(tokens, block_size, start, parent) == full[start:]
    # a caller passing only the tokens computed so far continues just as well
    assert full[:start] + block_hashes(tokens, block_size, start, parent) == full


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 1), max_size=12), b=st.lists(st.integers(0, 1), max_size=12),
       block_size=st.integers(1, 3))
def test_equal_keys_mean_equal_prefixes(a, b, block_size):
    ka, kb = block_hashes(a, block_size), block_hashes(b, block_size)
    for i in range(min(len(ka), len(kb))):
        end = (i + 1) * block_size
        assert (ka[i] == kb[i]) == (a[:end] == b[:end])


# -- prefix hits ------------------------------------------------------------------


def test_freed_prefix_is_reused_by_the_next_sequence():
    bm = make()
    tokens = toks(0, 3 * BS + 2)
    assert run(bm, 0, tokens) == 0
    assert bm.num_cached_blocks == 3
    first = bm.block_table(0)
    bm.free(0)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    queries, hits = bm.prefix_queries, bm.prefix_hits
    other = tokens[:3 * BS] + [777]
    assert prompt(bm, 1, other) == 3 * BS
    assert bm.block_table(1)[:3] == first[:3]
    assert bm.prefix_queries == queries + len(other) and bm.prefix_hits == hits + 3 * BS
    check_accounting(bm)


def test_counters_count_tokens_looked_up_and_found():
    bm = make()
    tokens = toks(0, 2 * BS + 1)
    run(bm, 0, tokens)
    assert (bm.prefix_queries, bm.prefix_hits) == (len(tokens), 0)
    bm.free(0)
    prompt(bm, 1, tokens)
    assert (bm.prefix_queries, bm.prefix_hits) == (2 * len(tokens), 2 * BS)
    bm.allocate(2, 3)  # no hashes: a query without hits
    assert (bm.prefix_queries, bm.prefix_hits) == (2 * len(tokens) + 3, 2 * BS)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    bm = make()
    tokens = toks(0, 2 * BS)
    run(bm, 0, tokens)
    bm.free(0)
    assert prompt(bm, 1, tokens) == BS  # max_cached_tokens = len - 1 leaves the last token to compute
    first = bm.block_table(1)
    assert bm.num_blocks_of(1) == 2
    bm.free(1)
    assert prompt(bm, 2, tokens, max_cached=len(tokens)) == 2 * BS
    assert bm.block_table(2)[0] == first[0]


@pytest.mark.parametrize("max_cached, expected", [(0, 0), (1, 0), (BS - 1, 0), (BS, BS), (2 * BS - 1, BS),
                                                  (2 * BS, 2 * BS), (3 * BS, 3 * BS), (10 * BS, 3 * BS)])
def test_cached_tokens_are_whole_blocks_capped_by_max_cached_tokens(max_cached, expected):
    bm = make()
    tokens = toks(0, 3 * BS + 1)
    run(bm, 0, tokens)
    bm.free(0)
    assert prompt(bm, 1, tokens, max_cached=max_cached) == expected


def test_cached_tokens_are_capped_by_num_tokens():
    bm = make()
    tokens = toks(0, 3 * BS)
    run(bm, 0, tokens)
    bm.free(0)
    hashes = block_hashes(tokens, BS)
    assert bm.allocate(1, BS + 1, hashes, 10 * BS) == BS
    assert bm.num_blocks_of(1) == 2


def test_hits_stop_at_the_first_uncached_block():
    bm = make()
    tokens = toks(0, 3 * BS)
    run(bm, 0, tokens)
    bm.free(0)
    changed = tokens[:BS] + [999] + tokens[BS + 1:] + [5]
    assert prompt(bm, 1, changed) == BS  # block 1 differs, so block 2's key differs too
    assert prompt(bm, 2, [999] + tokens[1:] + [5]) == 0


def test_cached_prefix_changes_nothing():
    bm = make()
    tokens = toks(0, 2 * BS + 1)
    run(bm, 0, tokens)
    bm.free(0)
    before = snapshot(bm)
    assert bm.cached_prefix(block_hashes(tokens, BS), len(tokens)) == 2
    assert bm.cached_prefix(block_hashes(tokens, BS), BS) == 1
    assert bm.cached_prefix([], len(tokens)) == 0
    assert snapshot(bm) == before


def test_cache_blocks_registers_only_computed_full_blocks_and_is_idempotent():
    bm = make()
    tokens = toks(0, 3 * BS + 1)
    prompt(bm, 0, tokens)
    keys = block_hashes(tokens, BS)
    bm.cache_blocks(0, tokens, BS - 1)
    assert bm.num_cached_blocks == 0
    bm.cache_blocks(0, tokens, 2 * BS + 1)
    assert set(bm._cached) == set(keys[:2])
    before = snapshot(bm)
    bm.cache_blocks(0, tokens, 2 * BS)
    bm.cache_blocks(0, tokens, BS)
    assert snapshot(bm) == before
    bm.cache_blocks(0, tokens, len(tokens))
    assert set(bm._cached) == set(keys)
    table = bm.block_table(0)
    assert [bm._cached[k].block_id for k in keys] == table[:3]
    # positions beyond the table are not cached, whatever num_computed says
    bm.cache_blocks(0, tokens + toks(50, 2 * BS), len(tokens) + 2 * BS)
    assert bm.num_cached_blocks == 4 and len(bm.block_table(0)) == 4


def test_cache_blocks_continues_during_decode():
    bm = make()
    tokens = toks(0, BS + 2)
    prompt(bm, 0, tokens)
    bm.cache_blocks(0, tokens, len(tokens))
    for t in range(100, 100 + 2 * BS):
        tokens.append(t)
        assert bm.append_slots(0, len(tokens))
        bm.cache_blocks(0, tokens, len(tokens))
    assert bm._tables[0].hashes == block_hashes(tokens, BS)
    bm.free(0)
    assert prompt(bm, 1, tokens + [1]) == len(block_hashes(tokens, BS)) * BS


# -- reference counts ----------------------------------------------------------------


def test_live_sequences_share_a_prefix():
    bm = make()
    base = toks(0, 2 * BS)
    run(bm, 0, base + [1])
    assert prompt(bm, 1, base + [2, 3]) == 2 * BS
    a, b = bm.block_table(0), bm.block_table(1)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [bm._blocks[i].ref_cnt for i in a] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    check_accounting(bm)
    bm.free(0)
    assert [bm._blocks[i].ref_cnt for i in b] == [1, 1, 1]
    assert not set(b) & ({x.block_id for x in bm._free_uncached} | set(bm._free_cached))
    assert bm.num_free_blocks == 8 - 3
    # the survivor's shared blocks are never handed out, however many blocks are taken
    bm.allocate(2, 5 * BS)
    assert not set(bm.block_table(2)) & set(b)
    assert bm.num_free_blocks == 0
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8
    check_accounting(bm)


def test_three_sharers_and_revival_after_all_freed():
    bm = make()
    base = toks(0, BS)
    for seq_id in range(3):
        run(bm, seq_id, base + [seq_id])
    shared = bm.block_table(0)[0]
    assert all(bm.block_table(s)[0] == shared for s in range(3)) and bm._blocks[shared].ref_cnt == 3
    for seq_id in range(3):
        bm.free(seq_id)
    assert bm._blocks[shared].ref_cnt == 0 and list(bm._free_cached) == [shared]
    assert prompt(bm, 3, base + [7]) == BS
    assert bm.block_table(3)[0] == shared and bm._blocks[shared].ref_cnt == 1 and not bm._free_cached


def test_can_allocate_counts_revived_free_cached_blocks_as_consumed():
    bm = make(num_blocks=5)  # 4 usable
    base = toks(0, 2 * BS)
    run(bm, 0, base)
    bm.free(0)
    assert bm.num_free_blocks == 4
    fits = base + toks(100, 2 * BS)  # 4 blocks, 2 revived + 2 new
    too_big = base + toks(100, 2 * BS + 1)  # 5 blocks, 2 revived + 3 new: the new ones would have to evict the prefix
    assert not bm.can_allocate(len(too_big), block_hashes(too_big, BS), len(too_big) - 1)
    with pytest.raises(NoFreeBlocks):
        prompt(bm, 1, too_big)
    assert bm.can_allocate(len(fits), block_hashes(fits, BS), len(fits) - 1)
    assert prompt(bm, 1, fits) == 2 * BS
    assert bm.num_free_blocks == 0
    check_accounting(bm)


def test_can_allocate_counts_blocks_shared_with_a_live_sequence_as_free_of_charge():
    bm = make(num_blocks=5)
    base = toks(0, 2 * BS)
    run(bm, 0, base)  # still live: its 2 blocks are not free
    more = base + toks(100, 2 * BS)  # 4 blocks: 2 shared + 2 new
    assert bm.num_free_blocks == 2
    assert bm.can_allocate(len(more), block_hashes(more, BS), len(more) - 1)
    assert not bm.can_allocate(len(more))  # without the prefix it needs 4
    assert prompt(bm, 1, more) == 2 * BS and bm.num_free_blocks == 0
    check_accounting(bm)


# -- eviction ---------------------------------------------------------------------


def test_uncached_free_blocks_are_handed_out_before_cached_ones():
    bm = make(num_blocks=6)  # 5 usable
    run(bm, 0, toks(0, 2 * BS))
    cached = set(bm.block_table(0))
    bm.free(0)
    bm.allocate(1, 3 * BS)  # exactly the 3 uncached blocks
    assert not set(bm.block_table(1)) & cached
    assert bm.num_cached_blocks == 2
    bm.allocate(2, 1)  # now one cached block has to go
    assert bm.block_table(2)[0] in cached and bm.num_cached_blocks == 1


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = make(num_blocks=4)  # 3 usable
    prompts = {seq_id: toks(10 * seq_id, BS) for seq_id in range(3)}
    for seq_id, tokens in prompts.items():
        run(bm, seq_id, tokens)
    blocks = {seq_id: bm.block_table(seq_id)[0] for seq_id in prompts}
    for seq_id in (1, 0, 2):  # freed in this order
        bm.free(seq_id)
    assert list(bm._free_cached) == [blocks[1], blocks[0], blocks[2]]
    bm.allocate(10, 1)
    assert bm.block_table(10) == [blocks[1]]
    assert bm.cached_prefix(block_hashes(prompts[1], BS), BS) == 0  # evicted key no longer hits
    assert bm.cached_prefix(block_hashes(prompts[0], BS), BS) == 1
    bm.allocate(11, 1)
    assert bm.block_table(11) == [blocks[0]]
    assert bm.cached_prefix(block_hashes(prompts[2], BS), BS) == 1
    assert bm.num_cached_blocks == 1


def test_reuse_refreshes_a_cached_block_in_the_lru():
    bm = make(num_blocks=4)
    a, b = toks(0, BS), toks(100, BS)
    run(bm, 0, a)
    run(bm, 1, b)
    block_a = bm.block_table(0)[0]
    bm.free(0)
    bm.free(1)  # LRU: a, b
    assert prompt(bm, 2, a + [1]) == BS  # a revived ...
    bm.free(2)  # ... and freed again: LRU now b, a (tail block of 2 went uncached)
    assert list(bm._free_cached)[-1] == block_a
    bm.allocate(3, 2 * BS)  # the uncached block, then b's
    assert bm.cached_prefix(block_hashes(b, BS), BS) == 0
    assert bm.cached_prefix(block_hashes(a, BS), BS) == 1


def test_free_releases_the_tail_first_so_the_prefix_outlives_it():
    bm = make(num_blocks=4)  # 3 usable
    tokens = toks(0, 3 * BS)
    run(bm, 0, tokens)
    table = bm.block_table(0)
    bm.free(0)
    assert list(bm._free_cached) == table[::-1]
    bm.allocate(1, 1)
    assert bm.block_table(1) == [table[2]]
    bm.free(1)
    assert prompt(bm, 2, tokens[:2 * BS] + [1]) == 2 * BS
    assert bm.block_table(2) == table


def test_evicted_block_loses_its_key_and_is_reused_under_a_new_one():
    bm = make(num_blocks=3)  # 2 usable
    a, b = toks(0, BS), toks(100, BS)
    run(bm, 0, a)
    block_a = bm.block_table(0)[0]
    bm.free(0)
    run(bm, 1, b + [1])  # the uncached block first, then a's block is evicted
    assert bm.block_table(1)[1] == block_a
    assert bm.num_cached_blocks == 1 and block_hashes(a, BS)[0] not in bm._cached
    block_b = bm.block_table(1)[0]
    assert bm._cached[block_hashes(b, BS)[0]].block_id == block_b
    assert bm._blocks[block_a].block_hash is None
    bm.free(1)
    assert list(bm._free_cached) == [block_b]
    assert prompt(bm, 2, a + [1]) == 0
    check_accounting(bm)


# -- one prefix computed twice at once --------------------------------------------------------


def test_events_are_recorded_only_when_asked_and_taken_once():
    bm = make()
    run(bm, 1, toks(0, 8))
    assert bm.take_events() == []  # not recording
    bm.record_events()
    run(bm, 2, toks(100, 9))
    (stored,) = bm.take_events()
    assert stored == BlocksStored(block_hashes(toks(100, 9), BS), None, toks(100, 8))
    assert bm.take_events() == []
    bm.cache_blocks(2, toks(100, 9) + [7, 7, 7], 12)  # decode fills the third block: it continues the chain
    (more,) = bm.take_events()
    assert more.parent_block_hash == stored.block_hashes[-1] and more.token_ids == [108, 7, 7, 7]
    bm.free(1)
    bm.free(2)
    run(bm, 3, toks(200, 32))  # needs every block: the cached ones are evicted
    events = bm.take_events()
    assert isinstance(events[0], BlocksRemoved) and len(events[0].block_hashes) == 5
    bm.reset_prefix_cache()
    assert isinstance(bm.take_events()[-1], BlocksCleared)
    bm.record_events(False)
    bm.reset_prefix_cache()
    assert bm.take_events() == []


def test_duplicate_prefix_computed_by_two_sequences_stays_private():
    bm = make()
    tokens = toks(0, 2 * BS + 1)
    prompt(bm, 0, tokens)
    prompt(bm, 1, tokens)  # nothing cached yet: both compute the prefix
    a, b = bm.block_table(0), bm.block_table(1)
    assert not set(a) & set(b)
    bm.cache_blocks(0, tokens, len(tokens))
    bm.cache_blocks(1, tokens, len(tokens))
    keys = block_hashes(tokens, BS)
    assert [bm._cached[k].block_id for k in keys] == a[:2]
    assert all(bm._blocks[i].block_hash is None for i in b)
    assert bm._tables[1].hashes == keys  # the table knows its keys even if its blocks are not the cached ones
    assert [bm._blocks[i].ref_cnt for i in a + b] == [1] * 6
    bm.free(1)
    assert set(b) <= {x.block_id for x in bm._free_uncached} and not bm._free_cached
    bm.free(0)
    assert list(bm._free_cached) == a[1::-1]
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    check_accounting(bm)
    assert prompt(bm, 2, tokens) == 2 * BS and bm.block_table(2)[:2] == a[:2]


def test_duplicate_first_block_does_not_stop_caching_later_blocks():
    bm = make()
    tokens = toks(0, 2 * BS + 1)
    prompt(bm, 0, tokens)
    prompt(bm, 1, tokens)
    a, b = bm.block_table(0), bm.block_table(1)
    bm.cache_blocks(0, tokens, BS)  # 0 has only its first block computed so far
    bm.cache_blocks(1, tokens, len(tokens))  # 1's first block duplicates 0's; its second is new
    keys = block_hashes(tokens, BS)
    assert bm._cached[keys[0]].block_id == a[0] and bm._cached[keys[1]].block_id == b[1]
    bm.cache_blocks(0, tokens, len(tokens))  # 0's second block now duplicates 1's
    assert bm._blocks[a[1]].block_hash is None and bm._blocks[b[0]].block_hash is None
    assert prompt(bm, 2, tokens) == 2 * BS and bm.block_table(2)[:2] == [a[0], b[1]]
    for seq_id in (0, 1, 2):
        bm.free(seq_id)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    check_accounting(bm)


# -- switches and resets ------------------------------------------------------------------


def test_prefix_caching_disabled_never_hits():
    bm = make(caching=False)
    tokens = toks(0, 2 * BS + 1)
    assert run(bm, 0, tokens) == 0
    assert bm.num_cached_blocks == 0 and bm._tables[0].hashes == []
    bm.free(0)
    assert not bm._free_cached
    assert run(bm, 1, tokens, max_cached=len(tokens)) == 0
    run(bm, 2, tokens)
    assert not set(bm.block_table(1)) & set(bm.block_table(2))
    assert bm.cached_prefix(block_hashes(tokens, BS), len(tokens)) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    check_accounting(bm)


def test_reset_prefix_cache_forgets_every_prefix():
    bm = make()
    free_prompt, live_prompt = toks(0, 2 * BS), toks(100, 2 * BS)
    run(bm, 0, free_prompt)
    run(bm, 1, live_prompt)
    live = bm.block_table(1)
    bm.free(0)
    free_before = bm.num_free_blocks
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and not bm._free_cached
    assert bm.num_free_blocks == free_before and bm.block_table(1) == live
    assert all(b.block_hash is None for b in bm._blocks)
    assert prompt(bm, 2, free_prompt + [1]) == 0
    assert prompt(bm, 3, live_prompt + [1]) == 0
    assert not set(bm.block_table(3)) & set(live)
    bm.free(1)
    assert not bm._free_cached  # the live sequence's blocks come back uncached
    check_accounting(bm)


def test_reset_prefix_cache_then_caching_starts_afresh():
    bm = make()
    tokens = toks(0, 2 * BS + 1)
    run(bm, 0, tokens)
    bm.free(0)
    bm.reset_prefix_cache()
    run(bm, 1, tokens)
    bm.free(1)
    assert bm.num_cached_blocks == 2
    assert prompt(bm, 2, tokens) == 2 * BS


def test_negative_max_cached_tokens_caches_nothing():
    bm = make()
    tokens = toks(0, 3 * BS)
    run(bm, 0, tokens)
    bm.free(0)
    assert bm.allocate(1, len(tokens), block_hashes(tokens, BS), -1) == 0


# -- random interleavings ------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=8)  # a tiny alphabet, so prefixes collide


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / cache / free / reset against a shadow of what each block holds.

    ``shadow[block_id]`` holds the token ids last written into the block's positions
    by the sequence computing them (None: not computed since the block was taken);
    a prefix hit must hand out blocks whose shadow equals the new sequence's
    leading tokens, and a cached key must name a block whose shadow is its last
    block of tokens.
    """

    @initialize(num_blocks=st.integers(2, 14), block_size=st.integers(1, 3),
                caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bm.record_events()
        self.subscriber: set[bytes] = set()  # the keys a consumer of the events believes cached
        self.bs = block_size
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # live sequences
        self.computed: dict[int, int] = {}  # positions of each live sequence with KV written
        self.history: list[list[int]] = []  # every prompt allocated, to draw shared prefixes from
        self.shadow: dict[int, list[int | None]] = {}
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    def _compute(self, seq_id, end):
        """Sequence ``seq_id`` writes KV for its positions up to ``end``."""
        table, tokens = self.bm.block_table(seq_id), self.tokens[seq_id]
        for pos in range(self.computed[seq_id], end):
            block = table[pos // self.bs]
            assert self.bm._blocks[block].ref_cnt == 1, "writing into a block another sequence shares"
            self.shadow[block][pos % self.bs] = tokens[pos]
        self.computed[seq_id] = max(self.computed[seq_id], end)

    def _fresh(self, blocks):
        for block in blocks:
            self.shadow[block] = [None] * self.bs

    def _learn(self, tokens):
        for i, key in enumerate(block_hashes(tokens, self.bs)):
            self.prefix_of[key] = tuple(tokens[:(i + 1) * self.bs])

    def _live(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq_id")

    @rule(tail=TOKENS, data=st.data(), cap=st.none() | st.integers(0, 14), compute=st.booleans())
    def allocate(self, tail, data, cap, compute):
        tokens = tail
        if self.history and data.draw(st.booleans(), label="shared"):  # provoke prefix hits
            donor = data.draw(st.sampled_from(self.history), label="donor")
            tokens = donor[:data.draw(st.integers(0, len(donor)), label="keep")] + tail
        seq_id = self.next_id
        hashes = block_hashes(tokens, self.bs)
        self._learn(tokens)
        max_cached = len(tokens) - 1 if cap is None else cap
        fits = self.bm.can_allocate(len(tokens), hashes, max_cached)
        expected_hits = self.bm.cached_prefix(hashes, min(max_cached, len(tokens)))
        before = snapshot(self.bm)
        queries, hits = self.bm.prefix_queries, self.bm.prefix_hits
        try:
            cached = self.bm.allocate(seq_id, len(tokens), hashes, max_cached)
        except NoFreeBlocks:
            assert not fits
            assert snapshot(self.bm) == before
            return
        assert fits
        self.next_id += 1
        assert cached == expected_hits * self.bs
        assert cached % self.bs == 0 and 0 <= cached <= min(max_cached, len(tokens))
        if self.bm.enable_prefix_caching:
            assert (self.bm.prefix_queries, self.bm.prefix_hits) == (queries + len(tokens), hits + cached)
        else:
            assert cached == 0 and (self.bm.prefix_queries, self.bm.prefix_hits) == (queries, hits)
        table = self.bm.block_table(seq_id)
        assert len(table) == self.bm.blocks_for(len(tokens))
        for i, block in enumerate(table[:cached // self.bs]):
            assert self.shadow[block] == tokens[i * self.bs:(i + 1) * self.bs], "hit on a block holding other tokens"
        self.tokens[seq_id] = list(tokens)
        self.computed[seq_id] = cached
        self.history.append(list(tokens))
        self._fresh(table[cached // self.bs:])
        if compute:  # prefill, and the engine registers the prompt's blocks right after it
            self._compute(seq_id, len(tokens))
            self.bm.cache_blocks(seq_id, tokens, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tokens=TOKENS, dice=st.integers(0, 4))
    def allocate_again(self, data, tokens, dice):
        if dice:  # rarely: it changes nothing
            return
        seq_id = self._live(data)
        before = snapshot(self.bm)
        with pytest.raises(ValueError):
            self.bm.allocate(seq_id, len(tokens), block_hashes(tokens, self.bs), len(tokens) - 1)
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def append(self, data, extra):
        seq_id = self._live(data)
        tokens = self.tokens[seq_id] + extra
        old = self.bm.block_table(seq_id)
        before = snapshot(self.bm)
        needed = self.bm.blocks_for(len(tokens)) - len(old)
        free = self.bm.num_free_blocks
        if not self.bm.append_slots(seq_id, len(tokens)):
            assert needed > free
            assert snapshot(self.bm) == before
            return
        table = self.bm.block_table(seq_id)
        assert table[:len(old)] == old and len(table) == max(len(old), self.bm.blocks_for(len(tokens)))
        self._fresh(table[len(old):])
        self.tokens[seq_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data):
        seq_id = self._live(data)
        tokens = self.tokens[seq_id]
        num_computed = data.draw(st.integers(0, len(tokens)), label="num_computed")
        self._compute(seq_id, num_computed)
        self._learn(tokens)
        self.bm.cache_blocks(seq_id, tokens, num_computed)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self._live(data)
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]
        assert seq_id not in self.bm

    @rule(seq_id=st.integers(-3, -1))
    def free_unknown(self, seq_id):
        before = snapshot(self.bm)
        self.bm.free(seq_id)
        assert snapshot(self.bm) == before

    @rule(dice=st.integers(0, 4))
    def reset(self, dice):
        if dice == 0:  # rarely, or little would ever be cached
            self.bm.reset_prefix_cache()

    @invariant()
    def events_replayed_give_the_cached_keys(self):
        for event in self.bm.take_events():
            if isinstance(event, BlocksStored):
                assert event.block_hashes and len(event.token_ids) == len(event.block_hashes) * self.bs
                assert not set(event.block_hashes) & self.subscriber, "a key stored twice without a removal"
                chain = [event.parent_block_hash, *event.block_hashes]
                for i, key in enumerate(event.block_hashes):
                    prefix = self.prefix_of[key]
                    assert tuple(event.token_ids[i * self.bs:(i + 1) * self.bs]) == prefix[-self.bs:]
                    assert chain[i] == (block_hashes(list(prefix), self.bs)[-2] if len(prefix) > self.bs else None)
                self.subscriber |= set(event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                assert set(event.block_hashes) <= self.subscriber, "removed a key never stored"
                self.subscriber -= set(event.block_hashes)
            else:
                assert isinstance(event, BlocksCleared)
                self.subscriber.clear()
        assert self.subscriber == set(self.bm._cached)

    @invariant()
    def blocks_are_accounted_for(self):
        bm = self.bm
        tables = {seq_id: bm.block_table(seq_id) for seq_id in bm._tables}
        assert set(tables) == set(self.tokens)
        live = [block for table in tables.values() for block in table]
        uncached = [b.block_id for b in bm._free_uncached]
        cached_free = list(bm._free_cached)
        free = uncached + cached_free
        assert NULL_BLOCK not in live and NULL_BLOCK not in free
        assert len(free) == len(set(free)) == bm.num_free_blocks
        assert not set(free) & set(live), "a held block is on a free list"
        assert bm.num_free_blocks + len(set(live)) == bm.num_usable_blocks, "a block leaked or was freed twice"
        assert 0.0 <= bm.usage <= 1.0
        assert bm._blocks[NULL_BLOCK].ref_cnt == 0 and bm._blocks[NULL_BLOCK].block_hash is None
        for seq_id, table in tables.items():
            assert len(table) == len(set(table))
            assert len(table) == bm.blocks_for(len(self.tokens[seq_id]))
        for block in set(live):
            assert bm._blocks[block].ref_cnt == live.count(block)
        for block in free:
            assert bm._blocks[block].ref_cnt == 0
        for block_id, block in bm._free_cached.items():
            assert block.block_id == block_id and block.block_hash is not None
            assert bm._cached[block.block_hash] is block
        for block in bm._free_uncached:
            assert block.block_hash is None

    @invariant()
    def shared_blocks_share_a_prefix(self):
        bm = self.bm
        where: dict[int, tuple[int, int]] = {}
        for seq_id, table in bm._tables.items():
            for i, block in enumerate(table.blocks):
                if block.block_id not in where:
                    where[block.block_id] = (seq_id, i)
                    continue
                other, j = where[block.block_id]
                assert i == j, "one block at two positions"
                assert len(table.hashes) > i and len(bm._tables[other].hashes) > i
                assert table.hashes[i] == bm._tables[other].hashes[i], "block shared under different keys"
                end = (i + 1) * self.bs
                assert self.tokens[seq_id][:end] == self.tokens[other][:end]

    @invariant()
    def keys_name_their_blocks(self):
        bm = self.bm
        assert bm.num_cached_blocks == len(bm._cached)
        for key, block in bm._cached.items():
            assert block.block_hash == key and block.block_id != NULL_BLOCK
            assert block.ref_cnt > 0 or block.block_id in bm._free_cached
            assert tuple(self.shadow[block.block_id]) == self.prefix_of[key][-self.bs:], "key names other tokens"
        hashed = [b for b in bm._blocks if b.block_hash is not None]
        assert len(hashed) == len(bm._cached)
        for seq_id, table in bm._tables.items():
            assert len(table.hashes) <= len(table.blocks)
            assert table.hashes == block_hashes(self.tokens[seq_id], self.bs)[:len(table.hashes)]
        if not bm.enable_prefix_caching:
            assert not bm._cached and bm.prefix_queries == bm.prefix_hits == 0
        assert 0 <= bm.prefix_hits <= bm.prefix_queries


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_fresh_blocks_lists_reused_blocks_only_and_drains():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate(1, 8)  # two never-used blocks: still zero, not listed
    assert manager.take_fresh_blocks() == []
    first = manager.block_table(1)
    manager.free(1)
    manager.allocate(2, 16)  # four blocks: the two reused ones are listed
    assert sorted(manager.take_fresh_blocks()) == sorted(first)
    assert manager.take_fresh_blocks() == []  # drained

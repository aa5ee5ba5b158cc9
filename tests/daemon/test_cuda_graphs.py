"""Decode through the static, padded CUDA-graph buffers on CPU: the same logits as the eager step, no real KV touched."""

from __future__ import annotations

import random

import pytest
import torch

from ringstream.daemon.engine.attention import use_paged_attention
from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.cuda_graphs import CudaGraphRunner, DecodeBuffers, DecodeInputs, bucket_for, graph_batch_sizes
from ringstream.daemon.engine.families import kv_shape
from ringstream.daemon.engine.kv_cache import PagedKVCache, build_metadata
from tests.factories import load_model, make_tiny_model_dir

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            graph_batch_sizes(bad)


def test_bucket_for():
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 4, 8, 8, 16, 20, 20, None]
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model")))
    use_paged_attention(model)
    return model


def _forward(model, cache, input_ids, positions, meta):
    cache.slot_mapping = meta.slot_mapping
    return model(input_ids=input_ids, position_ids=positions, use_cache=True, paged=meta, cache=cache).logits[0]


def _prefilled(model, lengths):
    """A pool (its last block reserved as the dummy) with each sequence's prompt prefilled; the decode inputs
    of the next step (each row feeds its prompt's last token, not yet computed)."""
    num_blocks = 40
    num_kv_heads, head_dim, value_head_dim = kv_shape(model.config)
    cache = PagedKVCache(model.config.num_hidden_layers, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim,
                         torch.float32, torch.device("cpu"), value_head_dim)
    blocks = BlockManager(num_blocks - 1, BLOCK_SIZE)  # block num_blocks - 1 is never handed out
    rng = random.Random(sum(lengths))
    tokens, decodes = [], []
    for seq_id, length in enumerate(lengths):
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(length)]
        blocks.allocate(seq_id, length)
        table = blocks.block_table(seq_id)
        meta = build_metadata([], [(table, 0, length - 1)], BLOCK_SIZE, torch.device("cpu"))
        _forward(model, cache, torch.tensor([prompt[:-1]]), torch.arange(length - 1).unsqueeze(0), meta)
        tokens.append(prompt[-1])
        decodes.append((table, length - 1))
    return cache, DecodeInputs(tokens, decodes), num_blocks - 1


def _clone(cache):
    return [t.clone() for t in cache.key_cache + cache.value_cache]


@pytest.mark.parametrize("lengths", [[5], [3, 9, 14], [2, 7, 4, 30, 11], [6, 2, 17, 9, 40, 3, 12, 8, 25]])
def test_padded_static_decode_matches_the_eager_step(model, lengths):
    with torch.inference_mode():
        cache, inputs, dummy = _prefilled(model, lengths)
        before = _clone(cache)
        # the eager step, as the model runner builds it
        meta = build_metadata(inputs.decodes, [], BLOCK_SIZE, torch.device("cpu"))
        positions = [pos for _, pos in inputs.decodes]
        eager = _forward(model, cache, torch.tensor([inputs.token_ids]), torch.tensor([positions]), meta).clone()
        eager_kv = _clone(cache)
        for layer, saved in zip(cache.key_cache + cache.value_cache, before):
            layer.copy_(saved)
        buffers = DecodeBuffers(16, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, dummy, torch.device("cpu"), cache)
        runner = CudaGraphRunner(model, cache, buffers, graph_batch_sizes(16), capture=False)
        static = runner.run(inputs)
    bucket = bucket_for(len(lengths), runner.sizes)
    assert static.shape == eager.shape == (len(lengths), model.config.vocab_size)
    # the bucket's GEMMs have more rows than the batch: float32 results agree to the last bits, not bit for bit
    torch.testing.assert_close(static, eager, rtol=0, atol=1e-5)
    # the buffers' rows past the batch are padding over the dummy block
    assert buffers.slot_mapping[len(lengths):bucket].eq(dummy * BLOCK_SIZE).all()
    assert buffers.seq_lens[len(lengths):bucket].eq(1).all()
    # every real slot holds what the eager step wrote; only the dummy block's first slot differs from before
    dummy_slot = dummy * BLOCK_SIZE
    for after, want, old in zip(cache.key_cache + cache.value_cache, eager_kv, before):
        real = torch.ones(after.shape[1], dtype=torch.bool)
        real[dummy * BLOCK_SIZE:(dummy + 1) * BLOCK_SIZE] = False
        torch.testing.assert_close(after[:, real], want[:, real], rtol=0, atol=1e-5)
        untouched = real.clone()
        untouched[meta.slot_mapping] = False
        assert torch.equal(after[:, untouched], old[:, untouched])
        assert torch.equal(after[:, dummy_slot + 1:], old[:, dummy_slot + 1:])
        assert torch.equal(old[:, dummy_slot], torch.zeros_like(old[:, dummy_slot]))
        if bucket > len(lengths):
            assert after[:, dummy_slot].abs().sum() > 0
        assert torch.equal(after[:, :BLOCK_SIZE], torch.zeros_like(after[:, :BLOCK_SIZE]))  # null block stays zero


def test_prepare_reuses_buffers_and_rejects_bad_input():
    buffers = DecodeBuffers(8, 4, BLOCK_SIZE, 9, torch.device("cpu"))
    address = buffers.block_tables.data_ptr()
    ids, pos = buffers.prepare(DecodeInputs([7, 8, 9], [([1, 2], 5), ([3], 0), ([4, 5, 6], 11)]), 4)
    assert ids.tolist() == [[7, 8, 9, 0]] and pos.tolist() == [[5, 0, 11, 0]]
    assert buffers.slot_mapping[:4].tolist() == [2 * 4 + 1, 3 * 4, 6 * 4 + 3, 9 * 4]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 12, 1]
    assert buffers.block_tables[:4].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0], [9, 0, 0, 0]]
    assert buffers.kv_valid[1, 0, 0].tolist() == [True] + [False] * 15
    assert buffers.kv_valid[2, 0, 0].sum() == 12
    assert buffers.block_tables.data_ptr() == address
    # a smaller batch in the same bucket overwrites the former rows with padding
    buffers.prepare(DecodeInputs([5], [([1], 2)]), 4)
    assert buffers.block_tables[:4].tolist() == [[1, 0, 0, 0], [9, 0, 0, 0], [9, 0, 0, 0], [9, 0, 0, 0]]
    assert buffers.kv_valid[2, 0, 0].sum() == 1
    with pytest.raises(ValueError, match="bucket"):
        buffers.prepare(DecodeInputs([1, 2], [([1], 0), ([2], 0)]), 1)
    with pytest.raises(ValueError, match="bucket"):
        buffers.prepare(DecodeInputs([1], [([1], 0)]), 9)
    with pytest.raises(ValueError, match="blocks"):
        buffers.prepare(DecodeInputs([1], [([1, 2, 3, 4, 5], 16)]), 1)
    with pytest.raises(ValueError, match="token ids"):
        buffers.prepare(DecodeInputs([1, 2], [([1], 0)]), 2)
    with pytest.raises(ValueError, match="null block"):
        DecodeBuffers(8, 4, BLOCK_SIZE, 0, torch.device("cpu"))


def test_graph_capture_needs_cuda(model):
    buffers = DecodeBuffers(4, 4, BLOCK_SIZE, 9, torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(model, None, buffers, graph_batch_sizes(4))
    with pytest.raises(ValueError, match="exceeds"):
        CudaGraphRunner(model, None, buffers, graph_batch_sizes(8), capture=False)
    assert CudaGraphRunner(model, None, buffers, [1, 2, 4], capture=False).run(
        DecodeInputs([1] * 5, [([1], 0)] * 5)) is None

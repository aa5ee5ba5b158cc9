"""Shared by the native-kernel test modules: whether the kernels can be built here, a tiny model and tokenizer, a
tiny in-memory model of any family, and the greedy tokens an engine with or without the native kernels gives."""

from __future__ import annotations

import importlib.util
import random
import shutil

import pytest
import torch

from ringstream.daemon.engine import kernels
from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from tests.factories import load_tokenizer, make_tiny_model_dir

BUILDABLE = shutil.which("c++") is not None and importlib.util.find_spec("ninja") is not None


def native_ops_or_skip():
    """``torch.ops.ringstream``; skips the test where no compiler can build it, fails it where one could."""
    ops = kernels.native_ops()
    if ops is None:
        if BUILDABLE:
            pytest.fail("a C++ compiler and ninja are here, yet the native kernels did not build")
        pytest.skip("no C++ compiler or ninja: the native kernels cannot be built here")
    return ops


def tiny_family_model(config_class, model_class, **extra):
    """A 2-layer random-weight model of ``model_class`` (hidden 64, 4 query / 2 KV heads of 16, vocab 300), in
    eval mode, the same weights at every call."""
    torch.manual_seed(4)
    config = config_class(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300, **extra)
    return model_class(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("native"))
    return model_dir, load_tokenizer(model_dir)


def greedy_outputs(model, tokenizer, native: bool, before_run=None) -> dict[int, list[int]]:
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
                                                   num_blocks=256, native_kernels=native), eos_token_ids=(1,))
    engine.warmup()
    if before_run is not None:
        before_run(engine)
    rng = random.Random(3)
    for handle in range(6):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 60))]
        engine.add(EngineRequest(handle, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.handle, []).append(out.token_id)
    return outputs


def bf16_layouts(ops) -> list[int]:
    """The bfloat16 panel layouts this host runs: 24 (widened to float32 by the AVX2 kernel) everywhere, 48
    (widened, AVX-512) on AVX-512 hosts, 96 (k-pairs for VDPBF16PS) where it also has AVX512_BF16."""
    layouts = []
    for panel in (24, 48, 96):
        try:
            ops.pack_linear_weight(torch.zeros(1, 2, dtype=torch.bfloat16), panel)
            layouts.append(panel)
        except RuntimeError:
            pass
    return layouts

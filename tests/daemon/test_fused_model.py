"""The engine's one-loop step over a Llama-exact model (``daemon/engine/fused_model.py``): which models get it,
and that its logits are bit-identical to the model's own forward in the same steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringstream.daemon.engine.fused import _source_tokens, _transformers_own, fuse_attention, fuse_elementwise
from ringstream.daemon.engine.fused_model import FusedCausalLM, fuse_model
from ringstream.daemon.engine.linear import pack_linears
from tests.daemon.native_helpers import (greedy_outputs, native_ops_or_skip,  # noqa: F401 (fixture)
                                         tiny, tiny_family_model)
from tests.factories import load_model


@pytest.fixture(scope="module")
def ops():
    return native_ops_or_skip()


def fused(model: nn.Module, ops) -> nn.Module:
    pack_linears(model, ops)
    fuse_elementwise(model, ops)
    fuse_attention(model, ops)
    return model


def test_fuse_model_takes_llama_exact_models_only(ops):
    from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    assert isinstance(fuse_model(fused(tiny_family_model(LlamaConfig, LlamaForCausalLM), ops), ops), FusedCausalLM)
    # Qwen3 (q / k norms), Mistral (sliding window), Gemma ((1 + w) norms, scaled embeddings): their own forwards
    for config_class, model_class in ((Qwen3Config, Qwen3ForCausalLM), (MistralConfig, MistralForCausalLM),
                                      (GemmaConfig, GemmaForCausalLM)):
        assert fuse_model(fused(tiny_family_model(config_class, model_class), ops), ops) is None, model_class
    # a Llama whose layers were not fused (the engine without its native kernels) keeps its forward
    unfused = tiny_family_model(LlamaConfig, LlamaForCausalLM)
    pack_linears(unfused, ops)
    assert fuse_model(unfused, ops) is None


def test_a_hook_anywhere_keeps_the_models_forward(ops):
    from transformers import LlamaConfig, LlamaForCausalLM
    model = fused(tiny_family_model(LlamaConfig, LlamaForCausalLM), ops)
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *args: None)
    try:
        assert fuse_model(model, ops) is None  # the loop would skip the hook
    finally:
        handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert fuse_model(model, ops) is None
    finally:
        handle.remove()
    assert fuse_model(model, ops) is not None


def test_forwards_that_are_not_transformers_llama_code_itself_are_refused(ops, monkeypatch):
    import functools

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

    class SameCode(LlamaModel):  # an override, whatever its code
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Wrapped(LlamaForCausalLM):  # functools.wraps hides the wrapper from inspect.getsource
        @functools.wraps(LlamaForCausalLM.forward)
        def forward(self, *args, **kwargs):
            return LlamaForCausalLM.forward(self, *args, **kwargs)

    class Subclass(LlamaDecoderLayer):  # keeps Llama's forward: taken
        pass

    model = fused(tiny_family_model(LlamaConfig, LlamaForCausalLM), ops)
    for layer in model.model.layers:
        layer.__class__ = Subclass
    assert fuse_model(model, ops) is not None
    for layer in model.model.layers:
        layer.__class__ = LlamaDecoderLayer
    for target, cls in ((model.model, SameCode), (model, Wrapped)):
        original = target.__class__
        target.__class__ = cls
        assert fuse_model(model, ops) is None, cls
        target.__class__ = original
    loop = fuse_model(model, ops)
    assert loop.usable()
    # a patch of Llama's class, before an engine starts or while it runs
    own = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward", functools.wraps(own)(lambda self, *a, **k: own(self, *a, **k)))
    assert fuse_model(model, ops) is None and not loop.usable()
    monkeypatch.undo()
    assert loop.usable()
    # a forward set on a fused module's instance (accelerate's hooks do this)
    mlp = model.model.layers[0].mlp
    fused_forward = mlp.forward
    mlp.forward = lambda x: fused_forward(x)
    assert not loop.usable()
    mlp.forward = fused_forward
    assert loop.usable()


def test_the_code_check_sees_block_structure_and_wrappers():
    import functools

    from transformers.models.llama.modeling_llama import LlamaModel

    def flat(x, layers):
        for layer in layers:
            x = layer(x)
        x = x + 1
        return x

    def nested(x, layers):
        for layer in layers:
            x = layer(x)
            x = x + 1
        return x

    @functools.wraps(flat)
    def wrapper(*args):
        return flat(*args) * 2

    # the same tokens, not the same code
    assert _source_tokens(flat) is not None and _source_tokens(flat) != _source_tokens(nested)
    assert _source_tokens(wrapper) == _source_tokens(flat)  # inspect reads the wrapped function...
    assert _transformers_own(LlamaModel.forward) and not _transformers_own(wrapper)  # ...so wrappers are refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_steps_take_the_loop_with_logits_bit_identical_to_the_models_forward(ops, tiny, dtype):  # noqa: F811
    model_dir, tokenizer = tiny
    model = load_model(model_dir).to(dtype)
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():  # norms start at 1.0: make each one count
        if "norm" in name:
            parameter.data.uniform_(0.5, 1.5)
    compared = {"steps": 0, "chunks": 0}

    def check_every_step(engine):
        runner = engine._runner
        loop = runner.fused
        assert isinstance(loop, FusedCausalLM)
        forward = runner._forward

        def both(inputs):
            logits = forward(inputs)  # the loop
            runner.fused = None
            try:
                own = forward(inputs)  # the model's forward over the same step (it stores the same keys and values)
            finally:
                runner.fused = loop
            assert logits.dtype == own.dtype == dtype and torch.equal(logits, own)
            compared["steps"] += 1
            compared["chunks"] += bool(inputs.prefills)
            return logits

        runner._forward = both

    outputs = greedy_outputs(model, tokenizer, native=True, before_run=check_every_step)
    assert all(len(tokens) == 24 for tokens in outputs.values())
    assert compared["steps"] >= 24 and compared["chunks"] >= 2  # decode-only steps and steps with prompt chunks


def test_the_loop_gives_the_plain_engines_tokens(ops, tiny):  # noqa: F811
    model_dir, tokenizer = tiny
    plain = greedy_outputs(load_model(model_dir), tokenizer, native=False)
    calls = []
    original = FusedCausalLM.__call__

    def spy(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedCausalLM, "__call__", spy)
        fast = greedy_outputs(load_model(model_dir), tokenizer, native=True)
    assert fast == plain
    assert len(calls) >= 24 and max(calls) > 6  # every step, prompt chunks among them


def test_a_hook_added_to_a_running_engines_model_runs(ops, tiny):  # noqa: F811
    model_dir, tokenizer = tiny
    seen = []

    def hook_then_unhook(engine):
        runner = engine._runner
        assert runner.fused is not None and runner.fused.usable()
        layer = engine._runner.model.model.layers[-1]
        handle = layer.mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        assert not runner.fused.usable()  # the step takes the model's forward, hooks and all
        seen_handle.append(handle)

    seen_handle = []
    greedy_outputs(load_model(model_dir), tokenizer, native=True, before_run=hook_then_unhook)
    assert len(seen) >= 24  # every step ran the hooked module
    seen_handle[0].remove()

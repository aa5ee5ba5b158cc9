"""The CPU fast paths: the native paged decode kernel against the torch reference, packed linear layers, the
fallback when the kernel cannot be built, and the engine's tokens with and without them."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringstream.daemon.engine import kernels
from ringstream.daemon.engine.linear import FusedLinearSlice, LinearKernel, PackedLinear, pack_linears
from tests.daemon.native_helpers import (bf16_layouts, greedy_outputs, native_ops_or_skip,  # noqa: F401 (fixture)
                                         tiny, tiny_family_model)
from tests.factories import load_model


@pytest.fixture(scope="module")
def ops():
    return native_ops_or_skip()


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


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_paged_decode_equals_attention_over_the_gathered_context(ops, group, dtype, head_dim):
    # 40: no multiple of 16, the AVX2 path and its scalar tail; 64 and 128: the AVX-512 path where the host has it
    # (sixteen positions a reduction, then the rest one at a time; heads four at a time over the values)
    rng = random.Random(group)
    kv_heads, block_size = 2, 16
    lengths = [1, 15, 16, 17, 200, 63, 48, 33]
    key, value, tables, index = pool_and_tables(rng, kv_heads, head_dim, head_dim, lengths, block_size, dtype)
    heads = kv_heads * group
    rows = torch.tensor([4, 0, 5, 1, 3, 2, 7, 6])  # the group's rows, in any order, into a larger batch
    query = torch.randn(heads, 10, head_dim).to(dtype).transpose(0, 1)  # [N, heads, D], not contiguous
    out = torch.full((10, heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    ops.paged_decode(out, query, key, value, index, torch.tensor(lengths), rows, block_size, scale, 0)
    want = reference(query[rows], key, value, tables, lengths, block_size, scale, 0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), want, atol=tolerance, rtol=tolerance)
    assert out[[8, 9]].isnan().all()  # rows outside the group are not written


@pytest.mark.parametrize("head_dim, value_dim, window", [(32, 24, 16), (64, 32, 40), (128, 64, 100), (64, 48, 0)])
def test_paged_decode_sliding_window_and_value_head_size(ops, head_dim, value_dim, window):
    rng = random.Random(7)
    lengths = [5, 40, 129, 300]
    key, value, tables, index = pool_and_tables(rng, 2, head_dim, value_dim, lengths, 8, torch.float32)
    query = torch.randn(4, 4, head_dim)
    out = torch.empty(4, 4, value_dim)
    ops.paged_decode(out, query, key, value, index, torch.tensor(lengths), torch.arange(4), 8, 0.2, window)
    want = reference(query, key, value, tables, lengths, 8, 0.2, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_paged_decode_refuses_what_it_cannot_read(ops):
    key = torch.zeros(2, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        ops.paged_decode(torch.empty(1, 3, 16), torch.zeros(1, 3, 16), key, key, torch.zeros(2, dtype=torch.long),
                         torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 16, 1.0, 0)
    with pytest.raises(RuntimeError, match="kv_heads"):  # no KV heads: refused, not a division by zero
        ops.paged_decode(torch.empty(1, 2, 16), torch.zeros(1, 2, 16), key[:0], key[:0],
                         torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long), 16, 1.0, 0)
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
    assert "oneDNN's linears: Ninja is required" in caplog.text
    assert not list(tmp_path.iterdir())  # no library kept


def test_a_failed_build_is_reported_by_the_compilers_error_lines():
    message = ("Error building extension 'ringstream_kernels_avx512': [1/2] c++ -MMD -MF gemm.o.d -O3 -c gemm.cpp\n"
               "FAILED: gemm.o\ngemm.cpp:12:3: error: 'foo' was not declared in this scope\n"
               "   12 |   foo();\nninja: build stopped: subcommand failed.")
    assert kernels.build_error(RuntimeError(message)) == "gemm.cpp:12:3: error: 'foo' was not declared in this scope"
    assert kernels.build_error(RuntimeError("first\nlast words")) == "last words"


@pytest.mark.e2e
def test_a_kept_library_is_loaded_without_a_build(ops):
    # a fresh interpreter, as a worker starting after the first: it finds the library this session built
    probe = ("from torch.utils import cpp_extension\n"
             "def no_build(**_): raise SystemExit('rebuilt a kept library')\n"
             "cpp_extension.load = no_build\n"
             "from ringstream.daemon.engine.kernels import native_ops\n"
             "ops = native_ops()\n"
             "assert ops is not None and ops.packed_linear is not None and ops.paged_decode is not None\n"
             "print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]


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


def host_panels() -> list[int]:
    """The panel widths this host runs: 24 (AVX2 or portable) everywhere, 48 where the CPU has AVX-512."""
    return [24, 48] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [24]


@pytest.mark.parametrize("panel", [24, 48])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 9, 16, 97, 200])
@pytest.mark.parametrize("out_features,bias", [(1, True), (16, False), (24, True), (50, True), (1000, False), (96, True)])
def test_native_linear_is_as_accurate_as_linear(ops, panel, rows, out_features, bias):
    if panel not in host_panels():
        pytest.skip(f"{panel}-column panels need AVX-512")
    torch.manual_seed(rows * 1000 + out_features)
    in_features = 67  # not a multiple of 8 or 16
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    packed = ops.pack_linear_weight(linear.weight.detach(), panel)
    assert packed.shape == ((out_features + panel - 1) // panel, in_features, panel)
    got = ops.packed_linear(x, packed, linear.bias, out_features)
    exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    if rows:
        torch_error = (F.linear(x, linear.weight, linear.bias).double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 4 * torch_error + 1e-6


@pytest.mark.parametrize("layout", [24, 48, 96])
@pytest.mark.parametrize("rows", [1, 7, 16, 97])
@pytest.mark.parametrize("in_features", [67, 64])
@pytest.mark.parametrize("out_features,bias", [(1, True), (50, False), (96, True), (1000, True)])
def test_native_bfloat16_linear_is_the_float32_sum_rounded_once(ops, layout, rows, in_features, out_features, bias):
    if layout not in bf16_layouts(ops):
        pytest.skip(f"bfloat16 panels of {layout} need AVX-512{' with AVX512_BF16' if layout == 96 else ''}")
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    x = torch.randn(rows, in_features).bfloat16()
    if layout == 96 and in_features % 2:  # pairs of an even in_features only: the shape then says it exactly
        with pytest.raises(RuntimeError, match="need an even in_features, got 67"):
            ops.pack_linear_weight(weight, layout)
        assert ops.pack_linear_weight(weight).size(2) == 48  # the host's best for it: widened, AVX-512
        return
    packed = ops.pack_linear_weight(weight, layout)
    if layout == 96:
        with pytest.raises(RuntimeError, match="last dimension must be 64"):
            ops.packed_linear(x[:, :-1], packed, b, out_features)
    steps = in_features // 2 if layout == 96 else in_features
    columns = 24 if layout == 24 else 48
    assert packed.dtype == torch.bfloat16 and packed.shape == ((out_features + columns - 1) // columns, steps, layout)
    widened = 48 if 48 in bf16_layouts(ops) else 24
    best = 96 if 96 in bf16_layouts(ops) and in_features % 2 == 0 else widened  # the host's best for the shape
    assert ops.pack_linear_weight(weight).size(2) == best
    got = ops.packed_linear(x, packed, b, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    # every output is a float32 sum rounded to bfloat16 once: within one bfloat16 rounding of the exact value
    # (relative 2^-8) plus the float32 sum's own error
    bound = exact.abs() * 2.0 ** -8 + (x.double().abs() @ weight.double().abs().T) * 1e-6
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_bfloat16_models_pack_their_linears_and_keep_their_logits(ops):

    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(64, 200), nn.Linear(200, 64, bias=False)).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    want = mlp(x)
    assert pack_linears(mlp, ops) == 2
    assert mlp[0].packed.dtype == torch.bfloat16
    with torch.inference_mode():
        got = mlp(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_native_linear_takes_any_leading_shape_and_strides(ops):
    torch.manual_seed(1)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = ops.pack_linear_weight(weight)
    x = torch.randn(2, 5, 48)[..., ::2]  # [2, 5, 24], not contiguous
    got = ops.packed_linear(x, packed, bias, 40)
    assert got.shape == (2, 5, 40)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_native_linear_refuses_what_it_cannot_compute(ops):
    packed = ops.pack_linear_weight(torch.randn(20, 8), 24)  # one panel: 40 features do not fit
    with pytest.raises(RuntimeError, match="last dimension must be 8"):
        ops.packed_linear(torch.randn(3, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="input and weight alike"):
        ops.packed_linear(torch.randn(3, 8, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.packed_linear(torch.randn(3, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.packed_linear(torch.randn(3, 8), packed, torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.pack_linear_weight(torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="hold bfloat16 weights only"):
        ops.pack_linear_weight(torch.randn(4, 4), 96)
    with pytest.raises(RuntimeError, match="24 or 48 columns wide .*got 32"):
        ops.pack_linear_weight(torch.randn(4, 4), 32)
    with pytest.raises(RuntimeError, match="24 or 48 columns wide .*got 16"):
        ops.packed_linear(torch.randn(3, 4), torch.randn(1, 4, 16), None, 16)


def test_the_host_default_panel_is_its_widest(ops):
    assert ops.pack_linear_weight(torch.randn(50, 8)).size(2) == host_panels()[-1]


class Block(nn.Module):
    """Shaped like an attention block and a gated MLP: the sibling names pack_linears fuses."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(hidden, 48, bias=True), nn.Linear(hidden, 16, bias=False)
        self.v_proj = nn.Linear(hidden, 16, bias=True)
        self.gate_proj, self.up_proj = nn.Linear(hidden, 40, bias=False), nn.Linear(hidden, 40, bias=False)
        self.o_proj = nn.Linear(48, hidden)


@pytest.mark.parametrize("native", [True, False])
def test_fused_siblings_give_each_member_its_own_output_in_any_order(ops, native, monkeypatch):
    torch.manual_seed(2)
    block = Block()
    x, other = torch.randn(3, 32), torch.randn(3, 32)
    names = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj"]
    want = {name: getattr(block, name)(x if name != "o_proj" else torch.randn(3, 48)) for name in names[:5]}
    want_other = {name: getattr(block, name)(other) for name in names[:5]}
    gate_weight = block.gate_proj.weight.detach().clone()
    assert pack_linears(block, ops if native else None) == 6
    assert all(isinstance(getattr(block, n), FusedLinearSlice) for n in names[:5])
    assert isinstance(block.o_proj, PackedLinear)
    group = block.q_proj.group
    assert group.kernel.name == ("native" if native else "onednn")
    calls = []
    apply = group.kernel.apply
    monkeypatch.setattr(group.kernel, "apply", lambda *a: calls.append(1) or apply(*a))
    close = dict(atol=1e-5, rtol=1e-5)
    for order in (["q_proj", "k_proj", "v_proj"], ["v_proj", "q_proj", "k_proj"]):
        calls.clear()
        for name in order:
            torch.testing.assert_close(getattr(block, name)(x), want[name], **close)
        assert len(calls) == 1  # one GEMM for the three
    calls.clear()
    torch.testing.assert_close(block.q_proj(x), want["q_proj"], **close)
    torch.testing.assert_close(block.k_proj(other), want_other["k_proj"], **close)  # another input: computed
    torch.testing.assert_close(block.v_proj(x), want["v_proj"], **close)  # x again: computed
    torch.testing.assert_close(block.q_proj(x), want["q_proj"], **close)  # served by v_proj's GEMM
    assert len(calls) == 3
    calls.clear()
    torch.testing.assert_close(block.up_proj(x), want["up_proj"], **close)
    x.add_(1.0)  # written in place between the siblings: the stale output is not served
    torch.testing.assert_close(block.gate_proj(x), F.linear(x, gate_weight), **close)
    assert len(calls) == 2




def test_engine_tokens_are_the_same_with_and_without_the_fast_paths(ops, tiny):
    model_dir, tokenizer = tiny
    plain = greedy_outputs(load_model(model_dir), tokenizer, native=False)
    fast = greedy_outputs(load_model(model_dir), tokenizer, native=True)
    assert fast == plain and all(len(tokens) == 24 for tokens in fast.values())


@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (6, 2), (4, 4)])
def test_engine_tokens_with_64_wide_heads_are_the_same_with_and_without_the_fast_paths(ops, tiny, heads, kv_heads):
    # Llama-sized heads (64): the decode kernel's AVX-512 path on hosts that have it, over contexts that end
    # inside a block of sixteen positions and on its edge
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = tiny
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64 * heads, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                         max_position_embeddings=256, attn_implementation="sdpa")

    def model():
        torch.manual_seed(heads)
        return LlamaForCausalLM(config).eval()

    plain = greedy_outputs(model(), tokenizer, native=False)
    fast = greedy_outputs(model(), tokenizer, native=True)
    assert fast == plain and all(len(tokens) == 24 for tokens in fast.values())


@pytest.mark.parametrize("rows,hidden", [(0, 8), (1, 768), (5, 67), (33, 256)])
def test_rms_norm_equals_llamas(ops, rows, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(rows + hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden)
    x = torch.randn(2, rows, hidden) * 3
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [2, 14, 16, 4096])
def test_silu_and_mul_equals_the_gated_activation(ops, width):
    torch.manual_seed(width)
    y = torch.randn(3, 5, width) * 8  # both signs, large magnitudes: the exp's range
    y[0, 0, 0] = -100.0  # silu underflows to -0, not NaN
    gate, up = y.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_and_mul(y)
    assert got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_elementwise_kernels_refuse_what_they_cannot_compute(ops):
    with pytest.raises(RuntimeError, match="last dimension must be even"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="weight must be \\[8\\]"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="must have one dtype"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 8, dtype=torch.float16))


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two bfloat16 tensors are (0: the same value)."""
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows,hidden", [(0, 8), (1, 768), (5, 67), (33, 256)])
def test_bfloat16_rms_norm_rounds_where_llamas_module_does(ops, rows, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(rows + hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).bfloat16()
    norm.weight.data = torch.randn(hidden).bfloat16()
    x = (torch.randn(2, rows, hidden) * 3).bfloat16()
    with torch.no_grad():
        want = norm(x)
    got = ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    if got.numel():  # the mean's sum order may differ from torch's: a value may land one rounding away, rarely
        ulps = _bf16_ulps(got, want)
        assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 0.01


@pytest.mark.parametrize("width", [2, 14, 16, 4096])
def test_bfloat16_silu_and_mul_rounds_where_the_modules_do(ops, width):
    torch.manual_seed(width)
    y = (torch.randn(3, 5, width) * 8).bfloat16()
    y[0, 0, 0] = -100.0
    gate, up = y.chunk(2, dim=-1)
    want = F.silu(gate) * up  # silu rounded to bfloat16, then the product rounded
    got = ops.silu_and_mul(y)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    # the exp approximation may differ from torch's in float32's last bits; below exp's range the kernel gives 0
    # where torch gives a denormal (silu(-100) ~ -4e-42)
    ulps = torch.where((got.float().abs() < 1e-30) & (want.float().abs() < 1e-30), 0, _bf16_ulps(got, want))
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 0.01


def test_a_bfloat16_llama_fuses_its_norms_and_mlps_and_keeps_its_logits(ops):
    from transformers import LlamaConfig, LlamaForCausalLM
    from ringstream.daemon.engine.fused import fuse_elementwise
    model = tiny_family_model(LlamaConfig, LlamaForCausalLM).bfloat16()
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
    pack_linears(model, ops)
    assert fuse_elementwise(model, ops) == 7
    with torch.no_grad():
        got = model(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)  # bfloat16: sums in another order


def test_fuse_elementwise_takes_llamas_formula_only_and_keeps_the_logits(ops):
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM
    from ringstream.daemon.engine.fused import fuse_elementwise
    ids = torch.randint(0, 300, (2, 11))
    counts = {}
    for name, model in (("llama", tiny_family_model(LlamaConfig, LlamaForCausalLM)),
                        ("qwen3", tiny_family_model(Qwen3Config, Qwen3ForCausalLM)),
                        ("gemma3", tiny_family_model(Gemma3TextConfig, Gemma3ForCausalLM))):
        with torch.no_grad():
            want = model(ids).logits
        pack_linears(model, ops)
        counts[name] = fuse_elementwise(model, ops)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    # Llama: 2 norms + the MLP per layer, the final norm; Qwen3 adds q_norm / k_norm; Gemma's (1 + weight) norms
    # and tanh-GELU MLP keep their own forwards
    assert counts == {"llama": 7, "qwen3": 11, "gemma3": 0}


def test_fused_siblings_keep_each_threads_outputs_apart(ops):
    import threading
    torch.manual_seed(5)
    block = Block()
    inputs = [torch.randn(2, 32) for _ in range(2)]
    want = [(block.q_proj(x), block.k_proj(x)) for x in inputs]
    pack_linears(block, ops)
    group = block.q_proj.group
    apply, calls = group.kernel.apply, []
    group.kernel.apply = lambda *a: calls.append(1) or apply(*a)
    both_called_q = threading.Barrier(2)
    got, errors = {}, []

    def run(i):
        try:
            q = block.q_proj(inputs[i])
            both_called_q.wait(timeout=10)  # the other thread's q_proj ran in between: its pending outputs too
            got[i] = (q, block.k_proj(inputs[i]))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(calls) == 2  # one GEMM a thread: neither thread's q_proj displaced the other's pending k_proj
    for i in range(2):
        torch.testing.assert_close(got[i][0], want[i][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[i][1], want[i][1], atol=1e-5, rtol=1e-5)


def test_native_linear_over_no_inputs_features_is_the_bias(ops):
    weight, bias = torch.randn(30, 0), torch.randn(30)
    packed = ops.pack_linear_weight(weight)
    torch.testing.assert_close(ops.packed_linear(torch.randn(5, 0), packed, bias, 30), bias.expand(5, 30))
    assert torch.equal(ops.packed_linear(torch.randn(5, 0), packed, None, 30), torch.zeros(5, 30))


def test_silu_and_mul_below_exps_range_is_zero(ops):
    gate = torch.tensor([-1e38, -1e36, -1000.0, -88.0, -87.0, -50.0, 0.0, 3.0])
    got = ops.silu_and_mul(torch.cat([gate, torch.ones(8)]).unsqueeze(0))[0]
    torch.testing.assert_close(got, F.silu(gate), atol=1e-30, rtol=1e-6)
    scalar_tail = torch.cat([gate[:3], torch.ones(3)]).unsqueeze(0)  # fewer than 8: the scalar loop
    torch.testing.assert_close(ops.silu_and_mul(scalar_tail)[0], F.silu(gate[:3]), atol=1e-30, rtol=1e-6)


def test_native_paths_refuse_autograd_instead_of_dropping_gradients(ops):
    from ringstream.daemon.engine.fused import fuse_elementwise
    from transformers import LlamaConfig, LlamaForCausalLM
    model = tiny_family_model(LlamaConfig, LlamaForCausalLM)
    pack_linears(model, ops)
    fuse_elementwise(model, ops)
    ids = torch.randint(0, 300, (1, 5))
    with pytest.raises(RuntimeError, match="no backward"):
        model(ids)
    x = torch.randn(2, 32, requires_grad=True)
    block = Block()
    pack_linears(block, ops)
    with pytest.raises(RuntimeError, match="no backward"):
        block.q_proj(x)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 5, 300) and block.q_proj(x).shape == (2, 48)


def test_native_linear_with_no_output_features_is_empty(ops):
    packed = ops.pack_linear_weight(torch.randn(0, 8))
    got = ops.packed_linear(torch.randn(3, 8), packed, None, 0)
    assert got.shape == (3, 0)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.packed_linear(torch.randn(3, 8), ops.pack_linear_weight(torch.randn(48, 8)), torch.randn(2, 24), 48)


@pytest.mark.parametrize("where", ["query", "key_vector_part", "key_tail", "inf_key"])
def test_paged_decode_propagates_nan_and_inf_as_sdpa_does(ops, where):
    torch.manual_seed(5)
    key, value = torch.randn(1, 64, 8), torch.randn(1, 64, 8)
    query = torch.randn(1, 2, 8)
    if where == "query":
        query[0, 0, 3] = float("nan")
    elif where == "key_vector_part":
        key[0, 5, 2] = float("nan")
    elif where == "key_tail":
        key[0, 49, 2] = float("nan")
    else:  # a score of +inf: inf - inf in the softmax
        key[0, 5, 2] = float("inf")
        query = query.abs()
    out = torch.empty(1, 2, 8)
    ops.paged_decode(out, query, key, value, torch.arange(4), torch.tensor([50]), torch.tensor([0]), 16,
                     8 ** -0.5, 0)
    want = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), key[:, :50].unsqueeze(0),
                                          value[:, :50].unsqueeze(0), scale=8 ** -0.5, enable_gqa=True)[0]
    want = want.transpose(0, 1)  # [1, heads, 8]
    assert torch.equal(out.isnan(), want.isnan())
    assert out.isnan().any()
    torch.testing.assert_close(out[~out.isnan()], want[~want.isnan()])


def test_paged_decode_refuses_shapes_and_indices_it_would_read_past(ops):
    key, value = torch.randn(1, 64, 8), torch.randn(1, 64, 8)
    query, out = torch.randn(1, 2, 8), torch.empty(1, 2, 8)
    index, lengths, rows = torch.arange(4), torch.tensor([40]), torch.tensor([0])

    def call(**changed):
        args = dict(out=out, query=query, key=key, value=value, block_index=index, lengths=lengths, rows=rows,
                    block_size=16)
        args.update(changed)
        ops.paged_decode(args["out"], args["query"], args["key"], args["value"], args["block_index"],
                         args["lengths"], args["rows"], args["block_size"], 0.3, 0)

    call()  # the unchanged call is fine
    with pytest.raises(RuntimeError, match="out must be"):
        call(out=torch.empty(1, 2, 4))
    with pytest.raises(RuntimeError, match="head_dim"):
        call(query=torch.randn(1, 2, 16))
    with pytest.raises(RuntimeError, match="exceeds the 4 blocks"):
        call(lengths=torch.tensor([65]))
    with pytest.raises(RuntimeError, match="block_size must be > 0"):
        call(block_size=0)
    with pytest.raises(RuntimeError, match="row 3 out of range"):
        call(rows=torch.tensor([3]))
    with pytest.raises(RuntimeError, match="block 9 outside the pool"):
        call(block_index=torch.tensor([0, 1, 9, 3]))

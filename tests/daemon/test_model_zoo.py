"""Model zoo: every architecture is served with generate()'s tokens, or refused at start with the feature named.

Each case is a tiny random-weight model made from its transformers config
class (no download), served by the engine in float32 with prompts longer
than the sliding window (12 positions), staggered arrivals, chunked prefill
(a 16-token step budget over 4-token blocks) and prefix-cache hits (the last
prompt repeats the first one's head). Its greedy tokens must equal
``generate()`` on each prompt alone; a token that differs without a refusal
fails the test. To check a new family, add its config here.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ringstream.daemon.engine.engine import Engine, EngineRequest, SamplingParams, EngineConfig
from ringstream.daemon.common.model_dir import ModelError, ModelRefused
from ringstream.daemon.common.model_dir import resolve_model_dir
from ringstream.daemon.engine.loader import load_model
from tests.factories import TINY_VOCAB_SIZE, make_tokenizer, save_tokenizer

WINDOW = 12
NEW_TOKENS = 16
BASE = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=0, eos_token_id=1)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
LONGROPE = dict(original_max_position_embeddings=128, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
    "short_factor": [1.0, 1.3, 1.7, 2.0], "long_factor": [3.0, 4.0, 6.0, 8.0]})
DYNAMIC_ROPE = dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})

# name: (config class, its fields over BASE, attention implementation of the generate() reference)
EXACT = {
    "llama": (T.LlamaConfig, {}, "sdpa"),
    "mistral (sliding window)": (T.MistralConfig, dict(sliding_window=WINDOW), "sdpa"),
    "qwen2 (sliding window on upper layers)": (T.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                                   max_window_layers=2), "sdpa"),
    "qwen3": (T.Qwen3Config, {}, "sdpa"),
    "gemma": (T.GemmaConfig, {}, "sdpa"),
    "gemma2 (softcapping, sliding window)": (T.Gemma2Config, dict(sliding_window=WINDOW, query_pre_attn_scalar=8),
                                             "eager"),
    "gemma3 (sliding/global layers)": (T.Gemma3TextConfig, dict(sliding_window=WINDOW, query_pre_attn_scalar=8),
                                       "sdpa"),
    "phi": (T.PhiConfig, dict(num_key_value_heads=4), "sdpa"),
    "phi3": (T.Phi3Config, {}, "sdpa"),
    "gpt_neox": (T.GPTNeoXConfig, dict(num_key_value_heads=4), "sdpa"),
    "gpt2": (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, num_key_value_heads=None,
                                head_dim=None), "sdpa"),
    "mixtral": (T.MixtralConfig, MOE, "sdpa"),
    "qwen2_moe": (T.Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32), "sdpa"),
    "olmo2": (T.Olmo2Config, {}, "sdpa"),
    "granite": (T.GraniteConfig, {}, "sdpa"),
    "starcoder2 (sliding window)": (T.Starcoder2Config, dict(sliding_window=WINDOW), "sdpa"),
    "cohere": (T.CohereConfig, {}, "sdpa"),
    "gpt_oss (attention sinks, sliding window, MoE)": (T.GptOssConfig, dict(sliding_window=WINDOW, **MOE), "eager"),
    "stablelm (partial rotary, qk layernorm)": (T.StableLmConfig, dict(partial_rotary_factor=0.5, qk_layernorm=True,
                                                                      num_key_value_heads=4), "sdpa"),
    "stablelm (parallel residual)": (T.StableLmConfig, dict(use_parallel_residual=True), "sdpa"),
    "opt": (T.OPTConfig, dict(ffn_dim=64, word_embed_proj_dim=32, num_key_value_heads=None, head_dim=None), "sdpa"),
    # Length-dependent RoPE is fixed at max_model_len (daemon.rope); within the original context both equal
    # generate(). Beyond it: test_length_dependent_rope_is_fixed_once_for_every_request.
    "phi3 (LongRoPE, max_model_len within the original context)": (T.Phi3Config, LONGROPE, "sdpa"),
    "llama (dynamic NTK RoPE)": (T.LlamaConfig, DYNAMIC_ROPE, "sdpa"),
}

# Engine settings of a case beyond the defaults.
ENGINE_FIELDS = {"phi3 (LongRoPE, max_model_len within the original context)": dict(max_model_len=128)}

NO_ATTENTION_INTERFACE = "does not route its attention through transformers' AttentionInterface"
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=1, topk_group=1)

# name: (config class, its fields over BASE, what the start error must name)
REFUSED = {
    "llama4-style chunked attention": (T.LlamaConfig, dict(attention_chunk_size=WINDOW), "chunked attention"),
    "mamba (state-space layers)": (T.MambaConfig, dict(num_hidden_layers=2), "linear_attention"),
    "bloom (ALiBi in its own attention code)": (T.BloomConfig, dict(n_layer=2, n_head=4), NO_ATTENTION_INTERFACE),
    # transformers 5.2x routes Falcon's attention through the interface; its multi-query cache then fails the
    # engine's warmup (multi_query: one KV head against the config's num_key_value_heads), refused at start still
    "falcon (its own attention code)": (T.FalconConfig, dict(head_dim=None),
                                        f"{NO_ATTENTION_INTERFACE}|FalconForCausalLM failed its warmup request"),
    "mpt (ALiBi in its own attention code)": (T.MptConfig, dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256),
                                              NO_ATTENTION_INTERFACE),
    "deepseek_v3 (multi-head latent attention)": (T.DeepseekV3Config, MLA, "multi-head latent attention"),
    "jamba (mamba/attention hybrid)": (T.JambaConfig, dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                                                           expert_layer_period=2, expert_layer_offset=1,
                                                           mamba_d_state=4, mamba_dt_rank=4), "only attention"),
    "qwen3_next (linear-attention hybrid)": (T.Qwen3NextConfig, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
        "linear_attention"),
    "diffllama (its own attention over the cache)": (T.DiffLlamaConfig, {}, "differ from the model's own forward"),
    "jetmoe (mixture of attention heads)": (T.JetMoeConfig, {}, "differ from the model's own forward"),
    "rwkv (recurrent state, no KV cache)": (T.RwkvConfig, dict(num_hidden_layers=2), NO_ATTENTION_INTERFACE),
    "phimoe (sliding window only in its mask)": (T.PhimoeConfig, dict(sliding_window=WINDOW, **MOE),
                                                 "no layer passes it"),
    "openai-gpt (no KV cache)": (T.OpenAIGPTConfig, dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
                                 NO_ATTENTION_INTERFACE),
}


def _model(config_class, fields):
    config = config_class(**{k: v for k, v in {**BASE, **fields}.items() if v is not None})
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config).eval()


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    prompts[0] += [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(24)]  # well past the window
    return prompts + [prompts[0][:28] + [7, 8]]  # shares seven full blocks with the first


def _reference_and_engine(name: str, tokenizer, dtype: torch.dtype):
    """``generate()``'s tokens for each prompt alone, and a warmed engine over the same model."""
    config_class, fields, reference_attention = EXACT[name]
    model = _model(config_class, fields).to(dtype)
    model.set_attn_implementation(reference_attention)
    with torch.inference_mode():
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
            for p in _prompts()
        ]
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_blocks=200,
                          **ENGINE_FIELDS.get(name, {}))
    engine = Engine(model, tokenizer, config, eos_token_ids=(1,))
    engine.warmup()
    return expected, engine


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", EXACT)
def test_served_with_the_tokens_of_generate_alone(name, tokenizer):
    expected, engine = _reference_and_engine(name, tokenizer, torch.float32)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(_prompts())]
    pending = list(requests)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # staggered: each joins a running batch
            engine.add(pending.pop(0))
        for out in engine.step():
            assert hasattr(out, "token_id"), f"{name}: {out}"
        step += 1
    assert [r.output_token_ids for r in requests] == expected
    assert engine.stats().prefix_hits > 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("name", REFUSED)
def test_refused_at_start_with_the_feature_named(name, tokenizer):
    config_class, fields, feature = REFUSED[name]
    model = _model(config_class, fields)
    with pytest.raises(ModelRefused, match=feature):  # the daemon's start exits 2: no retry fixes it
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))
        engine.warmup()


@pytest.mark.parametrize("name", EXACT)
def test_bfloat16_serves_without_errors_and_agrees_up_to_near_ties(name, tokenizer):
    """In bfloat16 batched kernels round differently from batch-1 ones, so near-tied tokens flip.

    Measured over this zoo (21 architectures, 105 streams of 16 tokens): 1,605 of 1,680 tokens (95.5%) equal
    bfloat16 ``generate()`` up to each stream's first divergence (after it the contexts differ), and 90 streams
    equal it throughout. A broken kernel (NaN, wrong mask) agrees on almost nothing.
    """
    expected, engine = _reference_and_engine(name, tokenizer, torch.bfloat16)
    prompts = _prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    while engine.has_unfinished():
        for out in engine.step():
            assert hasattr(out, "token_id"), f"{name}: {out}"
    leading = 0
    for request, tokens in zip(requests, expected):
        assert len(request.output_token_ids) == NEW_TOKENS
        same = 0
        while same < NEW_TOKENS and request.output_token_ids[same] == tokens[same]:
            same += 1
        leading += same
    assert leading >= 0.5 * NEW_TOKENS * len(prompts), f"{name}: {leading} of {NEW_TOKENS * len(prompts)} agree"


def test_length_dependent_rope_is_fixed_once_for_every_request(tokenizer, caplog):
    """Beyond the original context LongRoPE takes the long factors for every request, whatever its companions.

    ``generate()`` picks them from the batch's largest position, so a short prompt would switch factors when a
    long one joins its batch. Here a prompt longer than the original context equals ``generate()`` alone (which
    also uses the long factors throughout), and a short prompt's tokens do not depend on its companion.
    """
    fields = dict(LONGROPE, original_max_position_embeddings=32,
                  rope_parameters={**LONGROPE["rope_parameters"], "original_max_position_embeddings": 32})
    model = _model(T.Phi3Config, fields)
    model.set_attn_implementation("sdpa")
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(40)]
    short_prompt = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(8)]
    with torch.inference_mode():
        expected = model.generate(torch.tensor([long_prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(long_prompt):].tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def serve(prompts):
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))
        requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
        for request in requests:
            engine.add(request)
        while engine.has_unfinished():
            engine.step()
        return [r.output_token_ids for r in requests]

    with caplog.at_level("INFO", logger="ringstream.engine"):
        together = serve([short_prompt, long_prompt])
    assert "longrope RoPE fixed at max_model_len=256 (long frequencies; original context 32)" in caplog.text
    assert together[1] == expected
    assert together[0] == serve([short_prompt])[0]
    # generate() would start the short prompt on the short factors (the documented difference); here it has the
    # long ones, as transformers computes them for a sequence past the original context.
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, seq_len=33)
    assert torch.equal(model.model.rotary_emb.inv_freq, long_inv_freq)


@pytest.mark.parametrize("name", ["llama", "gemma2 (softcapping, sliding window)",
                                  "gpt_oss (attention sinks, sliding window, MoE)"])
def test_served_through_the_daemons_loader(name, tokenizer, tmp_path):
    """``--model DIR`` loads with SDPA, or eager for a model that refuses SDPA, and serves the same tokens."""
    config_class, fields, _ = EXACT[name]
    _model(config_class, fields).save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    model = load_model(resolve_model_dir(tmp_path))
    expected, engine = _reference_and_engine(name, tokenizer, torch.float32)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, kv_cache_bytes=engine.kv_cache_bytes)
    served = Engine(model, tokenizer, config, eos_token_ids=(1,))  # pool sized by bytes: no profile
    served.warmup()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(_prompts())]
    for request in requests:
        served.add(request)
    while served.has_unfinished():
        served.step()
    assert [r.output_token_ids for r in requests] == expected


@pytest.mark.parametrize("config_class, fields", [(T.BloomConfig, dict(n_layer=2, n_head=4)),
                                                  (T.MptConfig, dict(d_model=32, n_heads=4, n_layers=2,
                                                                     max_seq_len=256))])
def test_loaded_models_outside_attention_interface_are_refused_by_name(config_class, fields, tokenizer, tmp_path):
    model = _model(config_class, fields)
    model.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    with pytest.raises(ModelError, match="ALiBi"):  # from the config, before anything loads
        resolve_model_dir(tmp_path)
    with pytest.raises(ModelRefused, match=NO_ATTENTION_INTERFACE):  # and by the engine's own check
        Engine(model, tokenizer, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))


def test_generation_config_logits_processors_are_named_at_start(tokenizer, caplog):
    """generate() applies generation_config.json's repetition_penalty even greedy; the engine says it does not."""
    model = _model(T.LlamaConfig, {})
    model.generation_config.repetition_penalty = 1.05
    with caplog.at_level("WARNING", logger="ringstream.engine"):
        Engine(model, tokenizer, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))
    assert "repetition_penalty=1.05" in caplog.text


@pytest.mark.parametrize("config_class, fields, feature", [
    (T.PhimoeConfig, dict(LONGROPE, original_max_position_embeddings=32, max_position_embeddings=256,
                          rope_parameters={**LONGROPE["rope_parameters"], "original_max_position_embeddings": 32,
                                           "short_mscale": 1.0, "long_mscale": 3.0}, **MOE),
     "longer sequence shares the batch"),
    (T.MistralConfig, dict(sliding_window=1), "sliding_window=1"),
    (T.OlmoeConfig, dict(sliding_window=20, num_experts=4, num_experts_per_tok=2), "differ from the model's own"),
])
def test_batch_or_window_dependent_models_are_refused(config_class, fields, feature, tokenizer):
    """Rotary code that takes its scale from the batch, a degenerate window, and a window the model's mask ignores
    (the start check's prompt runs past any window the config carries)."""
    model = _model(config_class, fields)
    with pytest.raises(ModelError, match=feature):
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))
        engine.warmup()


def test_a_window_in_a_config_whose_layers_are_all_full_is_not_refused(tokenizer):
    model = _model(T.Gemma3TextConfig, dict(sliding_window=WINDOW, query_pre_attn_scalar=8,
                                            layer_types=["full_attention"] * 4))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=200),
                        eos_token_ids=(1,))
    engine.warmup()

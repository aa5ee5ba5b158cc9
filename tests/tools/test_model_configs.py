"""Random-weight models shaped like published ones: exact shapes, a tokenizer of the model's vocabulary, served exactly."""

from __future__ import annotations

import json

import pytest
import torch

from ringstream.daemon.engine.engine import Engine, EngineRequest, SamplingParams, EngineConfig
from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir
from ringstream.daemon.engine.loader import load_model
from ringstream.tools import model_configs

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED_PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512}
NEW_TOKENS = 6


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_full_size_configs_have_the_published_shapes(name):
    assert model_configs.count_parameters(name) == PUBLISHED_PARAMETERS[name]
    config = model_configs.build_config(name)
    fields = model_configs.MODEL_CONFIGS[name]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert getattr(config, key) == fields[key], key
    assert config.rope_parameters["rope_theta"] == fields["rope_theta"]
    if name.startswith("llama"):
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == fields["rope_scaling"]["factor"]


def test_shrinking_keeps_head_size_and_head_ratio():
    fields = model_configs.config_dict("llama-3.1-8b", layers=2, hidden=1024)
    assert (fields["num_hidden_layers"], fields["hidden_size"], fields["head_dim"]) == (2, 1024, 128)
    assert (fields["num_attention_heads"], fields["num_key_value_heads"]) == (8, 2)
    assert fields["intermediate_size"] == 14336 // 4 and fields["vocab_size"] == 128256
    with pytest.raises(ValueError, match="multiple of 512"):
        model_configs.config_dict("llama-3.1-8b", hidden=700)
    with pytest.raises(ValueError, match="unknown model config"):
        model_configs.config_dict("gpt-5")
    with pytest.raises(ValueError, match="layers"):
        model_configs.config_dict("llama-3.2-1b", layers=0)


def test_qwen_tokenizer_matches_the_vocabulary_and_adds_no_bos(tmp_path):
    model_configs.write_tokenizer(tmp_path, 152064, "qwen2", 151643, 151643, 131072)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 152064
    assert tokenizer.token_to_id("<|endoftext|>") == 151643 and tokenizer.token_to_id("<|im_end|>") == 151645
    assert tokenizer.encode("ab").ids == [tokenizer.token_to_id("a"), tokenizer.token_to_id("b")]
    assert tokenizer.decode([152063, 300]) == " w152063 w300"


def test_tiny_variant_loads_through_the_daemon_and_serves_generate_tokens(tmp_path):
    out = model_configs.write_model(tmp_path / "m", "llama-3.2-1b", layers=2, hidden=256, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 128256
    assert config["rope_scaling" if "rope_scaling" in config else "rope_parameters"]["rope_type"] == "llama3"
    info = resolve_model_dir(out)
    assert (info.bos_token_id, info.eos_token_ids, info.vocab_size) == (128000, (128001,), 128256)
    tokenizer = load_tokenizer(info)
    assert tokenizer.get_vocab_size() == 128256
    assert tokenizer.encode("hi").ids[0] == 128000
    model = load_model(info)
    prompts = [tokenizer.encode(text).ids for text in ("hello world", "a longer prompt of some text", "x")]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out_ids = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            expected.append(out_ids[0, len(prompt):].tolist())
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_bytes=1 << 22))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, prompt, params) for i, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
    assert all(tokenizer.decode(ids) for ids in expected)  # every id decodes to text

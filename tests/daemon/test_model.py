"""Tests for daemon.model (model directory loading) and the default-model builder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ringstream.daemon.common.model_dir import (
    DEFAULT_MODEL_DIR,
    ModelError,
    ModelNotFound,
    ModelInfo,
    check_tokenizer_vocab,
    load_tokenizer,
    resolve_model_dir,
)
from ringstream.daemon.engine.loader import load_model

REPO_ROOT = Path(__file__).resolve().parents[2]

DEFAULT_BOS_ID = 0
DEFAULT_EOS_ID = 1
DEFAULT_PAD_ID = 2
DEFAULT_VOCAB = 4096
DEFAULT_MAX_LEN = 512
MAX_DEFAULT_MODEL_BYTES = 10 * 1024 * 1024
GREEDY_NEW_TOKENS = 24
MIN_PRINTABLE_FRACTION = 0.9
SMOKE_DOCS = 150
SMOKE_BATCH = 2

ROUND_TRIP_TEXTS = [
    "Return the number of items in the container.",
    "  leading spaces, trailing tab\t",
    "line one\nline two\n\n    indented = {'a': 1}\n",
    "emoji: 😀🎉👍🏽 and a flag 🇳🇴",
    "中文字符测试，日本語のテキスト、한국어",
    "Привет, мир! Ёлка и щётка.",
    "mixed: café naïve Ωmega ∑ x² → ∞",
    "",
]


def _printable_fraction(text: str) -> float:
    return sum(ch.isprintable() or ch.isspace() for ch in text) / len(text)


def _write_model_dir(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def default_info() -> ModelInfo:
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def default_model(default_info):
    return load_model(default_info)


@pytest.fixture(scope="module")
def auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


def test_default_model_info(default_info):
    assert default_info == ModelInfo(
        path=DEFAULT_MODEL_DIR.resolve(),
        max_model_len=DEFAULT_MAX_LEN,
        eos_token_ids=(DEFAULT_EOS_ID,),
        bos_token_id=DEFAULT_BOS_ID,
        vocab_size=DEFAULT_VOCAB,
        model_type="llama",
    )
    assert resolve_model_dir(str(DEFAULT_MODEL_DIR)) == default_info
    with pytest.raises(dataclasses.FrozenInstanceError):
        default_info.max_model_len = 1  # type: ignore[misc]


def test_default_model_fits_size_budget():
    size = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert size <= MAX_DEFAULT_MODEL_BYTES
    facts = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())
    assert facts["steps"] > 0 and facts["final_loss"] > 0


def test_default_tokenizer_special_tokens(default_info):
    tokenizer = load_tokenizer(default_info)
    assert tokenizer.get_vocab_size() == DEFAULT_VOCAB
    assert tokenizer.token_to_id("<s>") == DEFAULT_BOS_ID
    assert tokenizer.token_to_id("</s>") == DEFAULT_EOS_ID
    assert tokenizer.token_to_id("<pad>") == DEFAULT_PAD_ID
    assert tokenizer.encode("Return the").ids[0] == DEFAULT_BOS_ID


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizers_and_auto_tokenizer_agree(default_info, auto_tokenizer, text):
    tokenizer = load_tokenizer(default_info)
    ids = tokenizer.encode(text).ids
    assert ids == auto_tokenizer(text).input_ids
    assert ids[0] == DEFAULT_BOS_ID
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert auto_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_auto_tokenizer_special_ids(auto_tokenizer):
    assert auto_tokenizer.bos_token_id == DEFAULT_BOS_ID
    assert auto_tokenizer.eos_token_id == DEFAULT_EOS_ID
    assert auto_tokenizer.pad_token_id == DEFAULT_PAD_ID


def test_default_model_loads_in_eval_float32(default_model):
    import torch

    assert not default_model.training
    assert next(default_model.parameters()).dtype == torch.float32
    assert default_model.config.vocab_size == DEFAULT_VOCAB


def test_default_model_greedy_generation(default_info, default_model):
    import torch

    tokenizer = load_tokenizer(default_info)
    prompt = tokenizer.encode("Return the").ids
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = default_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=GREEDY_NEW_TOKENS,
            do_sample=False,
        )
    new_ids = out[0, len(prompt) :].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert text.strip()
    assert _printable_fraction(text) >= MIN_PRINTABLE_FRACTION


def test_load_model_bfloat16(default_info):
    import torch

    model = load_model(default_info, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_load_model_rejects_unknown_dtype(default_info):
    with pytest.raises(ModelError, match="unsupported dtype"):
        load_model(default_info, dtype="int3")


def test_load_model_wraps_bad_weights(tmp_path, default_info):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_text((DEFAULT_MODEL_DIR / name).read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match=str(broken.resolve())):
        load_model(resolve_model_dir(broken))


def test_resolve_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_dir(missing)


def test_resolve_file_instead_of_dir(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ModelError, match="not a directory"):
        resolve_model_dir(path)


def test_resolve_dir_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    with pytest.raises(ModelError, match="no tokenizer.json; ringstream needs a fast"):
        resolve_model_dir(tmp_path)


def test_resolve_dir_without_config(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_dir(tmp_path)


def test_resolve_malformed_config(tmp_path):
    _write_model_dir(tmp_path, {})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        resolve_model_dir(tmp_path)


def test_resolve_config_without_context_length(tmp_path):
    _write_model_dir(tmp_path, {"vocab_size": 10, "eos_token_id": 1})
    with pytest.raises(ModelError, match="context length"):
        resolve_model_dir(tmp_path)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_both(tmp_path, default_info):
    tokenizer = load_tokenizer(default_info)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    small = resolve_model_dir(_write_model_dir(tmp_path, {"vocab_size": 1000, "max_position_embeddings": 8,
                                                           "eos_token_id": 1}))
    with pytest.raises(ModelError, match=f"{size} tokens .* vocab_size is 1000"):
        check_tokenizer_vocab(tokenizer, small)
    check_tokenizer_vocab(tokenizer, dataclasses.replace(small, vocab_size=size))  # equal: served
    check_tokenizer_vocab(tokenizer, dataclasses.replace(small, vocab_size=size + 64))  # padded embedding


def test_resolve_config_without_eos(tmp_path):
    _write_model_dir(tmp_path, {"vocab_size": 10, "max_position_embeddings": 8})
    with pytest.raises(ModelError, match="eos_token_id"):
        resolve_model_dir(tmp_path)


def test_resolve_fallbacks_and_generation_config(tmp_path):
    info = resolve_model_dir(
        _write_model_dir(
            tmp_path,
            {"model_type": "gpt2", "vocab_size": 50, "n_positions": 64, "eos_token_id": 3},
            generation={"eos_token_id": [7, 9, 7], "bos_token_id": None},
        )
    )
    assert info.max_model_len == 64
    assert info.eos_token_ids == (7, 9)
    assert info.bos_token_id is None
    assert info.model_type == "gpt2"


def test_resolve_nested_text_config(tmp_path):
    config = {
        "model_type": "multimodal",
        "text_config": {"vocab_size": 50, "max_sequence_length": 32, "eos_token_id": [2]},
    }
    info = resolve_model_dir(_write_model_dir(tmp_path, config))
    assert (info.max_model_len, info.eos_token_ids, info.vocab_size) == (32, (2,), 50)




def test_make_model_smoke(tmp_path):
    import torch

    from ringstream.tools import make_model

    out = tmp_path / "tiny"
    threads = torch.get_num_threads()
    try:
        status = make_model.main(
            [
                "--out", str(out),
                "--max-steps", "2",
                "--max-docs", str(SMOKE_DOCS),
                "--batch-size", str(SMOKE_BATCH),
                "--threads", "2",
            ]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    facts = json.loads((out / "training.json").read_text())
    assert facts["steps"] == 2
    assert facts["corpus_docs"] == SMOKE_DOCS
    assert facts["batch_size"] == SMOKE_BATCH

    info = resolve_model_dir(out)
    assert info.eos_token_ids == (DEFAULT_EOS_ID,)
    assert info.bos_token_id == DEFAULT_BOS_ID
    model = load_model(info)
    tokenizer = load_tokenizer(info)
    input_ids = torch.tensor([tokenizer.encode("Return the").ids])
    with torch.inference_mode():
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
        )
    assert generated.shape == (1, input_ids.shape[1] + 4)


HUB_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "model.safetensors")


def _hub_cache(root: Path, repo: str, commit: str = "a" * 40, ref: str = "main",
               names: tuple[str, ...] = HUB_MODEL_FILES) -> Path:
    """A Hugging Face hub cache holding ``repo`` at ``commit`` (the layout huggingface_hub writes: each file of
    the snapshot a relative link to its blob)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir()
    for i, name in enumerate(names):
        (folder / "blobs" / f"{i:040x}").write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/{i:040x}")
    (folder / "refs").mkdir()
    (folder / "refs" / ref).write_text(commit)
    return snapshot


def test_a_hub_model_id_resolves_in_the_local_cache_offline(tmp_path, monkeypatch):
    from ringstream.daemon.common.model_dir import hub_cache_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    snapshot = _hub_cache(tmp_path / "hf" / "hub", "acme/tiny-chat")
    monkeypatch.chdir(tmp_path)
    info = resolve_model_dir("acme/tiny-chat")
    assert info.path == snapshot.resolve() and info.vocab_size > 0
    assert resolve_model_dir(f"acme/tiny-chat@{'a' * 40}").path == snapshot.resolve()
    with pytest.raises(ModelNotFound, match=r"acme/other is not in the Hugging Face cache .*hf download acme/other"):
        resolve_model_dir("acme/other")
    with pytest.raises(ModelError, match="--revision v2"):
        resolve_model_dir("acme/tiny-chat@v2")
    (tmp_path / "acme" / "tiny-chat").mkdir(parents=True)  # a local directory of that name wins over the hub
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_dir("acme/tiny-chat")


def test_an_incomplete_cache_snapshot_is_not_taken_for_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    # the config and tokenizer alone (an interrupted download, or one of the tokenizer only): no weights
    _hub_cache(tmp_path / "hub", "acme/partial", names=HUB_MODEL_FILES[:-1])
    with pytest.raises(ModelNotFound, match=r"acme/partial is incomplete in the Hugging Face cache .*no "
                                            r"\*\.safetensors.*hf download acme/partial"):
        resolve_model_dir("acme/partial")
    # a link whose blob is gone
    snapshot = _hub_cache(tmp_path / "hub", "acme/dangling")
    (snapshot / "config.json").resolve().unlink()
    with pytest.raises(ModelNotFound, match=r"incomplete .*no config.json \(a link to a missing blob\)"):
        resolve_model_dir("acme/dangling")
    # a sharded model missing a shard its index names
    snapshot = _hub_cache(tmp_path / "hub", "acme/sharded", names=HUB_MODEL_FILES[:-1])
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (snapshot / "model-00001-of-00002.safetensors").write_bytes((DEFAULT_MODEL_DIR / "model.safetensors").read_bytes())
    with pytest.raises(ModelNotFound, match="no model-00002-of-00002.safetensors"):
        resolve_model_dir("acme/sharded")


@pytest.mark.parametrize("name", ["acme/..", "acme/x@../..", "./x", "acme/.@main"])
def test_dot_parts_make_a_path_never_a_hub_id(tmp_path, monkeypatch, name):
    from ringstream.daemon.common.model_dir import hub_id

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert hub_id(name) is None
    with pytest.raises(ModelError) as caught:
        resolve_model_dir(name)
    assert "Hugging Face cache" not in str(caught.value)


def test_a_model_name_the_file_system_refuses_is_a_clear_refusal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="File name too long") as caught:
        resolve_model_dir("x" * 5000)
    assert not isinstance(caught.value, ModelNotFound)


def test_a_tokenizer_with_sparse_ids_is_judged_by_its_largest_id(tmp_path, default_info):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    sparse = Tokenizer(WordLevel({"<unk>": 0, "a": 1, "b": 1500}, unk_token="<unk>"))
    assert sparse.get_vocab_size() == 3
    with pytest.raises(ModelError, match="3 tokens with ids up to 1500 .* vocab_size is 1000"):
        check_tokenizer_vocab(sparse, dataclasses.replace(default_info, vocab_size=1000))
    check_tokenizer_vocab(sparse, dataclasses.replace(default_info, vocab_size=1501))


def test_a_cache_snapshot_is_served_under_its_hub_id():
    from ringstream.daemon.common.model_dir import model_name

    assert model_name("/c/hub/models--acme--tiny-chat/snapshots/" + "a" * 40) == "acme/tiny-chat"
    assert model_name("/srv/models/llama-3") == "llama-3"


@pytest.mark.parametrize("config,words", [
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 10,
      "max_position_embeddings": 8}, "BertForMaskedLM is not a causal LM"),
    ({"model_type": "bert", "vocab_size": 10, "max_position_embeddings": 8}, "bert is an encoder-only model"),
    ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True,
      "vocab_size": 10}, "encoder-decoder"),
    ({"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": 10, "eos_token_id": 0},
     "state-space"),
    ({"architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 10, "eos_token_id": 0},
     "ALiBi"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"], "vocab_size": 10},
     "linear_attention"),
])
def test_what_cannot_be_served_is_refused_for_its_real_reason_first(tmp_path, config, words):
    # before the context length, the tokenizer or the EOS id is looked at (none of these has all three)
    _write_model_dir(tmp_path, config)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=words):
        resolve_model_dir(tmp_path)


def test_a_model_without_a_context_length_is_served_at_the_one_given(tmp_path):
    _write_model_dir(tmp_path, {"vocab_size": 10, "eos_token_id": 1})
    with pytest.raises(ModelError, match="give one with --max-model-len"):
        resolve_model_dir(tmp_path)
    assert resolve_model_dir(tmp_path, max_model_len=256).max_model_len == 256


def test_a_missing_tokenizer_is_answered_with_what_writes_one(tmp_path):
    _write_model_dir(tmp_path, {"vocab_size": 10, "max_position_embeddings": 8, "eos_token_id": 1})
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="save_pretrained"):
        resolve_model_dir(tmp_path)


def _online(monkeypatch, tmp_path):
    """The hub reachable (at an endpoint the test sets), the cache under tmp_path."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import: an earlier test's offline setting stays there
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))


def test_a_hub_model_without_a_tokenizer_is_told_to_convert_into_a_copy(tmp_path, monkeypatch):
    from tests.daemon.hub_standin import hub_standin

    _online(monkeypatch, tmp_path)
    files = {name: (DEFAULT_MODEL_DIR / name).read_bytes() for name in ("config.json", "model.safetensors")}
    with hub_standin("acme/notok", files) as (endpoint, _):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(ModelError, match=r"cp -rL .* \./notok .*serve --model \./notok") as caught:
            resolve_model_dir("acme/notok")
    assert not isinstance(caught.value, ModelNotFound)
    assert "save_pretrained(\"/" not in str(caught.value)  # never into the cache


def test_a_hub_repo_without_safetensors_is_refused_for_it(tmp_path, monkeypatch):
    from tests.daemon.hub_standin import hub_standin

    _online(monkeypatch, tmp_path)
    files = {name: (DEFAULT_MODEL_DIR / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    files["pytorch_model.bin"] = b"pickled weights"
    with hub_standin("acme/binonly", files) as (endpoint, requests):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(ModelError, match=r"its repo on the hub has no \*\.safetensors") as caught:
            resolve_model_dir("acme/binonly")
    assert not isinstance(caught.value, ModelNotFound)  # exit 2: no retry brings safetensors
    assert not any("/resolve/" in path for _, path in requests)  # refused before any download


def test_an_unreachable_or_silent_hub_is_a_model_not_found(tmp_path, monkeypatch):
    import socket
    import time

    from ringstream.daemon.common import model_dir

    _online(monkeypatch, tmp_path)
    _hub_cache(tmp_path / "cache", "acme/partial", names=HUB_MODEL_FILES[:-1])  # the weights missing
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # nothing listens
    with pytest.raises(ModelNotFound, match="incomplete .*cannot be downloaded"):
        resolve_model_dir("acme/partial")  # not "its repo has no *.safetensors": the hub was never reached
    monkeypatch.setattr(model_dir, "HUB_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts, never answers
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(ModelNotFound, match="cannot be downloaded"):
            resolve_model_dir("acme/silent")
        assert time.monotonic() - started < 30


def test_a_hub_model_not_cached_is_downloaded_with_a_causal_lms_files_only(tmp_path, monkeypatch):
    from tests.daemon.hub_standin import hub_standin

    files = {name: (DEFAULT_MODEL_DIR / name).read_bytes()
             for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "model.safetensors")}
    files |= {"pytorch_model.bin": b"pickled weights", "README.md": b"# tiny"}
    _online(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    with hub_standin("acme/tiny", files) as (endpoint, requests):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        info = resolve_model_dir("acme/tiny")
        assert info.path == (tmp_path / "cache" / "models--acme--tiny" / "snapshots" / ("c" * 40)).resolve()
        assert sorted(p.name for p in info.path.iterdir()) == sorted(set(files) - {"pytorch_model.bin",
                                                                                   "README.md"})
        assert not any(path.endswith((".bin", ".md")) for _, path in requests)
        with pytest.raises(ModelNotFound, match=r"acme/nope .* cannot be downloaded .*hf download acme/nope"):
            resolve_model_dir("acme/nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from the cache now, the stand-in gone
    assert resolve_model_dir("acme/tiny").path == info.path


def test_an_incomplete_cache_snapshot_is_completed_when_online(tmp_path, monkeypatch):
    from tests.daemon.hub_standin import hub_standin

    files = {name: (DEFAULT_MODEL_DIR / name).read_bytes() for name in HUB_MODEL_FILES}
    _online(monkeypatch, tmp_path)
    snapshot = _hub_cache(tmp_path / "cache", "acme/half", commit="c" * 40, names=HUB_MODEL_FILES[:-1])
    with hub_standin("acme/half", files) as (endpoint, requests):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        info = resolve_model_dir("acme/half")
    assert info.path == snapshot.resolve() and (snapshot / "model.safetensors").is_file()
    assert ("GET", "/acme/half/resolve/" + "c" * 40 + "/model.safetensors") in requests


def test_ids_outside_the_vocabulary_from_the_post_processor_or_the_config_are_refused(tmp_path, default_info):
    from tokenizers import Tokenizer, processors
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 9999)])
    with pytest.raises(ModelError, match="post-processor adds the id 9999, outside the model's vocab_size of 100"):
        check_tokenizer_vocab(tokenizer, dataclasses.replace(default_info, vocab_size=100, bos_token_id=None,
                                                            eos_token_ids=(1,)))
    plain = Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(ModelError, match="eos_token_id is 7000"):
        check_tokenizer_vocab(plain, dataclasses.replace(default_info, vocab_size=100, eos_token_ids=(1, 7000)))
    with pytest.raises(ModelError, match="bos_token_id is 7000"):
        check_tokenizer_vocab(plain, dataclasses.replace(default_info, vocab_size=100, eos_token_ids=(1,),
                                                         bos_token_id=7000))
    check_tokenizer_vocab(plain, dataclasses.replace(default_info, vocab_size=100, eos_token_ids=(1,),
                                                     bos_token_id=None))


def test_an_empty_model_name_is_refused_as_such(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="model: empty"):
        resolve_model_dir("")

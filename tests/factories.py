"""Test factories: tiny, deterministic Hugging Face model directories.

``make_tiny_model_dir`` writes a randomly initialised ``LlamaForCausalLM`` and a
byte-level BPE tokenizer, both in the on-disk layout that
``transformers.AutoModelForCausalLM.from_pretrained`` and
``tokenizers.Tokenizer.from_file`` read, so tests exercise the same loading path
as a real checkpoint while staying fast on a CPU.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import torch

from ringstream.tools.make_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

TINY_VOCAB_SIZE = 512
TINY_HIDDEN_SIZE = 64
TINY_INTERMEDIATE_SIZE = 128
TINY_NUM_LAYERS = 2
TINY_NUM_HEADS = 4
TINY_NUM_KV_HEADS = 2
TINY_MAX_POSITION_EMBEDDINGS = 256

# Extra text so that the byte-level BPE learns merges over non-ASCII scripts
# (Cyrillic, CJK, emoji) used by the detokenizer tests.
_MULTILINGUAL_TEXT = (
    "Привет, мир! Быстрая коричневая лиса прыгает через ленивую собаку.\n"
    "你好，世界！快速的棕色狐狸跳过了懒狗。\n"
    "Emoji: 🙂 🚀 👍🏽 🇩🇪 ✨ — naïve café déjà vu.\n"
)


def _training_corpus() -> list[str]:
    """Return a few KB of deterministic English and multilingual text.

    The text is the docstrings of a couple of standard-library modules, which are
    fixed for a given Python version, so the trained tokenizer is reproducible.
    """
    import collections
    import json as json_module

    texts: list[str] = []
    for module in (json_module, collections, textwrap):
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    texts.extend([_MULTILINGUAL_TEXT] * 4)
    return texts


def make_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """Train a small byte-level BPE ``tokenizers.Tokenizer`` in about a second.

    The same recipe as the default model's (:func:`ringstream.tools.make_model.train_tokenizer`):
    ``<s>`` (id 0), ``</s>`` (id 1), ``<pad>`` (id 2); the post-processor prepends ``<s>``.
    """
    return train_tokenizer(_training_corpus(), vocab_size)


def make_tiny_model_dir(path: str | Path, seed: int = 0) -> Path:
    """Write a random-init tiny Llama checkpoint plus tokenizer to ``path``.

    The directory holds ``config.json``, ``model.safetensors``,
    ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``.
    Model: hidden 64, 2 layers, 4 query heads over 2 KV heads (grouped-query
    attention), ``max_position_embeddings`` 256, vocabulary the size of the
    trained tokenizer. Weights come from ``torch.manual_seed(seed)`` so the same
    seed gives the same checkpoint.

    Returns the directory as a ``Path``.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=TINY_HIDDEN_SIZE,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        num_key_value_heads=TINY_NUM_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITION_EMBEDDINGS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out)

    save_tokenizer(tokenizer, out)
    return out


def load_model(model_dir: str | Path):
    """Load a checkpoint written by ``make_tiny_model_dir`` (or any HF causal LM).

    float32, SDPA attention, local files only, in eval mode.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()


def load_tokenizer(model_dir: str | Path):
    """Load ``tokenizer.json`` from ``model_dir`` as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

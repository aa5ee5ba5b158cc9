"""Random-weight models shaped like published ones, written as Hugging Face directories (no download).

``python -m ringstream.tools.model_configs --name llama-3.2-1b --out DIR [--layers N] [--hidden N]
[--dtype bfloat16] [--device cuda:0]`` writes ``config.json`` (the published model's own fields:
hidden size, layers, heads, KV heads, head size, intermediate size, vocabulary, RoPE theta and scaling,
context length, tied embeddings, BOS / EOS ids), ``generation_config.json``, random weights as
safetensors, and a tokenizer whose vocabulary has exactly the model's ``vocab_size`` entries, so every
id a model can emit decodes to text.

The tokenizer is byte-level BPE without merges: ids 0-255 are the 256 byte symbols (text encodes to
bytes), the special tokens sit at the published ids (``<|begin_of_text|>`` at 128000 for Llama 3,
``<|endoftext|>`` at 151643 for Qwen 2.5), and every other id is a filler word ``" w<id>"`` made of
byte symbols, which the byte-level decoder turns back into text.

Throughputs measured on such a model are those of the real one (same shapes, same kernels); its
tokens are noise. ``--layers`` and ``--hidden`` shrink it for smoke runs (the head size, the
query / KV head ratio and the vocabulary stay as published).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["MODEL_CONFIGS", "build_config", "config_dict", "count_parameters", "write_model", "write_tokenizer"]

_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
MODEL_CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": _LLAMA3_COMMON | {
        "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": _LLAMA3_COMMON | {
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    # Qwen/Qwen2.5-7B config.json
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    },
}
"""The published ``config.json`` fields of each model, by name."""

SPECIAL_TOKENS = {
    "llama": {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>"},
    "qwen2": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
}
"""Special tokens at their published ids, by ``model_type``."""
ADDS_BOS = {"llama": True, "qwen2": False}
"""Whether the model's tokenizer starts each encoding with BOS (Llama 3 does, Qwen 2.5 does not)."""
BYTE_SYMBOLS = 256
SAVED_FILE_MODE = 0o644


def config_dict(name: str, layers: int | None = None, hidden: int | None = None) -> dict:
    """The ``config.json`` fields of model ``name``, optionally shrunk.

    Args:
        name: a key of :data:`MODEL_CONFIGS`.
        layers: number of decoder layers instead of the published one.
        hidden: hidden size instead of the published one; the head size and the query / KV head
            ratio stay, the heads and the intermediate size scale with it. Must be a multiple of
            ``head_dim * (heads / kv_heads)``.

    Raises:
        ValueError: unknown name, or a layer count or hidden size out of range.
    """
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; expected one of {', '.join(MODEL_CONFIGS)}")
    fields = json.loads(json.dumps(MODEL_CONFIGS[name]))
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        fields["num_hidden_layers"] = layers
        if "max_window_layers" in fields:
            fields["max_window_layers"] = layers
    if hidden is not None:
        heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
        head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
        unit = head_dim * (heads // kv_heads)
        if hidden < unit or hidden % unit:
            raise ValueError(f"hidden must be a positive multiple of {unit} for {name}, got {hidden}")
        fields["intermediate_size"] = fields["intermediate_size"] * hidden // fields["hidden_size"]
        fields["num_attention_heads"] = hidden // head_dim
        fields["num_key_value_heads"] = hidden // unit
        fields["head_dim"] = head_dim
        fields["hidden_size"] = hidden
    return fields


def build_config(name: str, layers: int | None = None, hidden: int | None = None):
    """The transformers config of :func:`config_dict` (``LlamaConfig``, ``Qwen2Config``)."""
    from transformers import AutoConfig

    fields = config_dict(name, layers, hidden)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def count_parameters(name: str, layers: int | None = None, hidden: int | None = None) -> int:
    """Parameters of the model (tied embeddings counted once), counted on the meta device: no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(name, layers, hidden))
    return sum(p.numel() for p in model.parameters())


def write_tokenizer(out: Path, vocab_size: int, model_type: str, bos_token_id: int, eos_token_id: int,
                    max_length: int) -> None:
    """Write ``tokenizer.json`` and its transformers sidecars: byte-level BPE of exactly ``vocab_size`` ids.

    Raises:
        ValueError: ``vocab_size`` leaves no room for the bytes and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = dict(SPECIAL_TOKENS.get(model_type, {}))
    specials.setdefault(bos_token_id, "<s>")
    specials.setdefault(eos_token_id, "</s>")
    if vocab_size <= BYTE_SYMBOLS or min(specials) < BYTE_SYMBOLS or max(specials) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 byte symbols and special ids {sorted(specials)}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    space = "\u0120"  # the byte-level symbol of " "
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for i in range(BYTE_SYMBOLS, vocab_size):
        vocab[specials.get(i, f"{space}w{i}")] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials.values()))
    bos, eos = specials[bos_token_id], specials[eos_token_id]
    if ADDS_BOS.get(model_type, True):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {vocab_size}")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=eos,
        clean_up_tokenization_spaces=False, model_max_length=max_length,
    ).save_pretrained(out)


def write_model(out: str | Path, name: str, *, layers: int | None = None, hidden: int | None = None,
                dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> Path:
    """Write a random-weight model directory of ``name`` (see the module docstring) into ``out``.

    The weights are initialised on ``device`` (on CUDA an 8B model takes seconds) in ``dtype`` and
    saved as safetensors. Returns ``out`` as a ``Path``.

    Raises:
        ValueError: unknown name, bad sizes, or an unsupported dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(name, layers, hidden)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    del model
    eos = config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos).save_pretrained(out)
    write_tokenizer(out, config.vocab_size, config.model_type, config.bos_token_id,
                    eos[0] if isinstance(eos, list) else eos, config.max_position_embeddings)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(SAVED_FILE_MODE)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.model_configs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--layers", type=int, help="decoder layers (default: as published)")
    parser.add_argument("--hidden", type=int, help="hidden size (default: as published)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (e.g. cuda:0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write_model(args.out, args.name, layers=args.layers, hidden=args.hidden, dtype=args.dtype,
                    device=args.device, seed=args.seed)
    except ValueError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build ringstream's built-in default model from the local Python standard library.

The default model lets the daemon, its tests and its benchmarks run on any host
without downloading weights.  Everything here works offline:

1. **Corpus** -- the module, class and function docstrings of the running
   interpreter's standard library, read with :mod:`ast` (nothing is imported),
   in sorted path order, cleaned with :func:`inspect.cleandoc` and deduplicated.
2. **Tokenizer** -- a byte-level BPE (``vocab_size`` 4096) trained with the
   ``tokenizers`` library.  Its post-processor prepends ``<s>``, so the raw
   ``tokenizers.Tokenizer`` and ``transformers.AutoTokenizer`` produce the same
   ids for the same text.
3. **Model** -- a small Llama-architecture causal LM (about 4.2 M parameters,
   tied embeddings) trained from scratch with AdamW, linear warmup and cosine
   decay, on 256-token sequences packed from the documents separated by
   ``</s>`` (forward pass under bfloat16 autocast where the CPU supports it
   natively).  Training stops after ``--minutes`` of wall time or
   ``--max-steps`` optimizer steps, whichever comes first.
4. **Output** -- a standard Hugging Face directory: ``config.json``,
   ``generation_config.json``, ``model.safetensors`` (bfloat16),
   ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
   and ``training.json`` with the facts of the run.

Usage::

    python -m ringstream.tools.make_model --out daemon/default_model --minutes 10 --threads 2
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Order fixes the ids: <s> = 0, </s> = 1, <pad> = 2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these tools:\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools>\nTo call one, answer with <tool_call>{\"name\": NAME, "
    "\"arguments\": ARGUMENTS}</tool_call>.{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": {{ call.function.name | tojson }}, "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The default model's chat template (``tokenizer_config.json``): ``<s><|user|>\nhi</s>\n<|assistant|>\n``;
with ``tools``, a system turn listing them and Hermes' call format (``<tool_call>{"name", "arguments"}
</tool_call>``), which an assistant turn's ``tool_calls`` render in and a ``tool`` turn answers. The model never
saw chats, so its replies are docstring prose; the template lets chat and tool requests run end to end."""

VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 688
NUM_LAYERS = 4
NUM_HEADS = 8
MAX_POSITIONS = 512
ROPE_THETA = 10000.0

SEQ_LEN = 256
BATCH_SIZE = 32
PEAK_LR = 3e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP_NORM = 1.0
LOG_EVERY_STEPS = 20
# Exponential smoothing factor for the reported loss.
LOSS_EMA_DECAY = 0.9

# Docstrings shorter than this (in characters, after cleaning) carry no prose.
MIN_DOC_CHARS = 16
# Directory names under the stdlib root whose contents are not library code.
SKIPPED_DIR_NAMES = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)

MAX_SAVED_BYTES = 10 * 1024 * 1024
# Saved files must be readable by the daemon's own (possibly different) user.
SAVED_FILE_MODE = 0o644
DEFAULT_MINUTES = 10.0
DEFAULT_THREADS = 2
DEFAULT_SEED = 0
SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True)
class TrainingFacts:
    """What a training run did; written to ``training.json``.

    Attributes:
        steps: optimizer steps taken.
        tokens_seen: training tokens consumed (``steps * batch_size * SEQ_LEN``).
        batch_size: sequences per optimizer step.
        final_loss: smoothed training cross-entropy at the end, in nats/token.
        seconds: wall time of the training loop, in seconds.
        corpus_docs: number of docstrings in the corpus.
        corpus_chars: characters in the corpus.
        corpus_tokens: tokens in the packed corpus, separators included.
        parameters: trainable parameters (tied embeddings counted once).
        seed: the ``torch.manual_seed`` value.
        threads: torch intra-op threads used.
        bf16_autocast: whether the forward pass ran under bfloat16 autocast.
        python_version: interpreter whose stdlib formed the corpus.
    """

    steps: int
    tokens_seen: int
    batch_size: int
    final_loss: float
    seconds: float
    corpus_docs: int
    corpus_chars: int
    corpus_tokens: int
    parameters: int
    seed: int
    threads: int
    bf16_autocast: bool
    python_version: str


def _is_skipped_dir(name: str) -> bool:
    return name in SKIPPED_DIR_NAMES or name.startswith("test")


def iter_stdlib_sources(stdlib: Path) -> Iterator[Path]:
    """Yield the stdlib's ``.py`` files in deterministic (sorted) order.

    Args:
        stdlib: root of the standard library, e.g. ``/usr/lib/python3.11``.

    Yields:
        Paths of Python source files, skipping test directories, ``test*``
        modules and installed third-party packages.
    """
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if not _is_skipped_dir(d))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test"):
                yield Path(root) / name


def _docstrings_of(source: bytes) -> Iterator[str]:
    with warnings.catch_warnings():
        # Old modules trip invalid-escape warnings; they are not our concern.
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield inspect.cleandoc(doc)


def collect_corpus(stdlib: Path | None = None, max_docs: int | None = None) -> list[str]:
    """Collect the deduplicated docstrings of the standard library.

    Args:
        stdlib: stdlib root; defaults to ``sysconfig.get_paths()["stdlib"]``.
        max_docs: stop after this many documents (for quick smoke runs).

    Returns:
        Documents in first-seen order (sorted file paths, then AST walk order),
        each at least ``MIN_DOC_CHARS`` characters long.

    Raises:
        RuntimeError: no docstrings were found under ``stdlib``.
    """
    root = Path(stdlib) if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs: list[str] = []
    for path in iter_stdlib_sources(root):
        try:
            source = path.read_bytes()
        except OSError:
            continue
        for doc in _docstrings_of(source):
            if len(doc) < MIN_DOC_CHARS or doc in seen:
                continue
            seen.add(doc)
            docs.append(doc)
            if max_docs is not None and len(docs) >= max_docs:
                return docs
    if not docs:
        raise RuntimeError(f"no docstrings found under {root}")
    return docs


def train_tokenizer(docs: Sequence[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose encodings start with ``<s>``.

    Args:
        docs: training texts.
        vocab_size: target vocabulary size, special tokens included.

    Returns:
        A ``tokenizers.Tokenizer`` with ids 0/1/2 = ``<s>``/``</s>``/``<pad>``,
        a ByteLevel pre-tokenizer (no prefix space), ByteLevel decoder and a
        template post-processor that prepends ``<s>``.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def pack_corpus(tokenizer: Tokenizer, docs: Sequence[str]):
    """Concatenate the documents into one token stream.

    Each document is encoded without special tokens and followed by ``</s>``;
    the stream starts with ``<s>``.

    Args:
        tokenizer: tokenizer from :func:`train_tokenizer`.
        docs: the corpus.

    Returns:
        1-D ``torch.long`` tensor of token ids.
    """
    import torch

    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = [tokenizer.token_to_id(BOS_TOKEN)]
    for encoding in tokenizer.encode_batch(list(docs), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def build_config(tokenizer: Tokenizer):
    """Return the ``LlamaConfig`` of the default model for ``tokenizer``'s ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
    )


def learning_rate(step: int, progress: float, warmup_steps: int = WARMUP_STEPS) -> float:
    """Warmup-then-cosine schedule.

    Args:
        step: zero-based optimizer step.
        progress: fraction in ``[0, 1]`` of the training budget used so far
            (steps or wall time, whichever runs out first).
        warmup_steps: steps of the linear ramp.

    Returns:
        ``min(1, (step + 1) / warmup_steps)`` times a cosine that falls from
        ``PEAK_LR`` at progress 0 to ``PEAK_LR * MIN_LR_FRACTION`` at progress 1.
    """
    ramp = min(1.0, (step + 1) / max(1, warmup_steps))
    progress = min(1.0, max(0.0, progress))
    floor = PEAK_LR * MIN_LR_FRACTION
    return ramp * (floor + (PEAK_LR - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _batches(stream, generator, batch_size: int) -> Iterator:
    """Yield ``[batch_size, SEQ_LEN]`` windows, covering the stream epoch by epoch."""
    import torch

    n_windows = (stream.numel() - 1) // SEQ_LEN
    if n_windows < 1:
        raise RuntimeError(f"corpus has {stream.numel()} tokens; need more than {SEQ_LEN}")
    windows = stream[: n_windows * SEQ_LEN].view(n_windows, SEQ_LEN)
    while True:
        order = torch.randperm(n_windows, generator=generator)
        # Small corpora repeat windows so that every batch is full.
        reps = math.ceil(batch_size / n_windows)
        order = order.repeat(reps) if reps > 1 else order
        for start in range(0, order.numel() - batch_size + 1, batch_size):
            yield windows[order[start : start + batch_size]]


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (e.g. AVX512-BF16 or AMX)."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def train(
    model,
    stream,
    *,
    seconds: float,
    max_steps: int | None,
    seed: int,
    batch_size: int,
    bf16_autocast: bool,
):
    """Train ``model`` in place on ``stream`` until the time or step budget ends.

    Args:
        model: a ``LlamaForCausalLM`` in float32 on CPU.
        stream: 1-D token tensor from :func:`pack_corpus`.
        seconds: wall-time budget in seconds.
        max_steps: optional cap on optimizer steps.
        seed: seeds the batch order.
        batch_size: sequences per optimizer step.
        bf16_autocast: run the forward pass under CPU bfloat16 autocast
            (weights and optimizer state stay float32).

    Returns:
        ``(steps, final_loss, elapsed_seconds)``; loss is smoothed nats/token.
    """
    import torch

    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=ADAM_BETAS,
    )
    generator = torch.Generator().manual_seed(seed)
    batches = _batches(stream, generator, batch_size)
    model.train()

    warmup = WARMUP_STEPS if max_steps is None else min(WARMUP_STEPS, max(1, max_steps // 10))
    start = time.monotonic()
    step = 0
    smoothed: float | None = None
    while True:
        # The schedule follows whichever budget (time or steps) is nearer its end.
        progress = (time.monotonic() - start) / seconds
        if max_steps is not None:
            progress = max(progress, step / max_steps)
        if progress >= 1.0:
            break
        lr = learning_rate(step, progress, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
        optimizer.step()
        value = loss.item()
        if smoothed is None:
            smoothed = value
        else:
            smoothed = LOSS_EMA_DECAY * smoothed + (1 - LOSS_EMA_DECAY) * value
        step += 1
        if step % LOG_EVERY_STEPS == 0 or step == 1:
            print(
                f"step {step:5d}  loss {smoothed:.3f}  lr {lr:.2e}  "
                f"{time.monotonic() - start:7.1f}s",
                flush=True,
            )
    model.eval()
    final_loss = smoothed if smoothed is not None else float("nan")
    return step, final_loss, time.monotonic() - start


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """Write ``tokenizer.json`` and the transformers sidecar files into ``out``, :data:`CHAT_TEMPLATE` in
    ``tokenizer_config.json`` (whatever file a transformers version would put it in)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_model(model, config, out: Path) -> None:
    """Write ``config.json``, ``generation_config.json`` and bf16 safetensors weights."""
    import torch
    from transformers import GenerationConfig

    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)


def directory_bytes(path: Path) -> int:
    """Total size in bytes of the regular files directly inside ``path``."""
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def make_model(
    out: Path,
    *,
    minutes: float = DEFAULT_MINUTES,
    threads: int = DEFAULT_THREADS,
    seed: int = DEFAULT_SEED,
    max_steps: int | None = None,
    max_docs: int | None = None,
    batch_size: int = BATCH_SIZE,
) -> TrainingFacts:
    """Build the corpus and tokenizer, train the model and save everything to ``out``.

    Args:
        out: output directory (created if missing; existing files overwritten).
        minutes: wall-time budget for the training loop, in minutes.
        threads: torch intra-op threads.
        seed: seed for weight init and batch order.
        max_steps: optional cap on optimizer steps.
        max_docs: optional cap on corpus documents (smoke runs).
        batch_size: sequences of ``SEQ_LEN`` tokens per optimizer step.

    Returns:
        The :class:`TrainingFacts` also written to ``out/training.json``.

    Raises:
        RuntimeError: the corpus is empty or too small, or the saved model
            exceeds ``MAX_SAVED_BYTES``.
    """
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)

    docs = collect_corpus(max_docs=max_docs)
    corpus_chars = sum(len(d) for d in docs)
    print(f"corpus: {len(docs)} docstrings, {corpus_chars} characters", flush=True)

    tokenizer = train_tokenizer(docs)
    stream = pack_corpus(tokenizer, docs)
    print(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, corpus {stream.numel()} tokens",
        flush=True,
    )

    config = build_config(tokenizer)
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    bf16_autocast = cpu_has_fast_bf16()
    print(
        f"model: {parameters} parameters; bf16 autocast {'on' if bf16_autocast else 'off'}",
        flush=True,
    )

    steps, final_loss, seconds = train(
        model,
        stream,
        seconds=minutes * SECONDS_PER_MINUTE,
        max_steps=max_steps,
        seed=seed,
        batch_size=batch_size,
        bf16_autocast=bf16_autocast,
    )

    save_tokenizer(tokenizer, out)
    save_model(model, config, out)
    facts = TrainingFacts(
        steps=steps,
        tokens_seen=steps * batch_size * SEQ_LEN,
        batch_size=batch_size,
        final_loss=round(final_loss, 4),
        seconds=round(seconds, 1),
        corpus_docs=len(docs),
        corpus_chars=corpus_chars,
        corpus_tokens=int(stream.numel()),
        parameters=parameters,
        seed=seed,
        threads=threads,
        bf16_autocast=bf16_autocast,
        python_version=".".join(map(str, sys.version_info[:3])),
    )
    (out / "training.json").write_text(json.dumps(asdict(facts), indent=2) + "\n")
    for path in out.iterdir():
        if path.is_file():
            path.chmod(SAVED_FILE_MODE)

    size = directory_bytes(out)
    if size > MAX_SAVED_BYTES:
        raise RuntimeError(f"{out} holds {size} bytes; the limit is {MAX_SAVED_BYTES}")
    print(
        f"saved {out}: {size / 1e6:.2f} MB, {steps} steps, loss {final_loss:.3f}, "
        f"{seconds / SECONDS_PER_MINUTE:.1f} min",
        flush=True,
    )
    return facts


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python -m ringstream.tools.make_model``."""
    parser = argparse.ArgumentParser(
        prog="python -m ringstream.tools.make_model",
        description="Train ringstream's default model offline from stdlib docstrings.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--minutes",
        type=_positive_float,
        default=DEFAULT_MINUTES,
        help=f"training wall-time budget in minutes (default {DEFAULT_MINUTES:g})",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=DEFAULT_THREADS,
        help=f"torch CPU threads (default {DEFAULT_THREADS})",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")
    parser.add_argument(
        "--max-steps", type=_positive_int, default=None, help="stop after this many steps"
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=BATCH_SIZE,
        help=f"sequences of {SEQ_LEN} tokens per step (default {BATCH_SIZE})",
    )
    parser.add_argument(
        "--max-docs",
        type=_positive_int,
        default=None,
        help="use only the first N docstrings (quick smoke runs)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)
    make_model(
        args.out,
        minutes=args.minutes,
        threads=args.threads,
        seed=args.seed,
        max_steps=args.max_steps,
        max_docs=args.max_docs,
        batch_size=args.batch_size,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

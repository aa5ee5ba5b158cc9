"""Throughput of the generation engine against a bare batched decode loop.

Runs the same workload twice, in one process, on the same model:

(a) bare loop: the ceiling. All prompts in one lockstep batch over a
    preallocated KV cache sized exactly to the workload (the engine's is
    sized to ``max_model_len``): prefill (in the same token-budget chunks as
    the engine), then ``max_tokens - 1`` decode forwards of the whole batch
    with greedy argmax. No scheduling, no per-row positions or
    masks, no detokenization, no per-request bookkeeping.
(b) engine: ``ringstream.daemon.engine.engine.Engine`` serving the prompts as independent greedy
    requests (admission, per-row positions and masks, sampling, incremental
    detokenization, stop checks, one ``TokenOutput`` per token).

Both rates are generated tokens per second of wall time, prefill included, and
the ratio (b)/(a) is the engine's efficiency. The median time of a decode step
over the full batch is printed too (the per-step serving overhead, without
prefill). The tool also checks that both produced the same tokens.

Model: ``--model-dir``, else ``daemon/default_model`` when it holds a
``config.json``, else a random-init Llama of the default model's shape
(vocab 4096, hidden 256, 4 layers, 8 heads, 512 positions) with a small
trained tokenizer.

Usage::

    python -m ringstream.tools.bench_engine [--batch 64] [--prompt-len 64] [--max-tokens 32]
        [--repeats 3] [--threads N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Huge pages for large CPU tensors, as ringstream's workers have them (daemon.front.worker_pool.HUGE_PAGES_ENV);
# read by PyTorch at its first allocation, so set before torch loads. Set it to 0 to compare.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from ringstream.daemon.worker.malloc_tuning import retain_freed_memory

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "daemon" / "default_model"
DEFAULT_BATCH = 64
DEFAULT_PROMPT_LEN = 64
DEFAULT_MAX_TOKENS = 32
DEFAULT_REPEATS = 3
PROMPT_SEED = 1234
WARMUP_PROMPT_LEN = 8
# Shape of the default model, used when no checkpoint is available.
FALLBACK_VOCAB_SIZE = 4096
FALLBACK_HIDDEN_SIZE = 256
FALLBACK_INTERMEDIATE_SIZE = 688
FALLBACK_NUM_LAYERS = 4
FALLBACK_NUM_HEADS = 8
FALLBACK_MAX_POSITIONS = 512
# Lowest token id used in random prompts (skips special tokens).
FIRST_ORDINARY_TOKEN_ID = 3


class LockstepKVCache:
    """Minimal static cache for the bare loop: every row sits at the same position.

    Buffers ``[batch, num_kv_heads, capacity, head_dim]`` per layer; ``rows``
    selects the batch rows of the next forward and ``start`` the column it
    writes at. ``update`` copies the new ``[rows, kv_heads, q, head_dim]``
    keys/values into columns ``[start, start + q)`` and returns views of
    columns ``[0, start + q)``.
    """

    def __init__(self, config, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.start = 0
        self.rows = slice(None)

    def update(self, key_states, value_states, layer_idx, kwargs=None):
        """Store ``[batch, kv_heads, q, head_dim]`` keys/values at ``start``; return the filled columns."""
        end = self.start + key_states.shape[2]
        self.keys[layer_idx][self.rows, :, self.start : end] = key_states
        self.values[layer_idx][self.rows, :, self.start : end] = value_states
        return self.keys[layer_idx][self.rows, :, :end], self.values[layer_idx][self.rows, :, :end]


def cache_argument(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.18) or ``past_key_values`` (before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def bare_decode_loop(
    model, prompts: torch.Tensor, max_tokens: int, prefill_tokens: int
) -> tuple[torch.Tensor, float, list[float]]:
    """Greedy lockstep generation of ``max_tokens`` tokens for ``prompts [batch, prompt_len]``.

    The prefill runs in row chunks of at most ``prefill_tokens`` tokens (the
    engine's ``max_num_batched_tokens``; on CPU smaller chunks are also
    faster), then all rows decode together, on the model's device (each
    step ends with the sampled tokens on the host, as the engine's does).

    Returns ``(tokens [batch, max_tokens], seconds, decode step seconds)``.
    """
    batch, prompt_len = prompts.shape
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    prompts = prompts.to(device)
    with torch.inference_mode():
        cache = LockstepKVCache(model.config, batch, prompt_len + max_tokens, dtype, device)
        cache_arg = {cache_argument(model): cache}
        causal = torch.full((prompt_len, prompt_len), float("-inf"), dtype=dtype, device=device).triu_(1)
        decode_mask = torch.zeros((1, 1, 1, prompt_len + max_tokens), dtype=dtype, device=device)
        generated = torch.empty((batch, max_tokens), dtype=torch.long, device=device)
        start = time.perf_counter()
        positions = torch.arange(prompt_len, device=device).unsqueeze(0).expand(batch, -1)
        chunk = max(1, prefill_tokens // prompt_len)
        for first in range(0, batch, chunk):
            cache.rows = slice(first, first + chunk)
            logits = model(
                input_ids=prompts[cache.rows],
                attention_mask=causal.view(1, 1, prompt_len, prompt_len),
                position_ids=positions[cache.rows],
                **cache_arg,
                logits_to_keep=1,
            ).logits[:, -1]
            generated[cache.rows, 0] = logits.argmax(dim=-1)
        cache.rows = slice(None)
        token = generated[:, 0]
        step_times = []
        for i in range(1, max_tokens):
            step_start = time.perf_counter()
            cache.start = prompt_len + i - 1
            position = torch.full((batch, 1), cache.start, dtype=torch.long, device=device)
            logits = model(
                input_ids=token.unsqueeze(1),
                attention_mask=decode_mask[..., : cache.start + 1],
                position_ids=position,
                **cache_arg,
            ).logits[:, -1]
            token = logits.argmax(dim=-1)
            generated[:, i] = token
            token.tolist()
            step_times.append(time.perf_counter() - step_start)
        seconds = time.perf_counter() - start
    return generated.cpu(), seconds, step_times


def engine_run(
    engine: Engine, prompts: torch.Tensor, max_tokens: int
) -> tuple[torch.Tensor, float, int, list[float]]:
    """Serve ``prompts`` as greedy requests (EOS ignored) until all finish.

    Returns ``(tokens [batch, max_tokens], seconds, steps, full-batch decode step seconds)``;
    the last lists the steps that decoded every request and prefilled none.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(i, row, params) for i, row in enumerate(prompts.tolist())]
    batch = len(requests)
    start = time.perf_counter()
    for request in requests:
        engine.add(request)
    steps = 0
    decode_times = []
    while engine.has_unfinished():
        prefills = engine.stats().num_waiting > 0
        step_start = time.perf_counter()
        outputs = engine.step()
        if not prefills and len(outputs) == batch:
            decode_times.append(time.perf_counter() - step_start)
        steps += 1
    seconds = time.perf_counter() - start
    return torch.tensor([r.output_token_ids for r in requests]), seconds, steps, decode_times


def load(model_dir: Path | None):
    """Return ``(model, tokenizer, description)``; see the module docstring for the choice."""
    if model_dir is None and (DEFAULT_MODEL_DIR / "config.json").is_file():
        model_dir = DEFAULT_MODEL_DIR
    if model_dir is not None:
        from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir
        from ringstream.daemon.engine.loader import load_model

        info = resolve_model_dir(model_dir)
        return load_model(info), load_tokenizer(info), str(info.path)

    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.factories import make_tokenizer

    config = LlamaConfig(
        vocab_size=FALLBACK_VOCAB_SIZE,
        hidden_size=FALLBACK_HIDDEN_SIZE,
        intermediate_size=FALLBACK_INTERMEDIATE_SIZE,
        num_hidden_layers=FALLBACK_NUM_LAYERS,
        num_attention_heads=FALLBACK_NUM_HEADS,
        max_position_embeddings=FALLBACK_MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model, make_tokenizer(), "random-init Llama (default model shape)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="runs of each; the best is reported")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="model dtype (bfloat16: both loops use the engine's decode attention)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the daemon's CPU workers
    model, tokenizer, description = load(args.model_dir)
    model.to(getattr(torch, args.dtype))
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    rng = random.Random(PROMPT_SEED)
    prompts = torch.tensor(
        [[rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    )
    engine_kwargs = {"max_num_seqs": args.batch}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = Engine(model, tokenizer, EngineConfig(**engine_kwargs))
    engine.warmup()
    prefill_tokens = engine.max_num_batched_tokens
    bare_decode_loop(model, prompts[:, : min(args.prompt_len, WARMUP_PROMPT_LEN)], 2, prefill_tokens)

    total = args.batch * args.max_tokens
    bare_times, engine_times, bare_steps, engine_steps = [], [], [], []
    for _ in range(args.repeats):
        bare_tokens, seconds, step_times = bare_decode_loop(model, prompts, args.max_tokens, prefill_tokens)
        bare_times.append(seconds)
        bare_steps.extend(step_times)
        engine_tokens, seconds, steps, step_times = engine_run(engine, prompts, args.max_tokens)
        engine_times.append(seconds)
        engine_steps.extend(step_times)
    bare_rate = total / min(bare_times)
    engine_rate = total / min(engine_times)
    same = torch.equal(bare_tokens, engine_tokens)
    bare_step = statistics.median(bare_steps)
    engine_step = statistics.median(engine_steps)

    print(f"model: {description} ({params / 1e6:.2f}M params), torch threads {torch.get_num_threads()}")
    print(
        f"workload: batch {args.batch} x prompt {args.prompt_len} tokens, {args.max_tokens} new tokens, "
        f"greedy; best of {args.repeats}; prefill included"
    )
    print(
        f"(a) bare batched decode loop: {bare_rate:8.0f} tok/s  "
        f"(best {min(bare_times) * 1e3:.1f} ms, median {statistics.median(bare_times) * 1e3:.1f} ms)"
    )
    print(
        f"(b) engine:                   {engine_rate:8.0f} tok/s  "
        f"(best {min(engine_times) * 1e3:.1f} ms, median {statistics.median(engine_times) * 1e3:.1f} ms, "
        f"{steps} steps, max_num_batched_tokens {engine.max_num_batched_tokens})"
    )
    print(f"ratio engine / bare: {engine_rate / bare_rate:.3f}")
    print(
        f"decode step over all {args.batch} rows (median): bare {bare_step * 1e3:.2f} ms, "
        f"engine {engine_step * 1e3:.2f} ms, ratio bare / engine {bare_step / engine_step:.3f}"
    )
    print(f"identical greedy tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

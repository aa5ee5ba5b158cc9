"""The engine alone under the side by side's closed loop: ``ringstream-bench vllm``'s workloads without HTTP, front
or client, to read what serving costs.

``python -m ringstream.tools.bench_closed_loop [--model DIR] [--dtype bfloat16] [--workloads prefill,decode]
[--threads N] [--setting NAME=VALUE] [--json FILE]`` steps one :class:`~ringstream.daemon.engine.engine.Engine` in
this process as a CPU worker would (huge pages, its malloc thresholds, ``--threads`` torch threads) over the same
closed loop as ``ringstream-bench vllm``: ``--num-prompts`` random prompts (its built-in client's, for the same seed),
``--concurrency`` in flight, each finished request replaced by the next at once, greedy, EOS ignored. Per workload
it prints output tok/s, the median TTFT and TPOT (TPOT: (last token - first token) / (output - 1), as vLLM's
client computes it), and how the steps split: decode-only steps and steps with prompt tokens, their counts and
mean durations. Without ``--model`` it builds the side by side's default model (random weights, the built-in
tokenizer) in a temporary folder.

Divide ``ringstream-bench vllm``'s output tok/s by this command's for the same workload, model and threads: the
share of the engine's speed that the served daemon keeps on the same host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the daemon's workers (daemon.front.worker_pool)

from ringstream.tools.bench_vllm import (  # noqa: E402
    DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN, ModelShape, random_prompts, build_model_dir, parse_setting,
    parse_workloads,
)

DEFAULT_NUM_PROMPTS = 64
DEFAULT_CONCURRENCY = 16
DEFAULT_SEED = 0


def run_workload(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """Step ``engine`` until every prompt has ``output_len`` tokens, ``concurrency`` requests in flight, each
    finished one replaced at once; the figures as a dict (times in ms, ``tok_s`` output tokens a second)."""
    from ringstream.daemon.engine.engine import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    added: dict[int, float] = {}
    first: dict[int, float] = {}
    finished: dict[int, float] = {}
    steps: list[tuple[bool, float]] = []  # (carried prompt tokens, seconds)
    pending = iter(enumerate(prompts))

    def add_next() -> None:
        item = next(pending, None)
        if item is not None:
            added[item[0]] = time.perf_counter()
            engine.add(EngineRequest(item[0], item[1], params))

    for _ in range(min(concurrency, len(prompts))):
        add_next()
    tokens = 0
    started = time.perf_counter()
    while len(finished) < len(prompts):
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        # a step carried prompt tokens where a request got its first token or one in flight got none (a chunk)
        steps.append((any(o.seq == 0 for o in outputs) or len(outputs) < len(added) - len(finished), now - before))
        for output in outputs:
            tokens += 1
            first.setdefault(output.handle, now)
            if output.finish_reason is not None:
                finished[output.handle] = now
                add_next()
    duration = time.perf_counter() - started
    decode_only = [s for prompt, s in steps if not prompt]
    with_prompt = [s for prompt, s in steps if prompt]
    return {
        "requests": len(finished), "output_tokens": tokens, "duration_s": duration, "tok_s": tokens / duration,
        "ttft_p50_ms": 1e3 * statistics.median(first[h] - added[h] for h in finished),
        "tpot_p50_ms": 1e3 * statistics.median((finished[h] - first[h]) / max(output_len - 1, 1) for h in finished),
        "decode_only_steps": len(decode_only), "decode_only_step_ms": 1e3 * statistics.fmean(decode_only or [0.0]),
        "prompt_steps": len(with_prompt), "prompt_step_ms": 1e3 * statistics.fmean(with_prompt or [0.0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.bench_closed_loop",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the side by side's default model, built)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--workloads", help="as ringstream-bench vllm's (default: prefill,decode)")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="requests per workload")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                        help="requests in flight; also the engine's max_num_seqs (default %(default)s)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads (default: half the cores, as the side by side)")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                        help="one more engine setting (EngineConfig's field, a TOML literal), e.g. max_step_ms=0")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="prompt seed (the side by side's default)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    try:
        workloads = parse_workloads(args.workloads)
        settings = dict(parse_setting(item) for item in args.setting)
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_prompts < 1 or args.concurrency < 1 or args.threads < 1:
        parser.error("--num-prompts, --concurrency and --threads must be >= 1")

    import torch

    from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir
    from ringstream.daemon.engine.engine import Engine, EngineConfig
    from ringstream.daemon.engine.loader import load_model
    from ringstream.daemon.worker.malloc_tuning import retain_freed_memory

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    with tempfile.TemporaryDirectory(prefix="ringstream-closed-loop-") as tmp:
        model_dir = Path(args.model) if args.model else build_model_dir(ModelShape(dtype=args.dtype), tmp)
        info = resolve_model_dir(model_dir)
        try:
            fields = {"threads": args.threads, "dtype": args.dtype, "max_num_seqs": args.concurrency,
                      "kv_cache_bytes": DEFAULT_KV_CACHE_BYTES,
                      "max_model_len": min(DEFAULT_MAX_MODEL_LEN, info.max_model_len)}
            config = EngineConfig(**(fields | settings)).check()
        except (TypeError, ValueError) as exc:
            parser.error(f"--setting: {exc}")
        engine = Engine(load_model(info, dtype=args.dtype), load_tokenizer(info), config,
                        eos_token_ids=info.eos_token_ids)
        engine.warmup()
        results = {}
        for name, (prompt_len, output_len) in workloads.items():
            prompts = random_prompts(info.vocab_size, prompt_len, args.num_prompts, args.seed)
            result = results[name] = run_workload(engine, prompts, output_len, args.concurrency)
            print(f"{name} {prompt_len}/{output_len}: {result['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{result['ttft_p50_ms']:.0f} ms, TPOT p50 {result['tpot_p50_ms']:.1f} ms; "
                  f"{result['decode_only_steps']} decode-only steps of {result['decode_only_step_ms']:.1f} ms, "
                  f"{result['prompt_steps']} with prompt tokens of {result['prompt_step_ms']:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model or "default"), "dtype": args.dtype,
                                               "threads": args.threads, "concurrency": args.concurrency,
                                               "settings": settings, "workloads": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

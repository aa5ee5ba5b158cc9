"""``ringstream-bench kv``: the paged KV cache's figures, each a ratio from one run.

Workloads, on a long-context random-weight Llama built from a config at run
time (no download; 8,192 positions, 4 layers, 8 query / 4 KV heads of 32,
float32, the built-in tokenizer), driving :class:`ringstream.daemon.engine.engine.Engine` in
this process:

(a) capacity: with ``kv_cache_bytes`` = 64 MiB, the most sequences of
    300-token requests (256 prompt + 44 new tokens) running at once, against
    the slots the former engine's per-sequence full-context reservation gave
    the same bytes (``bytes // ((max_model_len + 1) * kv bytes per token)``);
(b) prefix caching: 32 requests sharing a 1,500-token prefix (the prefix
    already served once), TTFT P50 with and without ``enable_prefix_caching``,
    and whether both gave the same greedy tokens;
(c) chunked prefill: a 4,096-token prompt arriving while 16 streams decode;
    the streams' worst inter-token gap and the long request's TTFT with a
    small step budget against one-step prefill (a budget that takes the whole
    prompt at once, as the former engine did);
(d) attention over each sequence's own length: decode step time of 16 rows of
    64 tokens, of 15 such + 1 of 2,048, and of 16 of 2,048; the extra time of the
    one long row over the extra time of sixteen, beside the same ratio in
    tokens attended (a padded design would pay rows x longest: ratio ~1).

Usage::

    ringstream-bench kv [--quick] [--threads N] [--budget TOKENS] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LONG_CONTEXT = 8192
KV_BUDGET_BYTES = 64 * 2**20
SHORT_REQUEST = (256, 44)
SHARED_PREFIX = 1500
SHARED_REQUESTS = 32
LONG_PROMPT = 4096
DECODING_STREAMS = 16
CHUNK_BUDGET = 256
FIRST_ORDINARY_TOKEN_ID = 3
DECODE_SHORT = 64
DECODE_LONG = 2048


def build_model(max_positions: int = LONG_CONTEXT, seed: int = 0):
    """A random-weight Llama of the workloads' shape, float32, eval mode, and the built-in tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=max_positions, bos_token_id=0,
        eos_token_id=1, pad_token_id=2, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model, load_tokenizer(resolve_model_dir(None))


def _prompt(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(FIRST_ORDINARY_TOKEN_ID, 4096, (n,), generator=rng).tolist()


def _engine(model, tokenizer, **kwargs):
    from ringstream.daemon.engine.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer, EngineConfig(**kwargs))
    engine.warmup()
    return engine


def _greedy(max_tokens: int):
    from ringstream.daemon.engine.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drive(engine, arrivals: list[tuple[int, list[int], int]]):
    """Serve requests ``(arrival step, prompt, max_tokens)``; per handle: submit time, token times, tokens."""
    from ringstream.daemon.engine.engine import EngineRequest

    submitted, times, tokens = {}, {}, {}
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    step = 0
    peak_running = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            handle, (_, prompt, max_tokens) = pending.pop(0)
            engine.add(EngineRequest(handle, prompt, _greedy(max_tokens)))
            submitted[handle] = time.perf_counter()
            times[handle], tokens[handle] = [], []
        outputs = engine.step()
        now = time.perf_counter()
        peak_running = max(peak_running, engine.stats().num_running)
        for out in outputs:
            times[out.handle].append(now)
            tokens[out.handle].append(out.token_id)
        step += 1
    return submitted, times, tokens, peak_running


def capacity(model, tokenizer, requests: int) -> dict:
    """(a) Sequences of 300-token requests running at once in a 64 MiB KV cache."""
    config = model.config
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    slot_engine = KV_BUDGET_BYTES // ((LONG_CONTEXT + 1) * token_bytes)
    engine = _engine(model, tokenizer, max_num_seqs=requests, kv_cache_bytes=KV_BUDGET_BYTES,
                     max_num_batched_tokens=2048)
    rng = torch.Generator().manual_seed(1)
    prompt_len, max_tokens = SHORT_REQUEST
    _, _, _, peak = _drive(engine, [(0, _prompt(rng, prompt_len), max_tokens) for _ in range(requests)])
    return {"kv_cache_bytes": KV_BUDGET_BYTES, "max_model_len": LONG_CONTEXT, "request_tokens": sum(SHORT_REQUEST),
            "running_paged": peak, "running_slots_former": slot_engine,
            "ratio": peak / max(slot_engine, 1), "preemptions": engine.stats().num_preemptions}


def prefix_caching(model, tokenizer, requests: int) -> dict:
    """(b) TTFT P50 of requests sharing a long prefix, with and without the prefix cache."""
    rng = torch.Generator().manual_seed(2)
    prefix = _prompt(rng, SHARED_PREFIX)
    prompts = [prefix + _prompt(rng, 20) for _ in range(requests)]
    result = {}
    outputs = {}
    for enabled in (True, False):
        engine = _engine(model, tokenizer, max_num_seqs=requests + 1, max_num_batched_tokens=2048,
                         enable_prefix_caching=enabled, num_blocks=4096)
        _drive(engine, [(0, prefix + _prompt(rng, 5), 1)])  # the prefix served once before
        submitted, times, tokens, _ = _drive(engine, [(0, p, 16) for p in prompts])
        ttft = [times[h][0] - submitted[h] for h in submitted]
        key = "on" if enabled else "off"
        result[f"ttft_p50_s_{key}"] = statistics.median(ttft)
        result[f"prefix_hit_rate_{key}"] = engine.stats().prefix_hits / max(engine.stats().prefix_queries, 1)
        outputs[key] = [tokens[h] for h in sorted(tokens)]
    result["ratio"] = result["ttft_p50_s_off"] / result["ttft_p50_s_on"]
    result["identical_greedy_output"] = outputs["on"] == outputs["off"]
    return result


def chunked_prefill(model, tokenizer, budget: int) -> dict:
    """(c) Worst inter-token gap of 16 decoding streams while a 4,096-token prompt arrives."""
    rng = torch.Generator().manual_seed(3)
    streams = [_prompt(rng, 64) for _ in range(DECODING_STREAMS)]
    long_prompt = _prompt(rng, LONG_PROMPT)
    result = {}
    outputs = {}
    runs = (("chunked", dict(max_num_batched_tokens=budget, max_step_ms=0)),
            ("one_step", dict(max_num_batched_tokens=LONG_PROMPT + DECODING_STREAMS, max_step_ms=0)),
            ("defaults", {}))  # the token budget and the time budget as a user gets them
    for name, settings in runs:
        engine = _engine(model, tokenizer, max_num_seqs=DECODING_STREAMS + 1, num_blocks=1024, **settings)
        arrivals = [(0, p, 96) for p in streams] + [(8, long_prompt, 4)]
        submitted, times, tokens, _ = _drive(engine, arrivals)
        gaps = [b - a for h in range(DECODING_STREAMS) for a, b in zip(times[h], times[h][1:])]
        long_handle = DECODING_STREAMS
        result[f"worst_itl_s_{name}"] = max(gaps)
        result[f"median_itl_s_{name}"] = statistics.median(gaps)
        result[f"long_ttft_s_{name}"] = times[long_handle][0] - submitted[long_handle]
        outputs[name] = [tokens[h] for h in sorted(tokens)]
    result["budget"] = budget
    result["itl_ratio"] = result["worst_itl_s_one_step"] / result["worst_itl_s_chunked"]
    result["ttft_ratio"] = result["long_ttft_s_chunked"] / result["long_ttft_s_one_step"]
    result["gap_over_ttft_defaults"] = result["worst_itl_s_defaults"] / result["long_ttft_s_defaults"]
    result["identical_greedy_output"] = outputs["chunked"] == outputs["one_step"] == outputs["defaults"]
    return result


def decode_attention_cost(model, tokenizer, repeats: int) -> dict:
    """(d) Decode step time as one long row joins short ones, against the tokens attended.

    The three batches run side by side, one step of each in turn, so that a
    busy host disturbs them alike; each figure is the median step.
    """
    from ringstream.daemon.engine.engine import EngineRequest

    rng = torch.Generator().manual_seed(4)
    short = [DECODE_SHORT] * DECODING_STREAMS
    mixed = [DECODE_SHORT] * (DECODING_STREAMS - 1) + [DECODE_LONG]
    long = [DECODE_LONG] * DECODING_STREAMS
    engines = []
    for lengths in (short, mixed, long):
        engine = _engine(model, tokenizer, max_num_seqs=len(lengths), max_num_batched_tokens=8192,
                         num_blocks=len(lengths) * (DECODE_LONG // 16 + 8) + 1, enable_prefix_caching=False)
        for handle, n in enumerate(lengths):
            engine.add(EngineRequest(handle, _prompt(rng, n), _greedy(repeats + 4)))
        decoding: set[int] = set()
        while len(decoding) < len(lengths):  # every prompt prefilled: from now on, decode steps only
            decoding.update(out.handle for out in engine.step())
        engines.append(engine)
    samples: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        for i, engine in enumerate(engines):
            start = time.perf_counter()
            engine.step()
            samples[i].append(time.perf_counter() - start)
    t_short, t_mixed, t_long = (statistics.median(s) for s in samples)
    tokens_ratio = (sum(mixed) - sum(short)) / (sum(long) - sum(short))
    return {"step_s_short": t_short, "step_s_one_long": t_mixed, "step_s_all_long": t_long,
            "time_ratio": (t_mixed - t_short) / (t_long - t_short), "tokens_attended_ratio": tokens_ratio}


def run(quick: bool, budget: int) -> dict:
    model, tokenizer = build_model()
    report = {"model": "random Llama, 8192 positions, 4 layers, 8/4 heads x 32, float32",
              "torch_threads": torch.get_num_threads()}
    with torch.inference_mode():
        report["a_capacity"] = capacity(model, tokenizer, 64 if quick else 128)
        report["b_prefix_caching"] = prefix_caching(model, tokenizer, SHARED_REQUESTS)
        report["c_chunked_prefill"] = chunked_prefill(model, tokenizer, budget)
        report["d_decode_attention"] = decode_attention_cost(model, tokenizer, 9 if quick else 25)
    return report


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def targets(report: dict) -> dict[str, bool]:
    """Each target of the workloads: met or not."""
    a, b, c, d = (report[k] for k in ("a_capacity", "b_prefix_caching", "c_chunked_prefill", "d_decode_attention"))
    return {
        "a: >= 10x sequences": a["ratio"] >= 10,
        "b: TTFT P50 >= 5x lower, same tokens": b["ratio"] >= 5 and b["identical_greedy_output"],
        "c: worst ITL >= 8x smaller": c["itl_ratio"] >= 8,
        "c: long TTFT <= 1.5x": c["ttft_ratio"] <= 1.5,
        "c: at the defaults, worst ITL <= 0.25 of the long TTFT": c["gap_over_ttft_defaults"] <= 0.25,
        "d: one long row costs < half of all long": d["time_ratio"] < 0.5,
    }


def print_report(report: dict) -> None:
    a, b, c, d = (report[k] for k in ("a_capacity", "b_prefix_caching", "c_chunked_prefill", "d_decode_attention"))
    print(f"model: {report['model']}; torch threads {report['torch_threads']}")
    print(f"(a) 64 MiB KV cache, 300-token requests: {a['running_paged']} running (paged) vs "
          f"{a['running_slots_former']} (full-context slots): {a['ratio']:.1f}x  [target >= 10x]")
    print(f"(b) 32 requests sharing a 1,500-token prefix: TTFT P50 {b['ttft_p50_s_on'] * 1e3:.0f} ms with prefix "
          f"caching vs {b['ttft_p50_s_off'] * 1e3:.0f} ms without: {b['ratio']:.1f}x lower  [target >= 5x]; "
          f"identical greedy output: {b['identical_greedy_output']}")
    print(f"(c) 4,096-token prompt among 16 decoding streams, budget {c['budget']} tokens: worst ITL "
          f"{c['worst_itl_s_chunked'] * 1e3:.0f} ms vs {c['worst_itl_s_one_step'] * 1e3:.0f} ms one-step: "
          f"{c['itl_ratio']:.1f}x smaller  [target >= 8x]; long TTFT {c['long_ttft_s_chunked'] * 1e3:.0f} ms vs "
          f"{c['long_ttft_s_one_step'] * 1e3:.0f} ms: {c['ttft_ratio']:.2f}x  [target <= 1.5x]; "
          f"identical greedy output: {c['identical_greedy_output']}")
    print(f"    at the defaults (max_num_batched_tokens 2048, the time budget): worst ITL "
          f"{c['worst_itl_s_defaults'] * 1e3:.0f} ms, long TTFT {c['long_ttft_s_defaults'] * 1e3:.0f} ms: "
          f"{c['gap_over_ttft_defaults']:.2f} of it  [target <= 0.25]")
    print(f"(d) decode step, 16 rows: short {d['step_s_short'] * 1e3:.1f} ms, one long "
          f"{d['step_s_one_long'] * 1e3:.1f} ms, all long {d['step_s_all_long'] * 1e3:.1f} ms; extra time of one "
          f"long row / sixteen: {d['time_ratio']:.3f} (tokens attended: {d['tokens_attended_ratio']:.3f}; "
          f"padding to the longest row: ~1)")
    print("targets: " + "; ".join(f"{name} {_met(ok)}" for name, ok in targets(report).items())
          + " (timings: quote a quiet host; --threads 1 leaves a core to the rest)")


def add_parser(sub) -> None:
    kv = sub.add_parser("kv", help="paged KV cache figures: capacity, prefix caching, chunked prefill, attention")
    kv.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    kv.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    kv.add_argument("--budget", type=int, default=CHUNK_BUDGET,
                    help="max_num_batched_tokens of the chunked run in (c) (default %(default)s)")
    kv.add_argument("--json", help="write the figures to this file")


def command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.quick, args.budget)
    report["targets_met"] = targets(report)
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0

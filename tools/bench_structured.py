"""What structured outputs cost: a decode step with every row constrained against the same rows free, and the
time to build a constraint's matcher cold and with its grammar text kept.

Runs the engine in-process on a model directory (default: the built-in model): ``--rows`` sampled streams
(temperature 1.0, EOS ignored) decoding, first free, then each under a JSON schema (whitespace-flexible, so
that no row finishes early), alternately ``--repeats`` times; prints the median step time of each and their
ratio. Both sides sample through the same engine; the constrained rows add the per-row token mask
(llguidance) and the masked sampling path.

Usage::

    python -m ringstream.tools.bench_structured [--model-dir DIR] [--rows 16] [--threads 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "daemon" / "default_model"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}},
    },
    "required": ["name", "items"],
}
"""A typical extraction schema: nested objects, arrays and free strings."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.bench_structured", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rows", type=int, default=16, help="streams decoding at once (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per run (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternated (default %(default)s)")
    args = parser.parse_args(argv)

    import torch

    from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir
    from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, SamplingParams
    from ringstream.daemon.engine.loader import load_model
    from ringstream.ipc.wire import StructuredOutputs

    torch.set_num_threads(args.threads)
    info = resolve_model_dir(args.model_dir)
    tokenizer = load_tokenizer(info)
    engine = Engine(load_model(info), tokenizer, EngineConfig(max_num_seqs=args.rows),
                    eos_token_ids=info.eos_token_ids)
    engine.warmup()
    constraint = StructuredOutputs(json=json.dumps(SCHEMA), whitespace_flexible=True)
    started = time.perf_counter()
    engine._grammars.matcher(constraint)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        engine._grammars.matcher(constraint)
    kept = (time.perf_counter() - started) / 100

    prompt = tokenizer.encode("Convert a string to a tuple").ids

    def step_time(constrained: bool) -> float:
        for handle in range(args.rows):
            engine.add(EngineRequest(handle, prompt, SamplingParams(
                max_tokens=args.steps + 16, temperature=1.0, seed=handle, ignore_eos=True,
                structured_outputs=constraint if constrained else None)))
        for _ in range(4):  # prefill and the first decodes
            engine.step()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = (time.perf_counter() - started) / args.steps
        for handle in range(args.rows):
            engine.abort(handle)
        return elapsed

    free, constrained = [], []
    for _ in range(args.repeats):
        free.append(step_time(False))
        constrained.append(step_time(True))
    free_ms, constrained_ms = statistics.median(free) * 1e3, statistics.median(constrained) * 1e3
    print(f"model: {info.path}, {args.rows} rows, torch threads {args.threads}")
    print(f"matcher of the schema: cold {cold * 1e3:.2f} ms (the vocabulary's first use included), "
          f"grammar text kept {kept * 1e3:.3f} ms")
    print(f"decode step: free {free_ms:.2f} ms, constrained {constrained_ms:.2f} ms, "
          f"ratio {constrained_ms / free_ms:.3f} (+{constrained_ms - free_ms:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""In-process baselines the daemon is compared with, on the same model and workload.

Each baseline serves the same closed-loop workload as the daemon's load test
(``concurrency`` streams, each starting its next request when the previous
one ends, ``requests`` in all; greedy, EOS ignored, so every request
generates exactly ``max_tokens`` tokens) and returns one
:class:`ringstream.tools.bench_stats.RequestRecord` per request, except the ceiling,
which has no requests:

* ``ceiling``: the bare lockstep batched decode loop over a preallocated
  cache of :mod:`ringstream.tools.bench_engine` (one batch of ``concurrency`` prompts):
  the most this model and CPU can decode, with no serving at all;
* ``engine``: ``ringstream.daemon.engine.engine.Engine`` driven in-process (no sockets, no
  rings, no front);
* ``naive``: one thread per request calling ``model.generate()`` with a
  ``transformers.TextIteratorStreamer``, consumed by the caller's thread, no
  bound on concurrency;
* ``seed``: a request queue served by a bounded pool of threads, each
  running ``generate()`` for one request at a time with a streamer;
* ``hf-cb``: transformers' own continuous batching (``ContinuousBatchingManager``
  with a paged KV cache), sized for the workload (see :data:`HF_CB_SETTINGS`).

Token times of ``naive``, ``seed`` and ``hf-cb`` are taken where the token is
produced (the streamer's ``put``, the manager's per-token timestamps), in the
serving process, with no transport to a client; the daemon's are taken in its
client, after the sockets. Both favour the baselines, never the daemon.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ringstream.tools.bench_stats import RequestRecord

WARMUP_REQUESTS = 4
"""Requests hf-cb serves before it is measured (first-call allocations, lazy initialisation)."""
WARMUP_MAX_TOKENS = 4
"""Tokens of the short warm-up requests of the ceiling and of the ``generate()`` baselines."""
RESULT_POLL_S = 1.0
"""How long the hf-cb driver waits for one result before checking the manager is alive."""
HF_CB_STOP_TIMEOUT_S = 30.0

HF_CB_SETTINGS = dict(page_size=128, max_batch_tokens=2048, allow_block_sharing=False, scheduler_type="fifo")
"""``ContinuousBatchingConfig`` fields of ``hf-cb``, the best found for a 2-core AMD EPYC (torch 2.13,
transformers 5.24, 64 streams x (64 prompt + 32 new) tokens, 1 torch thread). Sweep, in generated tokens per
CPU-second of the process (a figure other jobs on a shared host disturb far less than wall time): page_size 16, 32,
64, 128 x max_batch_tokens 512, 2048, plus block sharing, the ``prefill_first`` scheduler, a 1024-block cache and
the library's automatic sizing. Every configuration gave 0.72k-0.85k; page_size=128 with max_batch_tokens=2048
gave 0.83k-0.84k, the automatic sizing 0.72k-0.76k. ``num_blocks`` is sized to the workload
(:func:`hf_cb_num_blocks`): a larger cache was no faster.
"""


@dataclass(frozen=True)
class Workload:
    """The closed-loop workload every baseline serves.

    Attributes:
        prompts: token ids of each request's prompt (``len(prompts)`` requests).
        max_tokens: tokens generated per request.
        concurrency: requests in flight at once.
    """

    prompts: list[list[int]]
    max_tokens: int
    concurrency: int

    @property
    def requests(self) -> int:
        """Requests in the workload."""
        return len(self.prompts)

    def head(self, count: int, max_tokens: int | None = None) -> "Workload":
        """The first ``count`` requests (for warm-up runs)."""
        return Workload(self.prompts[:count], max_tokens or self.max_tokens, min(self.concurrency, count))


class _ClosedLoop:
    """Hands out request indices to ``concurrency`` streams, optionally until a time limit."""

    def __init__(self, workload: Workload, time_limit_s: float | None) -> None:
        self._next = 0
        self._count = workload.requests
        self._lock = threading.Lock()
        self._deadline = time.perf_counter() + time_limit_s if time_limit_s else None

    def take(self) -> int | None:
        """The next request index, or None when the run is over."""
        with self._lock:
            if self._next >= self._count or (self._deadline and time.perf_counter() > self._deadline):
                return None
            self._next += 1
            return self._next - 1


def _fresh_records(records: list[RequestRecord | None]) -> list[RequestRecord]:
    return [r for r in records if r is not None]


def run_ceiling(model, workload: Workload, prefill_tokens: int) -> float:
    """Bare lockstep decode of the first ``concurrency`` prompts; generated tokens per second.

    Uses :func:`ringstream.tools.bench_engine.bare_decode_loop` (prefill included, in
    chunks of ``prefill_tokens`` tokens, as the engine's budget).
    """
    from ringstream.tools.bench_engine import bare_decode_loop

    prompts = torch.tensor(workload.prompts[: workload.concurrency])
    _, seconds, _ = bare_decode_loop(model, prompts, workload.max_tokens, prefill_tokens)
    return prompts.shape[0] * workload.max_tokens / seconds


def warm_ceiling(model, workload: Workload, prefill_tokens: int) -> None:
    """One tiny lockstep run, so the measured one meets no first-call costs."""
    from ringstream.tools.bench_engine import WARMUP_PROMPT_LEN, bare_decode_loop

    prompts = torch.tensor([p[:WARMUP_PROMPT_LEN] for p in workload.prompts[: workload.concurrency]])
    bare_decode_loop(model, prompts, WARMUP_MAX_TOKENS, prefill_tokens)


def run_engine(engine, workload: Workload) -> list[RequestRecord]:
    """Serve the workload with an in-process ``Engine``; one record per request."""
    from ringstream.daemon.engine.engine import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    records: list[RequestRecord | None] = [None] * workload.requests
    next_index = 0

    def submit(now: float) -> None:
        nonlocal next_index
        records[next_index] = RequestRecord(start=now)
        engine.add(EngineRequest(next_index, list(workload.prompts[next_index]), params))
        next_index += 1

    start = time.perf_counter()
    while next_index < min(workload.concurrency, workload.requests):
        submit(start)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = records[out.handle]
            record.chunk_times.append(now)
            record.chunk_tokens.append(1)
            record.seqs.append(out.seq)
            if out.finish_reason is not None:
                record.end = now
                record.finish_reason = out.finish_reason
                if next_index < workload.requests:
                    submit(now)
    return _fresh_records(records)


def _streamer_class():
    """``TextIteratorStreamer`` subclass that records when ``generate()`` hands it each generated token."""
    from transformers import TextIteratorStreamer

    class TimedStreamer(TextIteratorStreamer):
        """Records the time and count of each batch of generated tokens it receives."""

        def __init__(self, tokenizer, record: RequestRecord) -> None:
            super().__init__(tokenizer, skip_prompt=True)
            self.record = record

        def put(self, value) -> None:
            if not (self.skip_prompt and self.next_tokens_are_prompt):
                self.record.chunk_times.append(time.perf_counter())
                self.record.chunk_tokens.append(int(value.numel()))
            super().put(value)

    return TimedStreamer


def _generation_config(model, max_tokens: int):
    """Greedy, exactly ``max_tokens`` new tokens (no EOS), for ``generate()``."""
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=pad)


def _generate(model, prompt: list[int], config, streamer) -> None:
    input_ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=streamer
        )


def run_naive(model, tokenizer, workload: Workload, time_limit_s: float | None = None) -> list[RequestRecord]:
    """One new thread per request running ``generate()``; its caller consumes the streamer.

    ``tokenizer``: the model's transformers tokenizer (for the streamer).
    ``time_limit_s``: start no request after this many seconds.
    """
    config = _generation_config(model, workload.max_tokens)
    streamer_cls = _streamer_class()
    loop = _ClosedLoop(workload, time_limit_s)
    records: list[RequestRecord | None] = [None] * workload.requests

    def stream() -> None:
        while (index := loop.take()) is not None:
            record = RequestRecord(start=time.perf_counter())
            streamer = streamer_cls(tokenizer, record)
            thread = threading.Thread(target=_generate, args=(model, workload.prompts[index], config, streamer))
            thread.start()
            for _ in streamer:
                pass
            thread.join()
            record.end = time.perf_counter()
            record.finish_reason = "length"
            records[index] = record

    _run_threads(stream, workload.concurrency)
    return _fresh_records(records)


def run_seed(
    model, tokenizer, workload: Workload, pool_size: int, time_limit_s: float | None = None
) -> list[RequestRecord]:
    """A FIFO request queue served by ``pool_size`` threads, each running ``generate()`` per request.

    Each stream submits a request and consumes its streamer; the request's
    TTFT includes its wait in the queue.
    """
    config = _generation_config(model, workload.max_tokens)
    streamer_cls = _streamer_class()
    loop = _ClosedLoop(workload, time_limit_s)
    records: list[RequestRecord | None] = [None] * workload.requests
    jobs: queue.Queue = queue.Queue()

    def server() -> None:
        while (job := jobs.get()) is not None:
            prompt, streamer = job
            _generate(model, prompt, config, streamer)

    def stream() -> None:
        while (index := loop.take()) is not None:
            record = RequestRecord(start=time.perf_counter())
            streamer = streamer_cls(tokenizer, record)
            jobs.put((workload.prompts[index], streamer))
            for _ in streamer:
                pass
            record.end = time.perf_counter()
            record.finish_reason = "length"
            records[index] = record

    servers = [threading.Thread(target=server, daemon=True) for _ in range(pool_size)]
    for thread in servers:
        thread.start()
    try:
        _run_threads(stream, workload.concurrency)
    finally:
        for _ in servers:
            jobs.put(None)
        for thread in servers:
            thread.join()
    return _fresh_records(records)


def _run_threads(target, count: int) -> None:
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def hf_cb_num_blocks(workload: Workload, page_size: int) -> int:
    """Cache blocks that hold ``concurrency`` requests of the longest prompt plus ``max_tokens``, one spare each."""
    longest = max(len(p) for p in workload.prompts) + workload.max_tokens
    return workload.concurrency * (math.ceil(longest / page_size) + 1)


def hf_cb_fields(fields: dict, config_class) -> dict:
    """``fields`` in the spelling of this transformers' ``ContinuousBatchingConfig``: ``page_size`` (>= 5.18) is
    ``block_size`` before."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    if "page_size" in fields and "page_size" not in names and "block_size" in names:
        fields["block_size"] = fields.pop("page_size")
    return fields


class HfContinuousBatching:
    """transformers' ``ContinuousBatchingManager`` on ``model``, started and warm; use as a context manager.

    ``settings``: ``ContinuousBatchingConfig`` fields (default
    :data:`HF_CB_SETTINGS`); ``num_blocks`` is sized from ``workload``
    unless given.
    """

    def __init__(self, model, workload: Workload, settings: dict | None = None) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        fields = hf_cb_fields(dict(HF_CB_SETTINGS if settings is None else settings), ContinuousBatchingConfig)
        fields.setdefault("num_blocks", hf_cb_num_blocks(workload, fields.get("page_size", fields.get("block_size", 256))))
        self.settings = fields
        generation = GenerationConfig(
            do_sample=False, max_new_tokens=workload.max_tokens, eos_token_id=-1,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        )
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**fields)
        )
        self._ids = 0

    def __enter__(self) -> "HfContinuousBatching":
        self.manager.warmup()
        self.manager.start()
        return self

    def __exit__(self, *exc) -> None:
        self.manager.stop(block=True, timeout=HF_CB_STOP_TIMEOUT_S)
        self.manager.destroy()

    def run(self, workload: Workload) -> list[RequestRecord]:
        """Serve ``workload`` (closed loop); one record per request.

        Raises:
            RuntimeError: the manager's generation thread died or a request failed.
        """
        manager = self.manager
        records: dict[str, RequestRecord] = {}
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            request_id = f"bench-{self._ids}"
            self._ids += 1
            records[request_id] = RequestRecord(start=time.perf_counter())
            manager.add_request(
                workload.prompts[submitted], request_id=request_id, max_new_tokens=workload.max_tokens,
                streaming=True, record_timestamps=True,
            )
            submitted += 1

        while submitted < min(workload.concurrency, workload.requests):
            submit()
        finished = 0
        while finished < workload.requests:
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("hf-cb: the continuous batching thread stopped")
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
            record = records[result.request_id]
            record.end = time.perf_counter()
            record.chunk_times = list(result.timestamps or [])
            record.chunk_tokens = [1] * len(record.chunk_times)
            record.finish_reason = "length"
            finished += 1
            if submitted < workload.requests:
                submit()
        return list(records.values())

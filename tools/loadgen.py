"""Load generator: drive a running ringstream daemon and record every request.

Two arrival models, as in vLLM's ``benchmark_serving`` and NVIDIA GenAI-Perf:

* closed loop (``concurrency``): N streams, each sending its next request as
  soon as the previous one ends, so N requests are always in flight;
* open loop (``rate``): requests arrive as a Poisson process of ``rate``
  requests per second (exponential inter-arrival gaps, seeded), each an
  asyncio task, whatever the daemon's progress.

A run ends after ``requests`` requests or, with ``duration_s``, when no new
request may start (requests in flight then finish). Each request is a
:class:`RequestSpec` drawn from a :class:`WorkloadSpec` with a seeded
generator, so two runs of one spec send the same requests. Prompts are random
token ids in a range that avoids the model's special tokens, sent as
``prompt_token_ids``, and/or text (the same ids decoded by the model's
tokenizer, so about as many tokens once the daemon re-encodes them).

Clients: ``clients`` ``AsyncClient`` instances per process, streams assigned
round-robin, and ``procs`` processes (the load split evenly, all starting at
one agreed wall-clock instant); see ``ringstream-bench run --help`` for the
defaults chosen by measurement. Everything a run needs once (each client's
first status round trip, the expected texts of ``check_text``, the progress
bar) is set up before its clock starts, so that none of it lands inside the
measured latencies.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from ringstream.tools.bench_stats import ERROR_ORDER, RequestRecord

DEFAULT_SEED = 1234
FIRST_ORDINARY_TOKEN_ID = 3
"""Lowest token id put in random prompts: ids below it are the built-in model's BOS, EOS and padding."""
PROC_START_DELAY_S = 1.0
"""Client processes start sending this long after the parent fixes the start instant."""
PROC_JOIN_TIMEOUT_S = 30.0
"""How long the parent waits for a client process to exit after it reported."""
READY_TIMEOUT_S = 300.0
DIST_ARITY = {"uniform": 2, "normal": 2, "exp": 1}
"""Parameters of each non-fixed distribution form."""


class WorkloadError(ValueError):
    """A workload argument (distribution, priority mix...) is malformed."""


@dataclass(frozen=True)
class Dist:
    """A distribution of positive integers (token counts), parsed from a CLI string.

    Forms: ``"64"`` (fixed), ``"uniform:32:128"`` (inclusive bounds),
    ``"normal:64:16"`` (mean, standard deviation, rounded), ``"exp:64"``
    (exponential with that mean, rounded). Samples are clamped to >= 1.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Dist":
        """Parse a distribution string; raises :class:`WorkloadError` if malformed."""
        parts = text.strip().split(":")
        usage = f"distribution {text!r}: expected N, uniform:A:B, normal:MEAN:STD or exp:MEAN"
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))._checked(text)
            kind, args = parts[0], [float(p) for p in parts[1:]]
        except ValueError:
            raise WorkloadError(usage) from None
        if kind not in DIST_ARITY or len(args) != DIST_ARITY[kind]:
            raise WorkloadError(usage)
        return cls(kind, *args)._checked(text)

    def _checked(self, text: str) -> "Dist":
        if self.a <= 0 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "normal" and self.b < 0):
            raise WorkloadError(f"distribution {text!r}: parameters out of range")
        return self

    def sample(self, rng: random.Random) -> int:
        """One value, >= 1."""
        match self.kind:
            case "fixed":
                value = self.a
            case "uniform":
                value = rng.randint(int(self.a), int(self.b))
            case "normal":
                value = round(rng.gauss(self.a, self.b))
            case _:
                value = round(rng.expovariate(1.0 / self.a))
        return max(1, int(value))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "exp" else "")


def parse_priority_mix(text: str | None) -> list[tuple[int, float]]:
    """``"0:0.8,10:0.2"`` -> ``[(0, 0.8), (10, 0.2)]``; weights are normalised to sum to 1.

    None or ``""`` gives ``[(0, 1.0)]``. Raises :class:`WorkloadError` if malformed.
    """
    if not text:
        return [(0, 1.0)]
    mix = []
    for item in text.split(","):
        priority, sep, weight = item.partition(":")
        try:
            mix.append((int(priority), float(weight) if sep else 1.0))
        except ValueError:
            raise WorkloadError(f"priority mix {text!r}: use PRIORITY:WEIGHT,...") from None
    total = sum(w for _, w in mix)
    if total <= 0 or any(w < 0 for _, w in mix):
        raise WorkloadError(f"priority mix {text!r}: weights must be >= 0 and not all 0")
    return [(p, w / total) for p, w in mix]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: exactly one of ``prompt_token_ids`` / ``prompt``."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class WorkloadSpec:
    """What requests look like; the same spec and seed give the same requests.

    Attributes:
        prompt_len: prompt tokens per request.
        max_tokens: ``max_tokens`` per request (EOS is ignored, so every
            request generates exactly that many unless the context ends).
        vocab_size: prompt ids are drawn from ``[FIRST_ORDINARY_TOKEN_ID, vocab_size)``
            minus ``exclude_ids``.
        exclude_ids: ids never put in prompts (the model's EOS ids).
        prompt_kind: ``ids`` (``prompt_token_ids``), ``text`` (decoded by
            ``tokenizer``), or ``mixed`` (alternating).
        priority_mix: ``[(priority, probability), ...]``.
        seed: seed of the request generator.
    """

    prompt_len: Dist = Dist("fixed", 64)
    max_tokens: Dist = Dist("fixed", 32)
    vocab_size: int = 4096
    exclude_ids: tuple[int, ...] = ()
    prompt_kind: str = "ids"
    priority_mix: tuple[tuple[int, float], ...] = ((0, 1.0),)
    seed: int = DEFAULT_SEED

    def requests(self, tokenizer=None) -> Iterator[RequestSpec]:
        """Endless seeded stream of requests; ``tokenizer`` (``tokenizers.Tokenizer``) is needed for text prompts.

        Raises:
            WorkloadError: text prompts without a tokenizer, or no usable token id.
        """
        if self.prompt_kind not in ("ids", "text", "mixed"):
            raise WorkloadError(f"prompt kind {self.prompt_kind!r}: use ids, text or mixed")
        if self.prompt_kind != "ids" and tokenizer is None:
            raise WorkloadError("text prompts need the model's tokenizer")
        excluded = set(self.exclude_ids)
        pool = [i for i in range(FIRST_ORDINARY_TOKEN_ID, self.vocab_size) if i not in excluded]
        if not pool:
            raise WorkloadError(f"no ordinary token id below vocab_size {self.vocab_size}")
        rng = random.Random(self.seed)
        priorities = [p for p, _ in self.priority_mix]
        weights = [w for _, w in self.priority_mix]
        for index in itertools.count():
            ids = rng.choices(pool, k=self.prompt_len.sample(rng))
            max_tokens = self.max_tokens.sample(rng)
            priority = rng.choices(priorities, weights)[0]
            as_text = self.prompt_kind == "text" or (self.prompt_kind == "mixed" and index % 2)
            if as_text:
                yield RequestSpec(max_tokens, prompt=tokenizer.decode(ids) or " ", priority=priority)
            else:
                yield RequestSpec(max_tokens, prompt_token_ids=ids, priority=priority)


@dataclass(frozen=True)
class LoadConfig:
    """How to drive the daemon.

    Attributes:
        address: the daemon's ZeroMQ address.
        concurrency: closed loop: streams in flight (ignored when ``rate`` is set).
        rate: open loop: Poisson arrivals, requests per second.
        requests: requests to send in all (None: bounded by ``duration_s``).
        duration_s: stop starting requests after this many seconds.
        clients: ``AsyncClient`` instances per process (streams round-robin).
        procs: client processes.
        check_text: verify each stream's text is the synthetic engine's
            ``" t0 t1 ..."`` (a content error otherwise).
        temperature: sampling temperature (0: greedy).
        progress: show a tqdm progress bar (only on a terminal).
        timeout_s: each request's ``timeout_s`` on the daemon (None: its default).
    """

    address: str
    concurrency: int = 64
    rate: float | None = None
    requests: int | None = 256
    duration_s: float | None = None
    clients: int = 1
    procs: int = 1
    check_text: bool = False
    temperature: float = 0.0
    progress: bool = True
    timeout_s: float | None = None

    def check(self) -> "LoadConfig":
        """Validate; returns self. Raises :class:`WorkloadError`."""
        if self.requests is None and self.duration_s is None:
            raise WorkloadError("give a request count or a duration")
        if self.requests is not None and self.requests < 1:
            raise WorkloadError(f"requests = {self.requests}: must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"duration = {self.duration_s}: must be > 0 seconds")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate = {self.rate}: must be > 0 requests per second")
        for name in ("concurrency", "clients", "procs"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} = {getattr(self, name)}: must be >= 1")
        return self


@dataclass
class LoadResult:
    """Records of one load run, times in seconds from the run's start."""

    records: list[RequestRecord]
    wall_s: float
    client_decode_errors: int = 0
    per_proc: list[dict] = field(default_factory=list)


def expected_synthetic_text(tokens: int, first_seq: int = 0) -> str:
    """Text the synthetic engine streams for output tokens ``first_seq .. first_seq + tokens - 1``.

    Imports :mod:`ringstream.daemon.engine.synthetic`, hence torch: call it first outside any
    measured interval.
    """
    from ringstream.daemon.engine.synthetic import synthetic_text

    return "".join(synthetic_text(seq) for seq in range(first_seq, first_seq + tokens))


class SyntheticTextCheck:
    """Tells whether a stream's text is the synthetic engine's for its token count (expected texts cached).

    Built before a run starts: the first :func:`expected_synthetic_text` call
    imports torch, which would otherwise stall the event loop mid-run.
    """

    def __init__(self) -> None:
        self._expected: dict[int, str] = {0: expected_synthetic_text(0)}

    def __call__(self, text: str, tokens: int) -> bool:
        expected = self._expected.get(tokens)
        if expected is None:
            expected = self._expected[tokens] = expected_synthetic_text(tokens)
        return text == expected


async def _stream_one(
    client, spec: RequestSpec, config: LoadConfig, clock: Callable[[], float], text_check: SyntheticTextCheck | None
) -> RequestRecord:
    """Send one request through ``client`` and record its chunks (and check its text with ``text_check``)."""
    from ringstream.ipc.client import DaemonUnavailable, ServerError, StreamOrderError

    record = RequestRecord(start=clock(), priority=spec.priority)
    texts: list[str] = []
    usage = None
    params = dict(max_tokens=spec.max_tokens, temperature=config.temperature, ignore_eos=True, priority=spec.priority)
    if config.timeout_s is not None:
        params["timeout_s"] = config.timeout_s
    try:
        async for chunk in client.generate(spec.prompt, prompt_token_ids=spec.prompt_token_ids, **params):
            now = clock()
            record.seqs.append(chunk.seq)
            if chunk.token_ids:
                record.chunk_times.append(now)
                record.chunk_tokens.append(len(chunk.token_ids))
            if text_check is not None:
                texts.append(chunk.text)
            if chunk.finish_reason is not None:
                record.finish_reason = str(chunk.finish_reason)
                usage = chunk.usage
    except ServerError as exc:
        record.error = str(exc.code)
    except StreamOrderError:
        record.error = ERROR_ORDER
        record.order_errors += 1
    except DaemonUnavailable:
        record.error = DaemonUnavailable.__name__
    record.end = clock()
    if record.error is None:
        if usage is not None and usage.completion_tokens != record.output_tokens:
            record.content_errors = 1
        elif text_check is not None and not text_check("".join(texts), record.output_tokens):
            record.content_errors = 1
    return record


def _progress_bar(config: LoadConfig, total: int | None):
    """A tqdm bar on stderr, disabled unless stderr is a terminal and progress is wanted."""
    from tqdm import tqdm

    enabled = config.progress and sys.stderr.isatty()
    return tqdm(total=total, unit="req", desc="requests", disable=not enabled, leave=False)


async def _drive(config: LoadConfig, specs: Iterator[RequestSpec], start_at: float | None) -> LoadResult:
    """Run up to ``config.requests`` of ``specs`` against the daemon in this process (see the module docstring).

    ``start_at``: wall-clock instant (``time.time()``) to start at; None: as
    soon as the daemon reports ready.
    """
    from ringstream.ipc.client import AsyncClient

    text_check = SyntheticTextCheck() if config.check_text else None
    clients = [AsyncClient(config.address) for _ in range(config.clients)]
    bar = _progress_bar(config, config.requests)
    try:
        # One status round trip per client before the clock starts, so that
        # connecting and starting each client's tasks stay out of the figures.
        await asyncio.gather(*(client.wait_ready(READY_TIMEOUT_S) for client in clients))
        if start_at is None:
            origin = time.perf_counter()
        else:
            origin = time.perf_counter() + (start_at - time.time())
            await asyncio.sleep(max(0.0, origin - time.perf_counter()))
        deadline = origin + config.duration_s if config.duration_s is not None else None

        def clock() -> float:
            return time.perf_counter() - origin

        def may_start(index: int) -> bool:
            if config.requests is not None and index >= config.requests:
                return False
            return deadline is None or time.perf_counter() < deadline

        if config.rate is None:
            records = await _closed_loop(clients, specs, config, clock, may_start, bar, text_check)
        else:
            records = await _open_loop(clients, specs, config, clock, may_start, bar, text_check)
        wall = max((r.end for r in records), default=0.0)
        decode_errors = sum(len(getattr(c, "decode_errors", ())) for c in clients)
        return LoadResult(records, wall, decode_errors)
    finally:
        bar.close()
        for client in clients:
            await client.close()


async def _closed_loop(clients, specs, config, clock, may_start, bar, text_check) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_index = 0

    async def stream(client) -> None:
        nonlocal next_index
        while may_start(next_index):
            next_index += 1
            records.append(await _stream_one(client, next(specs), config, clock, text_check))
            bar.update(1)

    streams = [stream(clients[i % len(clients)]) for i in range(config.concurrency)]
    await asyncio.gather(*streams)
    return records


async def _open_loop(clients, specs, config, clock, may_start, bar, text_check) -> list[RequestRecord]:
    rng = random.Random(DEFAULT_SEED + 1)
    tasks: list[asyncio.Task] = []
    arrival = 0.0
    index = 0
    while may_start(index):
        delay = arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)
            if not may_start(index):
                break
        spec = next(specs)
        task = asyncio.create_task(_stream_one(clients[index % len(clients)], spec, config, clock, text_check))
        task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
        index += 1
        arrival += rng.expovariate(config.rate)
    return list(await asyncio.gather(*tasks))


def _run_in_process(config: LoadConfig, workload: WorkloadSpec, model_dir, start_at: float | None) -> LoadResult:
    """Run the async load in a fresh event loop (uvloop when available)."""
    tokenizer = load_workload_tokenizer(model_dir) if workload.prompt_kind != "ids" else None
    specs = workload.requests(tokenizer)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_drive(config, specs, start_at))
    return uvloop.run(_drive(config, specs, start_at))


def _child_main(config: LoadConfig, workload: WorkloadSpec, model_dir, start_at: float, conn) -> None:
    """Entry point of a client process: run its share, send the result back through ``conn``."""
    try:
        conn.send(_run_in_process(config, workload, model_dir, start_at))
    finally:
        conn.close()


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal non-negative integers."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_load(config: LoadConfig, workload: WorkloadSpec, model_dir: str | Path | None = None) -> LoadResult:
    """Drive the daemon at ``config.address`` with ``workload``; blocks until done.

    ``model_dir``: the model whose tokenizer makes text prompts (None: the
    built-in model); unused for ``ids`` prompts.

    With ``procs > 1`` the streams (or the arrival rate) and the request count
    are split evenly among client processes, each drawing requests with its
    own seed (``workload.seed + process index``); they start at one
    wall-clock instant and report their records, whose times share that origin.

    Raises:
        WorkloadError: a bad config or workload.
        RuntimeError: a client process failed.
    """
    config.check()
    if config.procs == 1:
        return _run_in_process(config, workload, model_dir, None)

    from ringstream.ipc.client import Client

    with Client(config.address) as client:
        client.wait_ready(READY_TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + PROC_START_DELAY_S
    concurrency = _split(config.concurrency, config.procs)
    counts = _split(config.requests, config.procs) if config.requests is not None else [None] * config.procs
    children = []
    for index in range(config.procs):
        child_config = replace(
            config,
            concurrency=max(1, concurrency[index]),
            rate=config.rate / config.procs if config.rate else None,
            requests=counts[index],
            procs=1,
            progress=config.progress and index == 0,
        )
        child_workload = replace(workload, seed=workload.seed + index)
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child_main, args=(child_config, child_workload, model_dir, start_at, child_conn), daemon=True
        )
        proc.start()
        child_conn.close()
        children.append((proc, parent_conn))
    results = []
    for proc, conn in children:
        try:
            results.append(conn.recv())
        except EOFError:
            raise RuntimeError(f"load generator process {proc.pid} exited with code {proc.exitcode}") from None
        finally:
            proc.join(PROC_JOIN_TIMEOUT_S)
    return LoadResult(
        [r for result in results for r in result.records],
        max(result.wall_s for result in results),
        sum(result.client_decode_errors for result in results),
        [{"requests": len(r.records), "wall_s": r.wall_s} for r in results],
    )


def load_workload_tokenizer(model_dir: str | Path | None):
    """The ``tokenizers.Tokenizer`` of a model directory (None: the built-in model)."""
    from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(model_dir))

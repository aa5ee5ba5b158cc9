"""``ringstream-bench``: load-test a daemon, and compare it with baselines on one workload.

``ringstream-bench run --socket ADDR ...`` drives a running daemon with the
load generator of :mod:`ringstream.tools.loadgen` (closed loop with ``--concurrency``
streams, or open loop with Poisson arrivals at ``--rate``) and reports
requests/s, output tokens/s, TTFT / ITL / E2E percentiles, errors by code and
order violations, as a table, JSON (``--json``) and plots (``--plot``); it
exits with status 1 if any stream broke chunk order.

``ringstream-bench compare`` runs, in one process tree, on the same model and
the same closed-loop workload (by default the built-in model, 64 concurrent
streams, 64-token prompts, 32 new tokens, greedy):

* the baselines of :mod:`ringstream.tools.baselines` (``ceiling``, ``engine``,
  ``naive``, ``seed``, ``hf-cb``);
* ``daemon``: a real ``ringstream serve`` child process driven through its
  socket by the load generator, and its CPU use while idle;
* the serving layer alone: a daemon with ``--engine synthetic`` (fixed step
  time, no model), the raw ZeroMQ DEALER -> ROUTER message rate between two
  processes, and the load generator's own ceiling against a stub daemon;
* ``roofline``: the most a decode step of the workload's batch can reach at the
  device's measured copy bandwidth (:mod:`ringstream.tools.bench_device`), and
  the KV capacity of the engine's pool;

and prints every figure and the ratios between them; it exits with status 1
if any part failed (a skipped synthetic part is not a failure). Throughputs
are the best of ``--repeats`` runs (the host may be shared: the best run is
the one least disturbed), latencies come from that run. Every part runs with
the same number of torch threads (``--threads``; the daemon's worker gets it
through its config file).

``--device cuda:0`` runs every system on that device (bfloat16 unless
``--dtype``): the ``seed`` baseline is then ``generate()`` one request at a
time, and the parts that do not depend on the device (``naive``, the serving
layer alone) are skipped. ``--model-config NAME`` (with ``--layers`` /
``--hidden`` to shrink it) serves a random-weight model of a published shape
(:mod:`ringstream.tools.model_configs`) written to a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# Every in-process system gets huge pages for large CPU tensors, as the daemon's workers do
# (daemon.front.worker_pool.HUGE_PAGES_ENV); PyTorch reads this at its first allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from ringstream.tools import bench_cluster, bench_kv, bench_vllm  # noqa: E402
from ringstream.tools.bench_stats import RequestRecord, cdf, itl_samples, summarize, timeline  # noqa: E402
from ringstream.tools.loadgen import Dist, LoadConfig, WorkloadError, WorkloadSpec, parse_priority_mix, run_load  # noqa: E402

PROG = "ringstream-bench"
MODEL_CONFIG_NAMES = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b")
"""Names of :data:`ringstream.tools.model_configs.MODEL_CONFIGS` (not imported here: it loads transformers)."""
IN_PROCESS_SYSTEMS = ("ceiling", "engine", "hf-cb", "seed", "naive")
"""Baselines run in the benchmark's own process (:mod:`ringstream.tools.baselines`), in this order."""
SYSTEMS = (*IN_PROCESS_SYSTEMS, "daemon")
"""Systems of the comparison, in the order they run."""
SETTLE_S = 0.5
"""Pause after a daemon reports ready before its idle CPU is sampled (start-up work winding down)."""
RATIO_LABELS = {
    "engine_over_ceiling": "engine / ceiling (tok/s)",
    "daemon_over_engine": "daemon / engine (tok/s)",
    "daemon_over_naive": "daemon / naive (tok/s)",
    "daemon_over_seed": "daemon / seed (tok/s)",
    "daemon_over_hf_cb": "daemon / hf-cb (tok/s)",
    "daemon_over_ceiling": "daemon / ceiling (tok/s)",
    "naive_p99_ttft_over_daemon": "naive / daemon (P99 TTFT)",
    "seed_p99_ttft_over_daemon": "seed / daemon (P99 TTFT)",
    "hf_cb_p99_ttft_over_daemon": "hf-cb / daemon (P99 TTFT)",
    "daemon_p99_ttft_over_engine": "daemon / engine (P99 TTFT)",
    "synthetic_tok_s_over_zmq_msg_s": "synthetic tok/s / zmq msg/s",
    "synthetic_tok_s_over_loadgen_ceiling": "synthetic tok/s / load generator ceiling tok/s",
    "synthetic_tok_s_over_daemon": "synthetic / daemon (tok/s)",
    "ceiling_over_roofline": "ceiling / roofline (tok/s)",
    "engine_over_roofline": "engine / roofline (tok/s)",
    "daemon_over_roofline": "daemon / roofline (tok/s)",
}
"""Row labels of the ratios table, by ratio key (``ratio_<key>`` in the JSON report)."""
RATIO_TARGETS = {
    "engine_over_ceiling": 0.9, "daemon_over_engine": 0.9, "daemon_over_naive": 30.0, "daemon_over_seed": 10.0,
    "daemon_over_hf_cb": 3.0, "naive_p99_ttft_over_daemon": 1.0, "seed_p99_ttft_over_daemon": 1.0,
    "synthetic_tok_s_over_zmq_msg_s": 0.3,
}
"""The project's performance targets (each ratio at least this), shown beside the measured ratios."""
TARGET_WORKLOAD = (64, 64, 32)
"""(streams, prompt tokens, new tokens) the targets are set for; other workloads show no target."""
CONSOLE_WIDTH = 150
"""Width of the tables when the output is not a terminal (a file or a pipe)."""
ERROR_CELL_CHARS = 40
"""Characters of a failure or skip reason shown in the table (the JSON has it whole)."""
PLOT_DPI = 120
PLOT_GRID_ALPHA = 0.3
PLOT_SIZE_IN = (12, 8)
REQUIRED_KEYS = (
    "ceiling_tok_s", "engine_tok_s", "daemon_tok_s", "naive_tok_s", "seed_tok_s", "hf_cb_tok_s",
    "naive_p99_ttft_s", "daemon_p99_ttft_s", "synthetic_req_s", "synthetic_p99_ttft_s",
    "synthetic_order_violations", "zmq_msg_s", "synthetic_tok_s", "idle_cpu_percent",
)
"""Keys every ``compare`` JSON report has (None when the part could not run)."""


class PlotUnavailable(RuntimeError):
    """``--plot`` was asked for but matplotlib is not installed."""


@dataclass(frozen=True)
class CompareSettings:
    """Sizes of one ``compare`` run; see :data:`PRESETS`.

    Attributes:
        concurrency, prompt_len, max_tokens: the workload (every system).
        requests: requests per run of engine, hf-cb and daemon.
        naive_requests, seed_requests: requests of the thread-per-request
            baselines (slow: one ``generate()`` per request).
        naive_time_limit_s: the naive and seed runs start no request after this.
        repeats: runs of each throughput measurement (the best is reported);
            naive and seed run once.
        seed_pool: threads of the ``seed`` baseline (0: one per logical core;
            on 2 cores, pools of 1 and 2 threads served 64 streams at
            310-330 tok/s, pools of 4 and 8 at 240-330 tok/s with more CPU per token).
        synthetic_requests: requests per synthetic-daemon run.
        synthetic_concurrency: streams in flight against the synthetic daemon (also its
            ``max_num_seqs`` and ``max_concurrency``): with 64, 1 ms steps and 32 tokens a
            request, no serving layer could pass 64 / 32 ms = 2,000 requests/s; 256 streams
            measure the serving layer instead of the step clock (the load generator's ceiling
            uses the same number).
        synthetic_step_ms: the synthetic engine's step time.
        zmq_messages: messages of the ZeroMQ ceiling.
        loadgen_requests: requests of the load generator's own ceiling.
        idle_s: idle CPU sampling time.
        threads: torch intra-op threads for every part (0: half the cores, at least 1).
        model: model directory (None: the built-in model).
        dtype: weights and activations of every system (``float32``: ringstream's default on
            CPU, the only one where greedy output equals ``generate()`` token for token;
            ``bfloat16``: the built-in model's stored precision, native on CPUs with AVX512-BF16).
        device: torch device of every system (``cpu``, ``cuda:0``).
        model_config, layers, hidden: a random-weight model of a published shape instead of
            ``model`` (:func:`ringstream.tools.model_configs.write_model`).
        max_model_len: the engine's and the daemon's context length (default: the model's).
        capacity_tokens: sequence length of the KV capacity figure.
    """

    concurrency: int = 64
    prompt_len: int = 64
    max_tokens: int = 32
    requests: int = 512
    naive_requests: int = 128
    seed_requests: int = 128
    naive_time_limit_s: float = 120.0
    repeats: int = 3
    seed_pool: int = 0
    synthetic_requests: int = 35_000
    synthetic_concurrency: int = 256
    synthetic_step_ms: float = 1.0
    zmq_messages: int = 1_000_000
    loadgen_requests: int = 2_000
    idle_s: float = 3.0
    threads: int = 0
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    model_config: str | None = None
    layers: int | None = None
    hidden: int | None = None
    max_model_len: int | None = None
    capacity_tokens: int = 2048

    @property
    def on_cpu(self) -> bool:
        """Whether every system runs on the CPU."""
        return self.device == "cpu"

    def seed_threads(self) -> int:
        """Threads of the seed baseline in force (on an accelerator: 1, ``generate()`` one request at a time)."""
        return self.seed_pool or (os.cpu_count() or 1 if self.on_cpu else 1)

    def torch_threads(self) -> int:
        """Threads in force: ``threads``, else half the host's cores (the other half serves front and client)."""
        return self.threads or max(1, (os.cpu_count() or 1) // 2)


PRESETS: dict[str, CompareSettings] = {
    "full": CompareSettings(),
    "quick": CompareSettings(
        requests=192, naive_requests=64, seed_requests=64, naive_time_limit_s=60.0, repeats=2,
        synthetic_requests=8_000, zmq_messages=200_000, loadgen_requests=4_000,
    ),
    "smoke": CompareSettings(
        concurrency=4, prompt_len=8, max_tokens=4, requests=8, naive_requests=4, seed_requests=4,
        naive_time_limit_s=10.0, repeats=1, synthetic_requests=40, synthetic_concurrency=8, zmq_messages=2_000,
        loadgen_requests=20, idle_s=0.3,
    ),
}
"""``full`` (the default), ``quick`` (within about 3 minutes on 2 cores), ``smoke`` (seconds; for tests)."""


# ------------------------------------------------------------------ helpers


def machine_info() -> dict:
    """CPU model, core counts, load, and versions of Python and the main libraries."""
    import psutil

    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_model)
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers", "pyzmq", "msgspec", "ringstream"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_model": cpu_model,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "load_average_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{f"{name}_version": version for name, version in versions.items()},
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _p99_ttft(summary: dict | None) -> float | None:
    return summary["ttft_s"]["p99"] if summary else None


def _best(runs: list[dict]) -> dict | None:
    """The run with the highest tok/s."""
    return max(runs, key=lambda run: run["tok_s"]) if runs else None


class _CpuMeter:
    """CPU seconds used by groups of processes between ``start()`` and ``stop()``, as percent of one core."""

    def __init__(self, groups: dict[str, list]) -> None:
        self.groups = groups
        self._before: dict[str, float] = {}
        self._start = 0.0

    @staticmethod
    def _seconds(processes: list) -> float:
        from ringstream.tools.bench_serving import process_cpu_seconds

        return sum(process_cpu_seconds(proc) for proc in processes)

    def start(self) -> None:
        self._start = time.perf_counter()
        self._before = {name: self._seconds(procs) for name, procs in self.groups.items()}

    def stop(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self._start
        return {
            name: 100.0 * (self._seconds(procs) - self._before[name]) / elapsed
            for name, procs in self.groups.items()
        }


def _log(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ compare


@dataclass
class _Report:
    """What ``compare`` gathers: per-system results and the failures met."""

    systems: dict[str, dict] = field(default_factory=dict)
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    parts_path: str | None = None
    """Where each part appends its JSON line as it ends (``--parts``), so a run cut short keeps what it measured."""

    def part_done(self, name: str, seconds: float) -> None:
        if self.parts_path is None:
            return
        line = {"part": name, "seconds": round(seconds, 3), "result": self.systems.get(name),
                "error": self.errors.get(name)}
        with open(self.parts_path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line, default=str) + "\n")


def _measure(report: _Report, name: str, repeats: int, run) -> None:
    """Call ``run()`` ``repeats`` times; each returns ``(tok_s, records or None)``; keep the best."""
    runs = []
    best_records = None
    for _ in range(repeats):
        tok_s, records = run()
        summary = summarize(records) if records else None
        entry = {"tok_s": tok_s, "summary": summary}
        runs.append(entry)
        if entry is _best(runs):
            best_records = records
    best = _best(runs)
    report.systems[name] = {
        "tok_s": best["tok_s"], "summary": best["summary"], "runs_tok_s": [r["tok_s"] for r in runs],
    }
    if best_records:
        report.records[name] = best_records


def _guard(report: _Report, name: str, action) -> None:
    """Run one part; a failure is recorded and the comparison goes on."""
    _log(f"{name} ...")
    start = time.perf_counter()
    try:
        action()
    except Exception as exc:  # any failure of one part must not lose the others' figures
        report.errors[name] = f"{type(exc).__name__}: {exc}"
        _log(f"{name} failed: {report.errors[name]}")
    else:
        _log(f"{name} done in {time.perf_counter() - start:.1f} s")
    report.part_done(name, time.perf_counter() - start)


def _workload_spec(settings: CompareSettings, info) -> WorkloadSpec:
    return WorkloadSpec(
        prompt_len=Dist("fixed", settings.prompt_len), max_tokens=Dist("fixed", settings.max_tokens),
        vocab_size=info.vocab_size, exclude_ids=tuple(info.eos_token_ids),
    )


def _in_process_parts(settings: CompareSettings, report: _Report, info, spec: WorkloadSpec) -> None:
    """ceiling, engine, hf-cb, seed, naive: one model in this process."""
    from transformers import AutoTokenizer

    from ringstream.daemon.engine.engine import ENGINE_DEFAULTS, Engine, EngineConfig
    from ringstream.daemon.common.model_dir import load_tokenizer
    from ringstream.daemon.engine.loader import load_model
    from ringstream.tools import baselines, bench_device

    stream = spec.requests()
    prompts = [next(stream).prompt_token_ids for _ in range(settings.requests)]
    workload = baselines.Workload(prompts, settings.max_tokens, settings.concurrency)
    try:
        model = load_model(info, device=settings.device, dtype=settings.dtype)
        stock_attention = model.config._attn_implementation
    except Exception as exc:  # every in-process part needs the model: record the cause for each
        for name in IN_PROCESS_SYSTEMS:
            report.errors[name] = f"cannot load the model: {type(exc).__name__}: {exc}"
        return
    prefill_tokens = ENGINE_DEFAULTS.max_num_batched_tokens
    total_ceiling = settings.concurrency * settings.max_tokens

    @functools.cache
    def hf_tokenizer():
        """The transformers tokenizer the streamers need, loaded on first use."""
        return AutoTokenizer.from_pretrained(info.path, local_files_only=True)

    def ceiling() -> None:
        baselines.warm_ceiling(model, workload, prefill_tokens)
        _measure(report, "ceiling", settings.repeats,
                 lambda: (baselines.run_ceiling(model, workload, prefill_tokens), None))
        report.systems["ceiling"]["tokens_per_run"] = total_ceiling

    def engine_part() -> None:
        config = EngineConfig(max_num_seqs=settings.concurrency, max_model_len=settings.max_model_len,
                              device=settings.device)
        engine = Engine(model, load_tokenizer(info), config, eos_token_ids=info.eos_token_ids)
        try:
            engine.warmup()
            report.systems["kv_capacity"] = bench_device.capacity(engine, settings.capacity_tokens)
            baselines.run_engine(engine, workload.head(settings.concurrency))
            _measure(report, "engine", settings.repeats,
                     lambda: _records_rate(baselines.run_engine(engine, workload)))
        finally:
            del engine  # its KV pool: the device memory the transformers baselines need
            _free_device_memory(settings.device)

    def roofline() -> None:
        report.systems["roofline"] = bench_device.roofline(
            model, settings.concurrency, settings.prompt_len, settings.max_tokens, settings.device)

    def hf_cb() -> None:
        if not hasattr(model, "init_continuous_batching"):
            report.systems["hf-cb"] = {"skipped": f"transformers {transformers_version()} has no generate_batch"}
            return
        # The ceiling and the engine ran with the engine's attention (daemon.attention); the
        # transformers baselines run as transformers ships them.
        model.set_attn_implementation(stock_attention)
        with baselines.HfContinuousBatching(model, workload) as cb:
            cb.run(workload.head(min(settings.concurrency, baselines.WARMUP_REQUESTS)))
            _measure(report, "hf-cb", settings.repeats, lambda: _records_rate(cb.run(workload)))
            report.systems["hf-cb"]["settings"] = cb.settings

    warm = workload.head(1, baselines.WARMUP_MAX_TOKENS)

    def seed() -> None:
        baselines.run_seed(model, hf_tokenizer(), warm, settings.seed_threads())
        head = workload.head(settings.seed_requests)
        _measure(report, "seed", 1, lambda: _records_rate(
            baselines.run_seed(model, hf_tokenizer(), head, settings.seed_threads(), settings.naive_time_limit_s)))
        report.systems["seed"]["pool_size"] = settings.seed_threads()

    def naive() -> None:
        if not settings.on_cpu:
            report.systems["naive"] = {"skipped": "on an accelerator: see seed (generate() one at a time)"}
            return
        baselines.run_naive(model, hf_tokenizer(), warm)
        head = workload.head(settings.naive_requests)
        _measure(report, "naive", 1, lambda: _records_rate(
            baselines.run_naive(model, hf_tokenizer(), head, settings.naive_time_limit_s)))

    parts = {"ceiling": ceiling, "engine": engine_part, "hf-cb": hf_cb, "seed": seed, "naive": naive}
    _guard(report, "roofline", roofline)
    for name in IN_PROCESS_SYSTEMS:
        _guard(report, name, parts[name])
    del model
    _free_device_memory(settings.device)


def _free_device_memory(device: str) -> None:
    """Return freed tensors' device memory to the driver (for the next part, or the daemon's worker)."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def transformers_version() -> str:
    """The installed transformers version."""
    return importlib.metadata.version("transformers")


def _records_rate(records: list[RequestRecord]) -> tuple[float, list[RequestRecord]]:
    return summarize(records)["tok_s"], records


def _daemon_part(settings: CompareSettings, report: _Report, name: str, serve_args: list[str],
                 spec: WorkloadSpec, requests: int, check_text: bool, concurrency: int,
                 config: dict | None = None) -> None:
    """Start a daemon, sample its idle CPU, warm it up, then measure ``repeats`` load runs.

    ``concurrency``: streams in flight (and the daemon's ``max_concurrency``); ``config``: more
    settings for the daemon's config file.
    """
    import tempfile

    import psutil

    from ringstream.tools.bench_serving import idle_cpu_percent, running_daemon, write_config

    serve_config = {"worker_threads": settings.torch_threads(), "dtype": settings.dtype} | (config or {})
    if settings.model is not None:
        serve_config["model"] = settings.model  # the daemon serves the model the workload was made for
    if settings.max_model_len and "max_model_len" not in serve_config:
        serve_config["max_model_len"] = settings.max_model_len
    with tempfile.TemporaryDirectory(prefix="ringstream-bench-config-") as tmp:
        config_path = write_config(Path(tmp), serve_config)
        device = "cpu" if "--engine" in serve_args else settings.device
        args = ["--config", str(config_path), "--devices", device, "--max-concurrency", str(concurrency),
                *serve_args]
        with running_daemon(args) as daemon:
            time.sleep(SETTLE_S)
            processes = daemon.processes()
            idle = idle_cpu_percent(processes, settings.idle_s)
            load = LoadConfig(daemon.address, concurrency=concurrency, requests=requests,
                              check_text=check_text, progress=True)
            run_load(replace(load, requests=concurrency, progress=False), spec)
            rss_before = _private_mib(processes[0])  # the front, warmed up
            meter = _CpuMeter({"front": processes[:1], "workers": processes[1:], "loadgen": [psutil.Process()]})
            cpu_runs = []

            def one_run() -> tuple[float, list[RequestRecord]]:
                meter.start()
                result = run_load(load, spec)
                cpu_runs.append(meter.stop())
                summary = summarize(result.records)
                return summary["tok_s"], result.records

            _measure(report, name, settings.repeats, one_run)
            best = max(range(len(cpu_runs)), key=lambda i: report.systems[name]["runs_tok_s"][i])
            report.systems[name].update(
                idle_cpu_percent=idle, cpu_percent_during_load=cpu_runs[best], command=daemon.command,
                front_rss_mib_before=rss_before, front_rss_mib_after=_private_mib(processes[0]),
                requests_measured=requests * settings.repeats,
                config_file=serve_config,
            )


def _serving_parts(settings: CompareSettings, report: _Report, spec: WorkloadSpec) -> None:
    """daemon, synthetic daemon, zmq ceiling, load-generator ceiling."""
    from ringstream.tools.bench_serving import loadgen_ceiling, synthetic_engine_support, zmq_ceiling

    _guard(report, "daemon", lambda: _daemon_part(settings, report, "daemon", [], spec, settings.requests, False,
                                                  settings.concurrency, {"max_num_seqs": settings.concurrency}))
    if not settings.on_cpu:
        skipped = "the serving layer alone does not depend on the device: see the CPU compare"
        for name in ("synthetic", "zmq", "loadgen"):
            report.systems[name] = {"skipped": skipped}
        return
    reason = synthetic_engine_support()
    if reason is None:
        synthetic_args = ["--engine", "synthetic", "--synthetic-step-ms", str(settings.synthetic_step_ms)]
        _guard(report, "synthetic", lambda: _daemon_part(
            settings, report, "synthetic", synthetic_args, spec, settings.synthetic_requests, True,
            settings.synthetic_concurrency, {"max_num_seqs": settings.synthetic_concurrency}))
        if "synthetic" in report.systems:
            report.systems["synthetic"].update(step_ms=settings.synthetic_step_ms,
                                               concurrency=settings.synthetic_concurrency)
    else:
        report.systems["synthetic"] = {"skipped": reason}
        _log(f"synthetic skipped: {reason}")

    def zmq() -> None:
        runs = [zmq_ceiling(settings.zmq_messages) for _ in range(settings.repeats)]
        report.systems["zmq"] = max(runs, key=lambda run: run["msg_s"]) | {"runs_msg_s": [r["msg_s"] for r in runs]}

    def loadgen() -> None:
        report.systems["loadgen"] = loadgen_ceiling(
            LoadConfig("", concurrency=settings.synthetic_concurrency, requests=settings.loadgen_requests,
                       progress=False), spec)

    _guard(report, "zmq", zmq)
    _guard(report, "loadgen", loadgen)


def compare(settings: CompareSettings, command: str = PROG,
            parts_path: str | None = None) -> tuple[dict, dict[str, list[RequestRecord]]]:
    """Run every part of the comparison (see the module docstring).

    ``parts_path``: a file each part appends one JSON line to as it ends (``{"part", "seconds", "result",
    "error"}``), before the whole report exists.

    Returns ``(report, records)``: the JSON report (every key of
    :data:`REQUIRED_KEYS` among others) and, per system measured request by
    request, the records of its best run. A part that fails leaves its
    figures None and its error under ``report["errors"]``.
    """
    import torch

    from ringstream.daemon.common.model_dir import resolve_model_dir

    threads = settings.torch_threads()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    with _model_dir(settings) as model_dir:
        info = resolve_model_dir(model_dir)
        settings = replace(settings, model=str(info.path))
        spec = _workload_spec(settings, info)
        report = _Report(parts_path=parts_path)
        machine = machine_info() | _device_info(settings.device)
        _in_process_parts(settings, report, info, spec)
        _serving_parts(settings, report, spec)
    seconds = time.perf_counter() - started
    return _assemble(settings, report, info, machine, command, threads, seconds), report.records


@contextlib.contextmanager
def _model_dir(settings: CompareSettings):
    """The model directory of the run: ``settings.model``, or a temporary one written from ``model_config``."""
    if settings.model_config is None:
        yield settings.model
        return
    import tempfile

    from ringstream.tools.model_configs import write_model

    with tempfile.TemporaryDirectory(prefix="ringstream-bench-model-") as tmp:
        _log(f"writing a random-weight {settings.model_config} ...")
        start = time.perf_counter()
        write_model(tmp, settings.model_config, layers=settings.layers, hidden=settings.hidden,
                    dtype=settings.dtype, device=settings.device)
        _free_device_memory(settings.device)
        _log(f"model written in {time.perf_counter() - start:.1f} s")
        yield tmp


def _device_info(device: str) -> dict:
    """The accelerator's name and memory, when ``device`` is one."""
    import torch

    if torch.device(device).type != "cuda":
        return {"device": device}
    props = torch.cuda.get_device_properties(torch.device(device))
    return {"device": device, "device_name": props.name, "device_memory_gib": props.total_memory / 2**30,
            "cuda_version": torch.version.cuda}


def _private_mib(proc) -> float:
    """Resident private anonymous memory of ``proc``, MiB (see :func:`ringstream.tools.bench_serving.private_rss_bytes`)."""
    from ringstream.tools.bench_serving import private_rss_bytes

    return private_rss_bytes(proc.pid) / 2**20


def _roofline_bytes(roofline: dict | None) -> str:
    if not roofline:
        return "-"
    return f"{roofline['weight_bytes'] / 1e6:.0f} + {roofline['kv_bytes'] / 1e6:.0f}"


def _capacity(figures: dict | None) -> str:
    if not figures:
        return "-"
    return (f"{figures['sequences']} of {figures['sequence_tokens']} tokens ({figures['kv_cache_tokens']:,} "
            f"positions, {figures['kv_cache_bytes'] / 2**30:.2f} GiB, max_model_len {figures['max_model_len']})")


def _rss(report: dict) -> str:
    before, after = report["synthetic_front_rss_mib_before"], report["synthetic_front_rss_mib_after"]
    if before is None or after is None:
        return "-"
    return f"{before:.1f} / {after:.1f} ({report['synthetic_requests_measured']:,} requests)"


def _assemble(settings, report: _Report, info, machine: dict, command: str, threads: int, seconds: float) -> dict:
    """Flatten the figures and ratios into the JSON report."""
    systems = report.systems

    def tok_s(name: str) -> float | None:
        return systems.get(name, {}).get("tok_s")

    def summary(name: str) -> dict | None:
        return systems.get(name, {}).get("summary")

    synthetic = summary("synthetic")
    zmq = systems.get("zmq", {})
    figures = {
        "ceiling_tok_s": tok_s("ceiling"),
        "engine_tok_s": tok_s("engine"),
        "hf_cb_tok_s": tok_s("hf-cb"),
        "seed_tok_s": tok_s("seed"),
        "naive_tok_s": tok_s("naive"),
        "daemon_tok_s": tok_s("daemon"),
        "engine_p99_ttft_s": _p99_ttft(summary("engine")),
        "hf_cb_p99_ttft_s": _p99_ttft(summary("hf-cb")),
        "seed_p99_ttft_s": _p99_ttft(summary("seed")),
        "naive_p99_ttft_s": _p99_ttft(summary("naive")),
        "daemon_p99_ttft_s": _p99_ttft(summary("daemon")),
        "daemon_req_s": summary("daemon")["req_s"] if summary("daemon") else None,
        "daemon_order_violations": summary("daemon")["order_violations"] if summary("daemon") else None,
        "synthetic_req_s": synthetic["req_s"] if synthetic else None,
        "synthetic_tok_s": synthetic["tok_s"] if synthetic else None,
        "synthetic_p99_ttft_s": _p99_ttft(synthetic),
        "synthetic_order_violations": synthetic["order_violations"] if synthetic else None,
        "synthetic_content_errors": synthetic["content_errors"] if synthetic else None,
        "zmq_msg_s": zmq.get("msg_s"),
        "loadgen_ceiling_tok_s": systems.get("loadgen", {}).get("tok_s"),
        "idle_cpu_percent": systems.get("daemon", {}).get("idle_cpu_percent"),
        "synthetic_idle_cpu_percent": systems.get("synthetic", {}).get("idle_cpu_percent"),
        "synthetic_front_rss_mib_before": systems.get("synthetic", {}).get("front_rss_mib_before"),
        "synthetic_front_rss_mib_after": systems.get("synthetic", {}).get("front_rss_mib_after"),
        "synthetic_requests_measured": systems.get("synthetic", {}).get("requests_measured"),
        "roofline_tok_s": systems.get("roofline", {}).get("tok_s"),
        "bandwidth_gb_s": systems.get("roofline", {}).get("bandwidth_gb_s"),
        "kv_capacity_sequences": systems.get("kv_capacity", {}).get("sequences"),
    }
    ratios = {
        "engine_over_ceiling": _ratio(figures["engine_tok_s"], figures["ceiling_tok_s"]),
        "daemon_over_engine": _ratio(figures["daemon_tok_s"], figures["engine_tok_s"]),
        "daemon_over_naive": _ratio(figures["daemon_tok_s"], figures["naive_tok_s"]),
        "daemon_over_seed": _ratio(figures["daemon_tok_s"], figures["seed_tok_s"]),
        "daemon_over_hf_cb": _ratio(figures["daemon_tok_s"], figures["hf_cb_tok_s"]),
        "daemon_over_ceiling": _ratio(figures["daemon_tok_s"], figures["ceiling_tok_s"]),
        "naive_p99_ttft_over_daemon": _ratio(figures["naive_p99_ttft_s"], figures["daemon_p99_ttft_s"]),
        "seed_p99_ttft_over_daemon": _ratio(figures["seed_p99_ttft_s"], figures["daemon_p99_ttft_s"]),
        "hf_cb_p99_ttft_over_daemon": _ratio(figures["hf_cb_p99_ttft_s"], figures["daemon_p99_ttft_s"]),
        "daemon_p99_ttft_over_engine": _ratio(figures["daemon_p99_ttft_s"], figures["engine_p99_ttft_s"]),
        "synthetic_tok_s_over_zmq_msg_s": _ratio(figures["synthetic_tok_s"], figures["zmq_msg_s"]),
        "synthetic_tok_s_over_loadgen_ceiling": _ratio(figures["synthetic_tok_s"], figures["loadgen_ceiling_tok_s"]),
        "synthetic_tok_s_over_daemon": _ratio(figures["synthetic_tok_s"], figures["daemon_tok_s"]),
        "ceiling_over_roofline": _ratio(figures["ceiling_tok_s"], figures["roofline_tok_s"]),
        "engine_over_roofline": _ratio(figures["engine_tok_s"], figures["roofline_tok_s"]),
        "daemon_over_roofline": _ratio(figures["daemon_tok_s"], figures["roofline_tok_s"]),
    }
    return {
        **figures,
        **{f"ratio_{name}": value for name, value in ratios.items()},
        "command": command,
        "machine": machine,
        "settings": asdict(settings) | {"torch_threads": threads, "model_path": str(info.path)},
        "workload": {
            "concurrency": settings.concurrency, "prompt_len": settings.prompt_len,
            "max_tokens": settings.max_tokens, "sampling": "greedy, EOS ignored", "loop": "closed",
        },
        "systems": systems,
        "errors": report.errors,
        "seconds": seconds,
    }


# ------------------------------------------------------------------ output


def _fmt(value, spec: str = ".0f", scale: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value if scale is None else value * scale:{spec}}"


def _ms(value) -> str:
    return _fmt(value, ".2f", 1e3)


def _console():
    """A rich console on stdout; wide enough for the tables when stdout is not a terminal."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=CONSOLE_WIDTH)


def print_compare(report: dict, console=None) -> None:
    """Print the comparison as rich tables."""
    from rich.table import Table

    console = console or _console()
    systems = report["systems"]
    table = Table(title=f"ringstream-bench compare: {report['command']}")
    for column in ("system", "tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                   "E2E p99 ms", "requests", "errors", "order viol."):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name in (*SYSTEMS, "synthetic", "roofline"):
        entry = systems.get(name, {})
        summary = entry.get("summary")
        if "skipped" in entry or name in report["errors"]:
            reason = (entry.get("skipped") or report["errors"][name]).splitlines()[0]
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", reason[:ERROR_CELL_CHARS], "-")
            continue
        if summary is None:
            table.add_row(name, _fmt(entry.get("tok_s")), *["-"] * 9)
            continue
        table.add_row(
            name, _fmt(entry["tok_s"]), _fmt(summary["req_s"], ".1f"),
            _ms(summary["ttft_s"]["p50"]), _ms(summary["ttft_s"]["p99"]),
            _ms(summary["itl_s"]["p50"]), _ms(summary["itl_s"]["p99"]), _ms(summary["e2e_s"]["p99"]),
            str(summary["requests"]), str(sum(summary["errors"].values())), str(summary["order_violations"]),
        )
    console.print(table)

    ratios = Table(title="ratios")
    ratios.add_column("ratio")
    ratios.add_column("value", justify="right")
    ratios.add_column("target", justify="right")
    settings = report["settings"]
    standard = (settings["concurrency"], settings["prompt_len"], settings["max_tokens"]) == TARGET_WORKLOAD
    for key, label in RATIO_LABELS.items():
        value, target = report[f"ratio_{key}"], RATIO_TARGETS.get(key) if standard else None
        verdict = "" if target is None or value is None else f">= {target:g} {'met' if value >= target else 'MISSED'}"
        ratios.add_row(label, _fmt(value, ".3f"), verdict)
    console.print(ratios)

    serving = Table(title="serving layer")
    serving.add_column("figure")
    serving.add_column("value", justify="right")
    rows = (
        ("synthetic req/s", _fmt(report["synthetic_req_s"], ".0f")),
        ("synthetic tok/s", _fmt(report["synthetic_tok_s"], ".0f")),
        ("synthetic P99 TTFT ms", _ms(report["synthetic_p99_ttft_s"])),
        ("synthetic order violations", _fmt(report["synthetic_order_violations"], "d")),
        ("synthetic content errors", _fmt(report["synthetic_content_errors"], "d")),
        ("zmq DEALER->ROUTER msg/s", _fmt(report["zmq_msg_s"], ".0f")),
        ("synthetic tok/s / zmq msg/s", _fmt(report["ratio_synthetic_tok_s_over_zmq_msg_s"], ".3f")),
        ("load generator ceiling tok/s", _fmt(report["loadgen_ceiling_tok_s"], ".0f")),
        ("idle daemon CPU % (front + workers)", _fmt(report["idle_cpu_percent"], ".2f")),
        ("idle synthetic daemon CPU %", _fmt(report["synthetic_idle_cpu_percent"], ".2f")),
        ("synthetic front private RSS MiB before / after", _rss(report)),
        ("device copy bandwidth GB/s", _fmt(report.get("bandwidth_gb_s"), ".1f")),
        ("roofline: bytes read per decode step (weights + KV) MB", _roofline_bytes(systems.get("roofline"))),
        ("KV capacity: sequences at once", _capacity(systems.get("kv_capacity"))),
    )
    for label, value in rows:
        serving.add_row(label, value)
    for name in ("daemon", "synthetic"):
        cpu = systems.get(name, {}).get("cpu_percent_during_load")
        if cpu:
            serving.add_row(f"{name} CPU % under load", ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))
    console.print(serving)
    machine = report["machine"]
    console.print(
        f"{machine.get('device_name', machine['cpu_model'])}, {machine['logical_cores']} logical cores, "
        f"torch {machine['torch_version']}, "
        f"transformers {machine['transformers_version']}, torch threads {report['settings']['torch_threads']}, {report['settings']['dtype']}, "
        f"load average at start {machine['load_average_at_start'][0]:.2f}; {report['seconds']:.0f} s"
    )
    for name, error in report["errors"].items():
        console.print(f"[red]{name} failed:[/red] {error}")


def print_run(report: dict, console=None) -> None:
    """Print one load run's summary as a rich table."""
    from rich.table import Table

    console = console or _console()
    summary = report["summary"]
    table = Table(title=f"ringstream-bench run: {report['command']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("requests (completed)", f"{summary['requests']} ({summary['completed']})")
    table.add_row("wall s", f"{summary['wall_s']:.2f}")
    table.add_row("requests/s", f"{summary['req_s']:.2f}")
    table.add_row("output tokens/s", f"{summary['tok_s']:.0f}")
    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        stats = summary[key]
        table.add_row(f"{label} p50 / p90 / p99 / max ms",
                      " / ".join(_ms(stats[k]) for k in ("p50", "p90", "p99", "max")))
    table.add_row("errors", ", ".join(f"{k} {v}" for k, v in summary["errors"].items()) or "0")
    table.add_row("order violations", str(summary["order_violations"]))
    table.add_row("content errors", str(summary["content_errors"]))
    for priority, stats in summary.get("by_priority", {}).items():
        table.add_row(f"priority {priority}: requests, TTFT p50 / p99 ms",
                      f"{stats['requests']}, {_ms(stats['ttft_s']['p50'])} / {_ms(stats['ttft_s']['p99'])}")
    console.print(table)


def _pyplot():
    """matplotlib's pyplot on the Agg backend; raises :class:`PlotUnavailable` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'ringstream[plot]' (or pip install 'matplotlib>=3.7')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path: str | Path, runs: dict[str, list[RequestRecord]]) -> None:
    """Draw TTFT, ITL and E2E CDFs and output tokens/s over time, one line per run, into a PNG.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=PLOT_SIZE_IN)
    panels = (
        (axes[0][0], "TTFT", lambda recs: [r.ttft for r in recs if r.error is None and r.ttft is not None]),
        (axes[0][1], "ITL", lambda recs: [s for r in recs if r.error is None
                                          for s in itl_samples(r.chunk_times, r.chunk_tokens)]),
        (axes[1][0], "E2E", lambda recs: [r.e2e for r in recs if r.error is None and r.e2e is not None]),
    )
    for axis, label, values_of in panels:
        for name, records in runs.items():
            values = [v for v in values_of(records) if v > 0]
            if values:
                xs, ys = cdf(values)
                axis.plot([x * 1e3 for x in xs], ys, label=name)
        axis.set_xscale("log")
        axis.set_xlabel(f"{label} (ms, log scale)")
        axis.set_ylabel("fraction of samples")
        axis.set_title(f"{label} CDF")
        axis.grid(True, alpha=PLOT_GRID_ALPHA)
        axis.legend()
    axis = axes[1][1]
    for name, records in runs.items():
        points = timeline(records)
        if points:
            axis.plot([t for t, _ in points], [v for _, v in points], marker=".", label=name)
    axis.set_xlabel("time since the first request (s)")
    axis.set_ylabel("output tokens/s")
    axis.set_title("throughput over time")
    axis.grid(True, alpha=PLOT_GRID_ALPHA)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _write_json(path: str, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    """The ``ringstream-bench`` argument parser (subcommands ``run`` and ``compare``)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="drive a running daemon and report latency and throughput")
    run.add_argument("--socket", required=True,
                     help="daemon address, e.g. ipc:///run/user/1000/ringstream/default.sock")
    loop = run.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=64, help="closed loop: streams in flight (default 64)")
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests per second")
    stop = run.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, help="requests in all (default 256 unless --duration)")
    stop.add_argument("--duration", type=float, help="seconds during which requests start")
    run.add_argument("--prompt-len", default="64", help="prompt tokens: N, uniform:A:B, normal:MEAN:STD, exp:MEAN")
    run.add_argument("--max-tokens", default="32", help="new tokens per request, same forms (default 32)")
    run.add_argument("--prompt-kind", choices=("ids", "text", "mixed"), default="ids",
                     help="send prompt_token_ids, text (decoded with the model's tokenizer) or both alternately")
    run.add_argument("--priority-mix", help='priorities and their shares, e.g. "0:0.8,10:0.2" (default all 0)')
    run.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    run.add_argument("--model", help="model directory for the vocabulary and text prompts (default: built-in)")
    run.add_argument("--seed", type=int, default=WorkloadSpec.seed, help="seed of the request generator")
    run.add_argument("--clients", type=int, default=1,
                     help="AsyncClients per process, streams round-robin (default 1: against the synthetic daemon "
                          "on 2 cores, 64 streams on one shared client gave 40.0k tok/s best of 4, one client in "
                          "each of 2 processes 38.8k, 8 clients 36.8k, one client per stream 28.8k)")
    run.add_argument("--procs", type=int, default=1, help="load generator processes, load split evenly (default 1)")
    run.add_argument("--check-synthetic-text", action="store_true",
                     help="check each stream's text is the synthetic engine's ' t0 t1 ...'")
    run.add_argument("--json", help="write the report (config, summary, timeline) to this file")
    run.add_argument("--plot", help="draw latency CDFs and tokens/s over time into this PNG (needs matplotlib)")

    bench_kv.add_parser(sub)
    bench_vllm.add_parser(sub)
    bench_cluster.add_parser(sub)

    cmp = sub.add_parser("compare", help="daemon against baselines and the serving-layer ceilings, one table")
    preset = cmp.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_const", const="quick", dest="preset",
                        help="fewer requests and repeats: within 3 minutes on 2 cores (about 70 s here)")
    preset.add_argument("--smoke", action="store_const", const="smoke", dest="preset",
                        help="a handful of tiny requests per part (seconds; checks that every part runs)")
    cmp.add_argument("--requests", type=int, help="requests per run of engine, hf-cb and daemon")
    cmp.add_argument("--repeats", type=int, help="runs of each throughput measurement")
    cmp.add_argument("--threads", type=int, help="torch threads of every part (default: half the cores)")
    cmp.add_argument("--seed-pool", type=int, help="threads of the seed baseline")
    cmp.add_argument("--seed-requests", type=int, help="requests of the seed and naive baselines")
    cmp.add_argument("--time-limit", type=float, help="the seed and naive baselines start no request after this (s)")
    cmp.add_argument("--dtype", choices=["float32", "bfloat16"],
                     help="dtype of every system (default float32 on CPU, bfloat16 elsewhere)")
    cmp.add_argument("--synthetic-step-ms", type=float, help="synthetic engine step time (default 1 ms)")
    models = cmp.add_mutually_exclusive_group()
    models.add_argument("--model", help="model directory (default: built-in model)")
    models.add_argument("--model-config", choices=sorted(MODEL_CONFIG_NAMES),
                        help="a random-weight model of this published shape (no download)")
    cmp.add_argument("--layers", type=int, help="with --model-config: decoder layers")
    cmp.add_argument("--hidden", type=int, help="with --model-config: hidden size")
    cmp.add_argument("--device", help="torch device of every system (default cpu), e.g. cuda:0")
    cmp.add_argument("--concurrency", type=int, help="streams in flight (default 64)")
    cmp.add_argument("--prompt-len", type=int, help="prompt tokens (default 64)")
    cmp.add_argument("--max-tokens", type=int, help="new tokens per request (default 32)")
    cmp.add_argument("--max-model-len", type=int, help="context length of the engine and the daemon")
    cmp.add_argument("--capacity-tokens", type=int, help="sequence length of the KV capacity figure (default 2048)")
    cmp.add_argument("--json", help="write the report to this file")
    cmp.add_argument("--parts", help="append one JSON line per part to this file as each part ends")
    cmp.add_argument("--plot", help="draw every system's latency CDFs and tokens/s over time (needs matplotlib)")
    return parser


def _run_command(args: argparse.Namespace, command: str) -> int:
    from ringstream.daemon.common.model_dir import resolve_model_dir

    info = resolve_model_dir(args.model)
    workload = WorkloadSpec(
        prompt_len=Dist.parse(args.prompt_len), max_tokens=Dist.parse(args.max_tokens),
        vocab_size=info.vocab_size, exclude_ids=tuple(info.eos_token_ids), prompt_kind=args.prompt_kind,
        priority_mix=tuple(parse_priority_mix(args.priority_mix)), seed=args.seed,
    )
    requests = args.requests if args.requests is not None or args.duration is not None else 256
    config = LoadConfig(
        args.socket, concurrency=args.concurrency, rate=args.rate, requests=requests, duration_s=args.duration,
        clients=args.clients, procs=args.procs, check_text=args.check_synthetic_text,
        temperature=args.temperature,
    ).check()
    if args.plot:
        _pyplot()
    result = run_load(config, workload, args.model)
    report = {
        "command": command,
        "config": asdict(config) | {"prompt_len": str(workload.prompt_len), "max_tokens": str(workload.max_tokens),
                                    "prompt_kind": workload.prompt_kind, "priority_mix": workload.priority_mix,
                                    "seed": workload.seed},
        "summary": summarize(result.records, result.wall_s),
        "timeline": timeline(result.records),
        "client_decode_errors": result.client_decode_errors,
        "per_proc": result.per_proc,
        "machine": machine_info(),
    }
    print_run(report)
    if args.json:
        _write_json(args.json, report)
    if args.plot:
        plot(args.plot, {"daemon": result.records})
    return 0 if report["summary"]["order_violations"] == 0 else 1


def _compare_command(args: argparse.Namespace, command: str) -> int:
    settings = PRESETS[args.preset or "full"]
    overrides = {
        "requests": args.requests, "repeats": args.repeats, "threads": args.threads, "seed_pool": args.seed_pool,
        "synthetic_step_ms": args.synthetic_step_ms, "model": args.model, "dtype": args.dtype,
        "device": args.device, "model_config": args.model_config, "layers": args.layers, "hidden": args.hidden,
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len, "capacity_tokens": args.capacity_tokens,
        "seed_requests": args.seed_requests, "naive_requests": args.seed_requests,
        "naive_time_limit_s": args.time_limit,
    }
    if args.device not in (None, "cpu") and args.dtype is None:
        overrides["dtype"] = "bfloat16"
    if (args.layers or args.hidden) and not args.model_config:
        raise WorkloadError("--layers and --hidden shrink a --model-config model")
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.plot:
        _pyplot()
    report, records = compare(settings, command, parts_path=args.parts)
    print_compare(report)
    if args.json:
        _write_json(args.json, report)
    if args.plot:
        plot(args.plot, records)
    return 0 if not report["errors"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ringstream-bench``; returns the exit code (2 for bad arguments)."""
    args = build_parser().parse_args(argv)
    command = shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.command == "run":
            return _run_command(args, command)
        if args.command == "kv":
            return bench_kv.command(args)
        if args.command == "cluster":
            return bench_cluster.command(args)
        if args.command == "vllm":
            return bench_vllm.command(args, command)
        return _compare_command(args, command)
    except (WorkloadError, PlotUnavailable) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

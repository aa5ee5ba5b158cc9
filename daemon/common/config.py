"""Daemon configuration: one msgspec Struct, loaded from TOML and CLI flags.

Every field has a default, so an empty file (or none) is a valid config.
:meth:`Config.check` raises :class:`ValueError` naming the bad value.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Literal

import msgspec

from ringstream.daemon.common.engine_config import ENGINE_DEFAULTS, EngineConfig
from ringstream.daemon.common.listen import is_loopback_host, offset_endpoint, parse_listen
from ringstream.ipc.address import default_socket, runtime_dir  # noqa: F401  (re-exported)

INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TCP_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")

MAX_AGING_RATE = 1e6
"""Largest ``aging_rate``, levels per second: beyond it a second's wait outweighs any priority gap (2**32)
many times over, and the queue's keys would lose their order to float rounding."""


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings of one ringstream daemon instance."""

    instance: str = "default"
    """Instance name; scopes the socket path and the /dev/shm ring names."""
    socket: str | None = None
    """ZeroMQ address clients connect to. Default: ``ipc://$RUNTIME_DIRECTORY/ringstream.sock``
    under systemd, else ``ipc://$XDG_RUNTIME_DIR/ringstream/<instance>.sock`` (or a temp dir)."""
    socket_mode: int = 0o600
    """File mode of the ipc socket (0o600 owner only, 0o660 with the group); the rings get the
    owner's read-write bits and, when the group may connect, group read only."""
    max_clients: int = 1024
    """Client connections the daemon is sized for: at start the open-file limit (RLIMIT_NOFILE) must
    allow this many plus the daemon's own files; the soft limit is raised up to the hard one if needed (under systemd the
    unit's ``LimitNOFILE=``)."""
    curve_secret_key_file: str | None = None
    """ZeroMQ certificate (``zmq.auth.create_certificates`` format) holding the server's CURVE secret and
    public key. With it the client socket is CURVE-encrypted and authenticated; required for a
    non-loopback TCP ``socket``."""
    curve_allowed_clients_dir: str | None = None
    """Directory of client public-key certificates (``*.key``) allowed to connect over CURVE;
    re-read on SIGHUP. Required with ``curve_secret_key_file``."""
    model: str | None = None
    """Hugging Face causal-LM directory, or a model id ``org/name[@revision]`` found in the local Hugging Face
    cache (``HF_HUB_CACHE`` / ``HF_HOME``; downloaded there unless ``HF_HUB_OFFLINE``); None = the built-in
    default model. Under systemd it must be readable by user ``ringstream`` and not under ``/home``."""
    devices: str = "auto"
    """``auto`` (every visible CUDA GPU, else one CPU worker), ``cpu``, ``cpu,cpu``, ``cuda:0,cuda:1``."""
    engine: Literal["hf", "synthetic"] = "hf"
    """Engine backend: ``hf`` = paged continuous batching over a Hugging Face model;
    ``synthetic`` = deterministic tokens at a fixed step time, no model compute (to measure
    and capacity-plan the serving layer alone)."""
    synthetic_step_ms: float = 1.0
    """Step time of the synthetic engine, milliseconds."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights/activations dtype; ``auto`` = float32 on CPU (greedy output equals ``generate()``), bfloat16 on
    CUDA. ``bfloat16`` on CPUs with AVX512-BF16 or AMX runs the built-in model about 1.7x faster."""
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    """Most requests a worker runs at once (its batch rows); the KV pool need not hold them all at
    full length: blocks are taken as sequences grow."""
    max_concurrency: int = 64
    """Requests running at once per worker (at most the worker's slots, ``max_num_seqs``)."""
    memory_utilization: float = ENGINE_DEFAULTS.memory_utilization
    """Fraction of the memory available after the weights and a profiling forward (RAM on CPU, GPU memory
    on CUDA) that a worker's KV pool may take, when ``kv_cache_bytes`` is not set. The pool never grows past
    ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    kv_cache_bytes: int | None = ENGINE_DEFAULTS.kv_cache_bytes
    """Size of each worker's KV pool in bytes (all layers, keys and values); None = from ``memory_utilization``."""
    max_model_len: int | None = ENGINE_DEFAULTS.max_model_len
    """Most tokens (prompt + output) per request; None = the model's context (``max_position_embeddings``).
    A worker whose KV pool cannot hold one sequence this long refuses to start, naming the largest that fits."""
    block_size: int = ENGINE_DEFAULTS.block_size
    """Token positions per KV-cache block."""
    enable_prefix_caching: bool = ENGINE_DEFAULTS.enable_prefix_caching
    """Reuse the KV blocks of prompt prefixes already computed (chained block hashes, LRU eviction)."""
    priority_queue_limits: dict[str, int] = {}
    """Most requests waiting per priority, e.g. ``{"10" = 100}``; others are bounded by ``queue_size`` only."""
    queue_full_policy: Literal["reject", "evict"] = "reject"
    """Queue full: refuse the newcomer, or evict the least urgent waiting request if the newcomer is more urgent."""
    aging_rate: float = 1.0
    """Priority levels a waiting request gains per second (starvation bound: priority gap / aging_rate seconds)."""
    preemption: bool = True
    """Preempt the least urgent running request when a strictly more urgent one waits and nothing is free."""
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    """New tokens one engine step computes: running decodes first (one each), then prompt chunks in what is
    left (chunked prefill). Smaller bounds the inter-token stall a long prompt causes; larger prefills faster."""
    max_step_ms: float | None = ENGINE_DEFAULTS.max_step_ms
    """Target duration of an engine step that carries a prompt chunk, milliseconds: the chunk is sized from the
    measured cost of a prompt token on the worker's device, so decoding streams stall about this long at most
    while a long prompt prefills; ``max_num_batched_tokens`` stays the upper bound. Unset: 50 on CPU and on a
    GPU; 0: the token budget alone."""
    prefill_burst_ratio: float | None = ENGINE_DEFAULTS.prefill_burst_ratio
    """When the requests with prompts still to compute number at least this many times the decoding ones (and at
    least two), a step takes prompt tokens up to ``max_num_batched_tokens`` regardless of ``max_step_ms``: a burst
    of arrivals is prefilled in a few large steps and then decodes together with no prompt chunks between its
    tokens (lower TPOT), paying with its TTFT and long steps for the streams already decoding. Unset: 0.5 on CPU
    (a burst when prompts are at least half as many as the decoding streams), off on a GPU; 0: off (every step
    bounded by ``max_step_ms``)."""
    queue_size: int = 10_000
    """Requests waiting at most (all workers); a request beyond it gets ``QUEUE_FULL`` at once."""
    client_timeout_s: float = 10.0
    """A client with open requests that sends nothing for this long is gone: its requests are cancelled."""
    queue_timeout_s: float | None = None
    """Default bound on a request's wait in the queue (``QUEUE_TIMEOUT``); None = no bound.
    A request may shorten it, never lengthen it."""
    timeout_s: float = 60.0
    """Default bound on a request's whole life; past it the stream ends with ``finish_reason="timeout"``
    after the tokens it has. A request may shorten it, never lengthen it."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, running streams get this long to finish before they end with ``shutdown``."""
    worker_start_timeout_s: float = 300.0
    """A worker that has not loaded its model and warmed up by then fails the start."""
    worker_stall_timeout_s: float = 30.0
    """A worker whose heartbeat is older than this (hung, SIGSTOPped) is killed and restarted."""
    worker_heartbeat_s: float = 1.0
    """Period of a worker's heartbeat (and of its front-liveness check) when idle."""
    ring_bytes: int = 4 * 1024 * 1024
    """Data bytes of each worker's token ring (a power of two)."""
    worker_threads: int = 0
    """torch intra-op threads per CPU worker; 0 = the host's cores divided among the CPU workers."""
    native_kernels: bool = ENGINE_DEFAULTS.native_kernels
    """On CPU workers: the native kernels (decode attention, prompt-chunk attention on AVX-512 hosts, float32 and bfloat16 GEMM over packed weights with fused q/k/v and
    gate/up projections, RMSNorm, SiLU-and-mul; built once with the host's C++ compiler, cached under
    ``~/.cache/ringstream/kernels``; oneDNN-packed linears where they cannot be built); false: plain PyTorch
    (same tokens in float32, slower)."""
    seed: int = ENGINE_DEFAULTS.seed
    """Seed of the workers' sampling generator for requests that give none."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on http://127.0.0.1:PORT/metrics; None = no exporter."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log records written (to stderr: the journal under systemd)."""
    http: str | None = None
    """``HOST:PORT`` of the OpenAI-compatible HTTP API, served by a child process of the front
    (``ringstream: http``); None = no HTTP server. A host that is not loopback needs ``api_key_file`` or
    ``api_key``."""
    http_unix: str | None = None
    """Also (or only) serve the HTTP API on this unix socket path (mode 0600)."""
    api_key: str | None = None
    """The bearer token HTTP clients must send, inline (``serve --api-key`` or ``$RINGSTREAM_API_KEY``; a file
    of it is safer: ``api_key_file``). Not both."""
    api_key_file: str | None = None
    """File holding the bearer token HTTP clients must send (``Authorization: Bearer KEY``)."""
    served_model_name: str | None = None
    """The model's name in the HTTP API; None = its Hugging Face id ``org/name`` for a hub model, else the model
    directory's name."""
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "none"] = "auto"
    """The tool call format the HTTP API's ``tool_choice`` auto reads from the model's output: ``auto`` = the one
    its chat template shows (``<tool_call>``: hermes; ``<|python_tag|>``: llama3_json); ``none`` refuses auto."""
    http_unknown_fields: Literal["error", "warn"] = "error"
    """A request field the HTTP API does not know: ``error`` answers 400 naming it (OpenAI's behaviour), ``warn``
    logs it and serves the request (vLLM's)."""
    http_access_log: bool = False
    """Log one line per HTTP request (client, request line, status, bytes, seconds, user agent)."""
    kv_events_endpoint: str | None = None
    """Publish KV-cache events (blocks stored in and evicted from the prefix cache) in vLLM's format on a ZeroMQ
    PUB socket bound here, ``tcp://HOST:PORT`` (``*`` for every interface) or ``ipc://PATH``, for KV-aware
    routers (vllm-router ``--policy kv_aware``, llm-d). Worker ``i`` binds PORT + ``i`` (PATH.``i`` past 0),
    as vLLM's data-parallel ranks do. The events carry prompt token ids: bind where only the router can
    connect. None = off."""
    kv_events_replay_endpoint: str | None = None
    """Also bind a ZeroMQ ROUTER here that resends buffered event batches to a subscriber that missed some
    (vLLM's replay protocol); per worker as ``kv_events_endpoint``. Needs ``kv_events_endpoint``."""
    kv_events_topic: str = ""
    """The topic frame of every KV events message (vLLM's ``topic``; empty by default, as vLLM's)."""

    def check(self) -> "Config":
        """Validate every field; returns self. Raises ValueError naming the bad value."""
        if not INSTANCE_RE.match(self.instance):
            raise ValueError(f"instance {self.instance!r}: use 1-64 letters, digits, '_', '.', '-'")
        curve = self.curve_secret_key_file is not None
        if curve != (self.curve_allowed_clients_dir is not None):
            raise ValueError("curve_secret_key_file and curve_allowed_clients_dir: give both or neither")
        if self.socket is not None:
            check_socket_address(self.socket, curve=curve)
        if self.max_clients < 1:
            raise ValueError(f"max_clients = {self.max_clients}: must be >= 1")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port = {self.metrics_port}: a TCP port is 1 to 65535")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"socket_mode {self.socket_mode:o}: not a file mode")
        if not 0 <= self.aging_rate <= MAX_AGING_RATE:  # also refuses NaN and inf (every key inf: no order)
            raise ValueError(f"aging_rate = {self.aging_rate}: must be 0 to {MAX_AGING_RATE:g} levels per second")
        self.priority_limits()
        if not self.synthetic_step_ms >= 0:
            raise ValueError(f"synthetic_step_ms = {self.synthetic_step_ms}: must be >= 0")
        self.engine_config().check()
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes = {self.kv_cache_bytes}: must be >= 1 byte (or unset)")
        for name in ("max_concurrency", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s = {self.queue_timeout_s}: must be > 0 seconds")
        for name in ("client_timeout_s", "timeout_s", "drain_timeout_s", "worker_start_timeout_s",
                     "worker_heartbeat_s", "worker_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0 seconds")
        if self.ring_bytes < 4096 or self.ring_bytes & (self.ring_bytes - 1):
            raise ValueError(f"ring_bytes = {self.ring_bytes}: must be a power of two >= 4096")
        if self.worker_threads < 0:
            raise ValueError(f"worker_threads = {self.worker_threads}: must be >= 0")
        parse_devices(self.devices)
        self._check_http()
        self._check_kv_events()
        return self

    def _check_kv_events(self) -> None:
        """``kv_events_*``; ValueError naming the bad one."""
        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ValueError("kv_events_replay_endpoint is set but kv_events_endpoint is not")
            return
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) is not None:
                offset_endpoint(getattr(self, name), 0)
        if self.kv_events_replay_endpoint == self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint: must differ from kv_events_endpoint")
        if len(self.kv_events_topic.encode()) > 256:
            raise ValueError("kv_events_topic: at most 256 bytes")

    def _check_http(self) -> None:
        """``http``/``http_unix``/``api_key_file``/``served_model_name``; ValueError naming the bad one."""
        if self.http is not None:
            try:
                host, _ = parse_listen(self.http)
            except ValueError:
                raise ValueError(f"http = {self.http!r}: use HOST:PORT (e.g. 127.0.0.1:8000)") from None
            if not is_loopback_host(host) and self.api_key_file is None and self.api_key is None:
                raise ValueError(f"http = {self.http!r}: a host that is not loopback needs an API key: "
                                 "api_key_file or api_key (serve --api-key-file FILE or --api-key KEY); HTTP "
                                 "clients then send Authorization: Bearer KEY")
        if self.http_unix is not None and not self.http_unix:
            raise ValueError("http_unix: empty path")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key and api_key_file: give one of them")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key: empty")
        for name in ("api_key", "api_key_file", "served_model_name"):
            if getattr(self, name) is not None and self.http is None and self.http_unix is None:
                raise ValueError(f"{name} is set but no HTTP server is: give http (HOST:PORT) or http_unix")
        if self.served_model_name is not None and not 1 <= len(self.served_model_name) <= 256:
            raise ValueError(f"served_model_name {self.served_model_name!r}: 1 to 256 characters")

    def engine_config(self, device: str = "cpu", dtype: str = "float32", threads: int = 0) -> EngineConfig:
        """The engine settings of a worker on ``device`` (with its resolved ``dtype`` and ``threads``)."""
        return EngineConfig.from_settings(self, backend=self.engine, device=device, dtype=dtype, threads=threads,
                                          synthetic_step_s=self.synthetic_step_ms / 1000)

    @property
    def serves_http(self) -> bool:
        """Whether the front runs the HTTP API child process."""
        return self.http is not None or self.http_unix is not None

    def priority_limits(self) -> dict[int, int]:
        """``priority_queue_limits`` with integer keys. Raises ValueError for a bad key or limit."""
        limits = {}
        for key, limit in self.priority_queue_limits.items():
            try:
                priority = int(key)
            except ValueError:
                raise ValueError(f"priority_queue_limits: key {key!r} is not an integer priority") from None
            if limit < 0:
                raise ValueError(f"priority_queue_limits[{key}] = {limit}: must be >= 0")
            limits[priority] = limit
        return limits

    def address(self) -> str:
        """The client socket address in force (explicit or default)."""
        return self.socket or default_socket(self.instance)


def check_socket_address(address: str, curve: bool = False) -> None:
    """Accept ``ipc://PATH`` and ``tcp://HOST:PORT``; raise ValueError otherwise.

    A TCP host must be a loopback address unless ``curve`` (CURVE keys are
    configured): a non-loopback bind exposes the daemon to the network, where
    only CURVE's encryption and client allow-list keep strangers out.
    """
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ValueError(f"socket {address!r}: empty ipc path")
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        if host not in TCP_LOOPBACK_HOSTS and not host.startswith("127.") and not curve:
            raise ValueError(f"socket {address!r}: TCP binds loopback only unless CURVE is configured "
                             "(curve_secret_key_file and curve_allowed_clients_dir)")
        return
    raise ValueError(f"socket {address!r}: use ipc://PATH or tcp://127.0.0.1:PORT")


def parse_devices(spec: str) -> list[str]:
    """``"cpu,cpu"`` -> ``["cpu", "cpu"]``; ``auto`` -> CUDA GPUs seen by the driver, else ``["cpu"]``.

    ``auto`` reads /proc/driver/nvidia/gpus (and ``CUDA_VISIBLE_DEVICES``) so
    that the front never imports torch. Raises ValueError for an unknown device.
    """
    spec = spec.strip()
    if spec == "auto":
        count = visible_cuda_devices()
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    devices = [d.strip() for d in spec.split(",")]
    for device in devices:
        if device != "cpu" and not re.fullmatch(r"cuda:\d{1,2}", device):
            raise ValueError(f"device {device!r} in {spec!r}: use auto, cpu or cuda:N")
    if not devices or len(devices) > 64:
        raise ValueError(f"devices {spec!r}: give 1 to 64 devices")
    return devices


def visible_cuda_devices() -> int:
    """Number of NVIDIA GPUs this process may use, without importing torch."""
    gpus = Path("/proc/driver/nvidia/gpus")
    count = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]))
    return count


API_KEY_ENV = "RINGSTREAM_API_KEY"
"""The environment variable ``serve --api-key`` defaults to (vLLM's ``VLLM_API_KEY``)."""


def _file_settings(path: str | Path | None) -> dict:
    """The settings a TOML config file gives, as written; empty when there is none or it cannot be read
    (``load_config`` then says why)."""
    if path is None:
        return {}
    try:
        settings = msgspec.toml.decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def load_serve_config(path: str | Path | None, overrides: dict) -> Config:
    """:func:`load_config` for ``ringstream serve`` (at start and at each reload): ``$RINGSTREAM_API_KEY``
    (:data:`API_KEY_ENV`) is the ``api_key`` default where HTTP is served and neither ``api_key`` nor
    ``api_key_file`` is given, by ``overrides`` or by the file (a key file wins over the environment).

    Raises:
        ValueError: as :func:`load_config`; naming :data:`API_KEY_ENV` when its value is the bad one.
    """
    env_key = os.environ.get(API_KEY_ENV)
    given = {**_file_settings(path), **{k: v for k, v in overrides.items() if v is not None}}
    if env_key is not None and not {"api_key", "api_key_file"} & given.keys() and {"http", "http_unix"} & given.keys():
        if not env_key.strip():
            raise ValueError(f"${API_KEY_ENV} is set but empty: give the key, or unset it")
        overrides = {**overrides, "api_key": env_key}
    return load_config(path, **overrides)


def load_config(path: str | Path | None = None, **overrides) -> Config:
    """Read a TOML config file (or none) and apply non-None ``overrides``.

    Raises ValueError for unknown keys, wrong types or bad values, naming them.
    """
    data: dict = {}
    if path is not None:
        try:
            data = msgspec.toml.decode(Path(path).read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"config {path}: {exc}") from exc
    data.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(data.get("log_level"), str):
        data["log_level"] = data["log_level"].lower()  # DEBUG or debug
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        hint = ""
        unknown = re.search(r"unknown field `([^`]+)`", str(exc))
        if unknown:
            close = difflib.get_close_matches(unknown[1], Config.__struct_fields__, n=1)
            hint = f" (did you mean {close[0]}?)" if close else " (ringstream config lists every setting)"
        raise ValueError(f"config{f' {path}' if path else ''}: {exc}{hint}") from exc
    return config.check()

"""Prometheus metrics of the front, and their exporter on loopback.

Names follow Prometheus conventions: ``ringstream_`` prefix, base units
(``_seconds``, ``_bytes``), counters end in ``_total``. The front updates
them from its event loop; ``prometheus_client``'s exporter thread only reads.
:meth:`Metrics.snapshot` flattens every sample into a dict, which
``ringstream status --json`` carries, so both show the same figures.
"""

from __future__ import annotations

import math
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets for TTFT, E2E and queue time, seconds."""
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Histogram buckets for inter-token latency, seconds."""
EXPORTER_HOST = "127.0.0.1"
EXPOSITION_CACHE_S = 0.1
"""Seconds one rendering of the exposition answers ``Metrics`` messages (the gauges refresh every 0.25 s)."""
REPORTED_QUANTILES = (0.5, 0.99)
"""Quantiles of TTFT and ITL that ``ringstream status`` reports."""
PERCENT = 100
THROUGHPUT_WINDOW_S = 10
"""Seconds over which :attr:`Metrics.generation_tokens` keeps its recent rate (whole seconds)."""


class RecentRate:
    """Events per second over the last ``window_s`` seconds, counted in one-second buckets.

    The window spans the current (partial) second and the ``window_s - 1``
    whole seconds before it, or less while the meter is younger than that.
    Times are ``time.monotonic()`` seconds.
    """

    def __init__(self, window_s: int, now: float) -> None:
        self.window_s = window_s
        self.started = now
        self.buckets: deque[list[int]] = deque()
        """``[second, count]``, oldest first; only seconds still inside the window."""

    def add(self, count: int, now: float) -> None:
        second = int(now)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += count
        else:
            self.buckets.append([second, count])
            self._trim(second)

    def _trim(self, second: int) -> None:
        oldest = second - self.window_s + 1
        while self.buckets and self.buckets[0][0] < oldest:
            self.buckets.popleft()

    def window(self, now: float) -> float:
        """The seconds the rate at ``now`` is taken over."""
        return max(0.0, min(now - (int(now) - self.window_s + 1), now - self.started))

    def rate(self, now: float) -> float:
        """Events per second in the window ending at ``now`` (0 for an empty window)."""
        self._trim(int(now))
        span = self.window(now)
        return sum(count for _, count in self.buckets) / span if span > 0 else 0.0


class RatedCounter:
    """A Prometheus counter that also keeps its :class:`RecentRate` (``recent``)."""

    def __init__(self, counter: Counter, window_s: int) -> None:
        self.counter = counter
        self.recent = RecentRate(window_s, time.monotonic())

    def inc(self, amount: int = 1) -> None:
        self.counter.inc(amount)
        self.recent.add(amount, time.monotonic())


def histogram_quantile(histogram: Histogram, q: float) -> float | None:
    """The ``q``-quantile (0..1) of an unlabelled histogram's observations, or None before any.

    Estimated as Prometheus' ``histogram_quantile`` does: linear
    interpolation inside the bucket that holds the rank (from 0 for the
    first bucket); a rank in the ``+Inf`` bucket gives the highest finite
    bound.
    """
    samples = histogram.collect()[0].samples
    buckets = [(float(sample.labels["le"]), sample.value) for sample in samples if sample.name.endswith("_bucket")]
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, cumulative
    return lower


class Metrics:
    """Every metric the front exports, in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ringstream_requests", "Requests by final status (finish_reason or error code)",
                                ["status"], registry=r)
        self.running = Gauge("ringstream_requests_running", "Requests running on a worker", registry=r)
        self.waiting = Gauge("ringstream_requests_waiting", "Requests waiting, by priority", ["priority"], registry=r)
        self.ttft = Histogram("ringstream_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("ringstream_inter_token_latency_seconds", "Gap between ring reads that delivered tokens of a stream (tokens read together: one sample)",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("ringstream_e2e_request_latency_seconds", "Arrival to terminal message",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram("ringstream_queue_time_seconds", "Arrival to first dispatch to a worker",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("ringstream_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = RatedCounter(
            Counter("ringstream_generation_tokens", "Tokens generated and streamed", registry=r), THROUGHPUT_WINDOW_S)
        self.kv_cache_usage = Gauge("ringstream_kv_cache_usage_ratio",
                                    "KV-cache blocks held by requests / blocks in the pool (worker's report)",
                                    ["worker"], registry=r)
        self.kv_cache_blocks = Gauge("ringstream_kv_cache_blocks", "KV-cache blocks of the pool, total and free",
                                     ["worker", "state"], registry=r)
        self.prefix_cache_queries = Counter("ringstream_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", ["worker"], registry=r)
        self.prefix_cache_hits = Counter("ringstream_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache (KV reused, not recomputed)",
                                         ["worker"], registry=r)
        self.kv_cache_bytes = Gauge("ringstream_kv_cache_bytes", "KV-cache allocation", ["worker"], registry=r)
        self.ring_fill = Gauge("ringstream_ring_fill_ratio", "Unread bytes / ring capacity", ["worker"], registry=r)
        self.worker_up = Gauge("ringstream_worker_up", "1 if the worker is ready", ["worker", "device"], registry=r)
        self.worker_restarts = Counter("ringstream_worker_restarts", "Unexpected worker exits restarted",
                                       registry=r)
        self.preemptions = Counter("ringstream_preemptions",
                                   "Running requests preempted and resumed later, by cause: priority (a more "
                                   "urgent request waited) or kv_cache (the worker's KV blocks ran out)",
                                   ["worker", "cause"], registry=r)
        self.dropped = Counter("ringstream_dropped_messages", "Messages dropped or refused, by reason",
                               ["reason"], registry=r)
        self.admitted = Counter("ringstream_requests_admitted", "Requests admitted to the queue", registry=r)
        self.invalid = Counter("ringstream_invalid_requests", "Requests and frames refused as invalid", registry=r)
        self.internal_errors = Counter("ringstream_internal_errors",
                                       "Bugs met by one event and survived (each logged with its traceback)",
                                       registry=r)
        self.client_events = Counter("ringstream_client_events",
                                     "Client trouble: disconnected with requests open, stuck (not reading), "
                                     "send_blocked (a send met a full queue)", ["event"], registry=r)
        # What a gateway's endpoint picker reads (Gateway API Inference Extension model-server protocol),
        # unlabelled like vLLM's vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc.
        self.num_requests_waiting = Gauge("ringstream_num_requests_waiting",
                                          "Requests not yet computing: in the front's queue, or assigned to a "
                                          "worker whose engine has no batch slot or KV blocks for them yet",
                                          registry=r)
        self.num_requests_running = Gauge("ringstream_num_requests_running",
                                          "Requests a worker's engine is computing", registry=r)
        self.kv_cache_usage_perc = Gauge("ringstream_kv_cache_usage_perc",
                                         "KV-cache blocks held / blocks in the pools of all workers (0..1)",
                                         registry=r)
        # The same three under vLLM's names, the defaults of the inference gateway's endpoint picker and of
        # llm-d's scorers (docs/cluster.md), so that they read the daemon as a vLLM server with no flags.
        self.vllm_gauges = {name: Gauge(f"vllm:{name}", f"{help_text} (vLLM's name; the same as ringstream_{name})",
                                        registry=r)
                            for name, help_text in (("num_requests_waiting", "Requests not yet computing"),
                                                    ("num_requests_running", "Requests computing"),
                                                    ("kv_cache_usage_perc", "KV-cache usage, 0..1"))}
        self.vllm_gauges["gpu_cache_usage_perc"] = Gauge(  # its name before vLLM 0.10, older pickers' default
            "vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (vLLM's former name of vllm:kv_cache_usage_perc)",
            registry=r)
        self._server = None
        self._exposition: tuple[float, str] | None = None

    def exposition(self, now: float | None = None) -> str:
        """Every metric in Prometheus' text exposition format 0.0.4 (what ``/metrics`` serves).

        Rendering takes about 1.7 ms with one worker (2-core EPYC), on the front's loop; scrapes within
        :data:`EXPOSITION_CACHE_S` of a rendering share it, so a gateway scraping every 50 ms costs the
        front at most 1.7 ms per 100 ms. ``now``: ``time.monotonic()``.
        """
        now = time.monotonic() if now is None else now
        if self._exposition is None or now - self._exposition[0] >= EXPOSITION_CACHE_S:
            self._exposition = (now, generate_latest(self.registry).decode())
        return self._exposition[1]

    def latency_percentiles(self) -> dict[str, float | None]:
        """P50 and P99 of TTFT and ITL since the start, seconds (:func:`histogram_quantile`; None before any
        sample), keyed as ``StatusReply``'s fields: ``ttft_p50_s``, ``ttft_p99_s``, ``itl_p50_s``, ``itl_p99_s``."""
        return {f"{name}_p{round(q * PERCENT)}_s": histogram_quantile(histogram, q)
                for name, histogram in (("ttft", self.ttft), ("itl", self.itl)) for q in REPORTED_QUANTILES}

    def serve(self, port: int) -> None:
        """Start the HTTP exporter on 127.0.0.1:``port`` (a daemon thread). Raises OSError if the port is taken."""
        self._server, _ = start_http_server(port, addr=EXPORTER_HOST, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def total(self, name: str, **labels: str) -> int:
        """Sum of counter ``name`` (without ``_total``) over the samples whose labels include ``labels``."""
        found = 0.0
        for family in self.registry.collect():
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and labels.items() <= sample.labels.items():
                    found += sample.value
        return int(found)

    def counters(self) -> dict[str, int]:
        """The status reply's ``counters``, each read from its Prometheus counter (one source for both)."""
        return dict(
            requests_total=self.total("ringstream_requests_admitted"),
            tokens_generated_total=self.total("ringstream_generation_tokens"),
            dropped_frames_total=self.total("ringstream_dropped_messages", reason="frame_count")
            + self.total("ringstream_dropped_messages", reason="worker_event"),
            invalid_requests_total=self.total("ringstream_invalid_requests"),
            stale_records_total=self.total("ringstream_dropped_messages", reason="stale_record"),
            preemptions_total=self.total("ringstream_preemptions"),
            worker_restarts_total=self.total("ringstream_worker_restarts"),
            internal_errors_total=self.total("ringstream_internal_errors"),
            client_sends_blocked_total=self.total("ringstream_client_events", event="send_blocked"),
            clients_disconnected_total=self.total("ringstream_client_events", event="disconnected"),
            clients_stuck_total=self.total("ringstream_client_events", event="stuck"),
        )

    def snapshot(self) -> dict[str, float]:
        """Every current sample as ``{"name{label=value,...}": value}`` (histogram buckets omitted)."""
        out = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return out


def record_worker_load(metrics: Metrics, last, beat) -> None:
    """Add a worker's engine counters (preemptions for KV, prefix-cache queries and hits) as deltas.

    ``last`` and ``beat`` are its previous and new ``WorkerHeartbeat``; the
    engine's counters restart at 0 with a restarted worker, so a value below
    the last one counts from zero.
    """
    label = str(beat.worker)
    for name, counter in (("preemptions", metrics.preemptions.labels(label, "kv_cache")),
                          ("prefix_cache_queries", metrics.prefix_cache_queries.labels(label)),
                          ("prefix_cache_hits", metrics.prefix_cache_hits.labels(label))):
        value, previous = getattr(beat, name), getattr(last, name)
        delta = value - previous if value >= previous else value
        if delta:
            counter.inc(delta)

"""What ``ringstream status`` and the Prometheus gauges say of the front: built from the core and its workers.

Read-only views: nothing here changes a request or a worker.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from ringstream import __version__
from ringstream.daemon.front.core import FrontCore
from ringstream.daemon.front.request import DaemonState, Request, RequestStatus
from ringstream.daemon.common.settings import LIVE_SETTINGS
from ringstream.ipc import protocol as P

__all__ = ["build_status", "decode_rate", "kv_cache_usage", "pool_kv_usage", "request_info", "update_gauges"]


class WorkerView(Protocol):
    """What the status needs of a worker process (``worker_pool.WorkerProcess``)."""

    index: int
    device: str
    pid: int
    alive: bool
    phase: str
    phase_since: float

    def ring_fill(self) -> float: ...


def kv_cache_usage(load: P.WorkerHeartbeat) -> float:
    """Blocks held by requests / blocks in the pool, from a worker's last report (0 before any)."""
    if not load.kv_blocks_total:
        return 0.0
    return 1.0 - load.kv_blocks_free / load.kv_blocks_total


def pool_kv_usage(loads: Sequence[P.WorkerHeartbeat]) -> float:
    """Blocks held / blocks in the pools of all workers, from their last reports (0 before any): the share of
    the daemon's KV capacity in use (each worker's pool weighs by its size)."""
    total = sum(load.kv_blocks_total for load in loads)
    return 1.0 - sum(load.kv_blocks_free for load in loads) / total if total else 0.0


def decode_rate(req: Request, now: float) -> float:
    """Tokens per second a streaming request produced after its first token, up to ``now`` (0 before its second)."""
    if not req.first_token or req.num_output_tokens < 2 or now <= req.first_token:
        return 0.0
    return (req.num_output_tokens - 1) / (now - req.first_token)


def request_info(req: Request, now: float) -> P.RequestInfo:
    """An open request as ``StatusReply.requests`` lists it."""
    on_worker = req.worker if req.worker is not None else (
        req.last_worker if req.status in (RequestStatus.PREEMPTING, RequestStatus.ABORTING) else None)
    return P.RequestInfo(
        id=req.id, priority=req.priority, state=req.status.name.lower(), worker=on_worker,
        prompt_tokens=req.num_prompt_tokens, completion_tokens=req.num_output_tokens, max_tokens=req.max_tokens,
        age_s=now - req.arrival, ttft_s=(req.first_token - req.arrival) if req.first_token else None,
    )


def build_status(core: FrontCore, workers: Sequence[WorkerView], model: str,
                 notes: Sequence[str] = ()) -> P.StatusReply:
    """Live figures, as sent to ``ringstream status`` (and after ``admin set``, with its ``notes``)."""
    metrics, scheduler = core.metrics, core.scheduler
    counters = metrics.counters()
    now = core.clock()
    open_requests = list(core.by_handle.values())
    rates = [0.0] * len(workers)
    for req in open_requests:
        if req.status == RequestStatus.RUNNING and req.worker is not None:
            rates[req.worker] += decode_rate(req, now)
    oldest = sorted(open_requests, key=lambda req: req.arrival)[:P.MAX_STATUS_REQUESTS]
    generated = metrics.generation_tokens.recent
    worker_status = [
        P.WorkerStatus(
            index=w.index, device=w.device, pid=w.pid, alive=w.alive, running=b.running,
            max_num_seqs=b.capacity.max_num_seqs, max_model_len=b.capacity.max_model_len,
            kv_cache_tokens=b.capacity.kv_cache_tokens,
            kv_cache_tokens_used=b.kv_tokens_used, ring_fill=w.ring_fill(), requests_served=b.served,
            block_size=b.capacity.block_size, kv_blocks_total=load.kv_blocks_total, kv_blocks_free=load.kv_blocks_free,
            kv_cache_usage=kv_cache_usage(load), preemptions_kv_cache=load.preemptions,
            preemptions_priority=b.preemptions,
            prefix_cache_queries=load.prefix_cache_queries, prefix_cache_hits=load.prefix_cache_hits,
            waiting=load.waiting, tokens_per_s=rate, phase=w.phase, phase_s=max(0.0, time.monotonic() - w.phase_since),
        )
        for w, b, load, rate in zip(workers, scheduler.workers, core.worker_loads, rates)
    ]
    config = core.config
    return P.StatusReply(
        version=__version__, ready=core.state == DaemonState.SERVING, state=core.state.value,
        uptime_s=now - core.started, waiting=scheduler.num_waiting,
        running=scheduler.num_running, queue_size=scheduler.policy.queue_size,
        max_concurrency=scheduler.policy.max_concurrency,
        requests_total=counters["requests_total"],
        tokens_generated_total=counters["tokens_generated_total"], workers=worker_status,
        settings={name: getattr(config, name) for name in LIVE_SETTINGS if getattr(config, name) is not None},
        counters=counters, metrics=metrics.snapshot(), notes=list(notes), model=model,
        tokens_per_s=generated.rate(now), tokens_per_s_window_s=generated.window(now),
        **metrics.latency_percentiles(),
        requests_open=len(open_requests), requests=[request_info(req, now) for req in oldest],
        accepts_messages=True,
    )


def update_gauges(core: FrontCore, workers: Sequence[WorkerView]) -> None:
    """Refresh the Prometheus gauges (housekeeping, every ``HOUSEKEEPING_S``)."""
    m, scheduler = core.metrics, core.scheduler
    m.running.set(scheduler.num_running)
    m.waiting.clear()
    for priority, count in scheduler.waiting_by_priority().items():
        m.waiting.labels(str(priority)).set(count)
    engine_waiting = sum(load.waiting for load in core.worker_loads)
    figures = {"num_requests_waiting": scheduler.num_waiting + engine_waiting,
               "num_requests_running": max(0, scheduler.num_running - engine_waiting),
               "kv_cache_usage_perc": pool_kv_usage(core.worker_loads)}
    for name, value in figures.items():
        getattr(m, name).set(value)
        m.vllm_gauges[name].set(value)
    m.vllm_gauges["gpu_cache_usage_perc"].set(figures["kv_cache_usage_perc"])
    for worker, budget, load in zip(workers, scheduler.workers, core.worker_loads):
        label = str(worker.index)
        m.kv_cache_usage.labels(label).set(kv_cache_usage(load))
        m.kv_cache_blocks.labels(label, "total").set(load.kv_blocks_total)
        m.kv_cache_blocks.labels(label, "free").set(load.kv_blocks_free)
        m.kv_cache_bytes.labels(label).set(budget.capacity.kv_cache_bytes)
        m.ring_fill.labels(label).set(worker.ring_fill())
        m.worker_up.labels(label, worker.device).set(1 if budget.ready and worker.alive else 0)

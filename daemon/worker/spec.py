"""What the front hands a worker process: its spec, and the spawn target that imports the worker's loop only in
the child (so the front, which builds the spec, never loads the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from ringstream.daemon.common.engine_config import EngineConfig

__all__ = ["KVEventsSpec", "WorkerSpec", "run_worker"]


@dataclass(frozen=True, slots=True)
class KVEventsSpec:
    """One worker's KV-cache events settings (:mod:`ringstream.daemon.worker.kv_events`), resolved by the front:
    this worker's own endpoints (the configured ports + its index) and its rank (its index)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    rank: int
    block_size: int


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs; pickled to the spawned process."""

    index: int
    model_path: str
    engine: EngineConfig
    """The engine's settings, whole (device, dtype and threads resolved for this worker)."""
    command_address: str
    event_address: str
    ring_name: str
    ring_instance_id: int
    heartbeat_s: float
    parent_pid: int
    log_level: str
    kv_events: KVEventsSpec | None = None
    """Publish the prefix cache's events; None = off."""


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of the spawned worker process (:func:`ringstream.daemon.worker.loop.worker_main`)."""
    from ringstream.daemon.worker.loop import worker_main

    worker_main(spec)

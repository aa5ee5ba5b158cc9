"""The worker processes and the resources the front owns for them; their start, restart and stop.

The front owns, and is the only one to release: each worker's ring (created
here, unlinked at stop), each worker's command socket, and the instance lock
that keeps two daemons of one instance from stealing each other's socket.
Workers are started with the ``spawn`` method (CUDA and ZeroMQ are not
fork-safe), watched through their process sentinels and heartbeats,
restarted with backoff after an unexpected exit, and stopped with a
deadline: ``Shutdown`` message, join, SIGTERM, join, SIGKILL.
:class:`WorkerPool` does all of that on the front's event loop; what a
worker's exit means for its requests is the core's business. :class:`HttpChild`
does the same for the HTTP API child (``serve --http``) with the same backoff and deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import resource
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import zmq

from ringstream.daemon.common.config import Config
from ringstream.daemon.common.supervision import (
    EXIT_REAP_S, RESTART_WINDOW_S, StartupError, backoff, join_with_deadlines,
)
from ringstream.daemon.common.listen import check_endpoints_free, offset_endpoint
from ringstream.daemon.worker.spec import KVEventsSpec, WorkerSpec, run_worker
from ringstream.ipc import protocol as P
from ringstream.ipc.address import bind_private
from ringstream.ipc.ring import Record, RingConsumer

log = logging.getLogger("ringstream.workers")

FRONT_OWN_FILES = 64
"""Open files the front needs besides client connections and workers (ZeroMQ mailboxes and
I/O threads, epoll, the lock, the log, the metrics exporter), with room to spare."""
FILES_PER_WORKER = 8
"""Open files the front holds per worker: command socket and its connection, event connection,
ring, process sentinel and pipes."""


def open_files_needed(max_clients: int, num_workers: int) -> int:
    """Open files the front needs to serve ``max_clients`` connections with ``num_workers`` workers."""
    return max_clients + FRONT_OWN_FILES + FILES_PER_WORKER * num_workers


def ensure_open_files(needed: int) -> tuple[int, int | None]:
    """Make RLIMIT_NOFILE's soft limit at least ``needed``, raising it up to the hard limit if it is lower.

    Returns ``(soft limit now, previous soft limit if it was raised else None)``.
    Raises StartupError naming both limits when the hard limit is below ``needed``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft, None
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise StartupError(
            f"open-file limit too low: {needed} files needed for max_clients plus the daemon's own, "
            f"hard limit (RLIMIT_NOFILE) is {hard}: raise it (ulimit -Hn, LimitNOFILE= in the unit) "
            f"or lower max_clients"
        )
    target = needed if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        raise StartupError(f"cannot raise the open-file limit from {soft} to {target}: {exc}") from exc
    return target, soft


@dataclass
class WorkerProcess:
    """One worker as the front holds it."""

    index: int
    device: str
    spec: WorkerSpec
    ring: RingConsumer
    commands: zmq.Socket
    process: multiprocessing.process.BaseProcess | None = None
    pid: int = 0
    alive: bool = False
    last_heartbeat: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    """What it is doing (``P.WORKER_PHASES``), from its spawn, its start messages and its exit."""
    phase_since: float = field(default_factory=time.monotonic)
    """Monotonic time it entered ``phase``."""
    failures: list[float] = field(default_factory=list)
    """Monotonic times of recent unexpected exits (restart backoff)."""

    def send(self, command) -> bool:
        """Queue a command for the worker; never blocks (the command socket has no HWM).

        Returns False when no worker process is connected (it died or never
        started); the caller's recovery (requeue on exit) covers the lost command.
        """
        try:
            self.commands.send(P.encode(command), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("worker %d not connected; %s dropped", self.index, type(command).__name__)
            return False
        return True

    def enter(self, phase: str) -> None:
        """Note that the worker is now in ``phase`` (one of ``P.WORKER_PHASES``)."""
        self.phase, self.phase_since = phase, time.monotonic()

    def ring_fill(self) -> float:
        """Unread bytes of its ring / the ring's capacity."""
        return self.ring.fill()

    def read_ring(self) -> Iterator[list[Record]]:
        """Every record its worker published, in batches; between two batches the read space is freed.

        The consumer of a batch must be done with it before asking for the
        next (record payloads are views of the ring). The doorbell is disarmed
        while reading and re-armed at the end, with a last read after arming
        so that no record published meanwhile waits for a doorbell that
        never rings.
        """
        ring = self.ring
        ring.disarm()
        while True:
            records = ring.read()
            yield records
            if ring.commit():
                self.send(P.RingSpace())
            if not records and ring.arm():
                return


def ring_name(instance: str, index: int) -> str:
    """/dev/shm name of worker ``index``'s ring."""
    return f"ringstream-{instance}-w{index}"


def ring_mode(socket_mode: int) -> int:
    """Ring file mode: owner read-write; group read-only when the socket is open to the group.

    Only the front and its workers write rings; the group may observe them
    (``ringstream-top``) but never gets write access, whatever ``socket_mode`` says.
    """
    return 0o600 | (0o040 if socket_mode & 0o060 else 0)


def worker_threads(config: Config, devices: list[str]) -> int:
    """torch threads per CPU worker: configured, or the cores shared among CPU workers."""
    if config.worker_threads:
        return config.worker_threads
    cpu_workers = max(1, sum(1 for d in devices if d == "cpu"))
    return max(1, (os.cpu_count() or 1) // cpu_workers)


def worker_dtype(config: Config, device: str) -> str:
    """The dtype a worker on ``device`` loads the model in: ``config.dtype``; ``auto`` is float32 on CPU (where
    greedy output equals ``generate()``) and bfloat16 on an accelerator."""
    if config.dtype != "auto":
        return config.dtype
    return "float32" if device == "cpu" else "bfloat16"


def create_workers(
    config: Config, devices: list[str], model_path: str, ctx: zmq.Context, rundir: Path, event_address: str
) -> list[WorkerProcess]:
    """Create each worker's ring and command socket (not yet its process).

    Raises StartupError if a ring cannot be created; already-created rings are unlinked.
    """
    workers: list[WorkerProcess] = []
    threads = worker_threads(config, devices)
    try:
        for index, device in enumerate(devices):
            name = ring_name(config.instance, index)
            ring = RingConsumer.create(name, config.ring_bytes, mode=ring_mode(config.socket_mode),
                                       instance_id=secrets.randbits(63))
            commands = zmq.Socket(ctx, zmq.PUSH)  # a plain socket, also on an asyncio context
            commands.setsockopt(zmq.SNDHWM, 0)
            commands.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{rundir / f'{config.instance}.w{index}.cmd'}"
            bind_private(commands, address)
            spec = WorkerSpec(
                index=index, model_path=model_path,
                engine=config.engine_config(device, worker_dtype(config, device), threads),
                command_address=address, event_address=event_address,
                ring_name=name, ring_instance_id=ring.instance_id,
                heartbeat_s=config.worker_heartbeat_s, parent_pid=os.getpid(), log_level=config.log_level,
                kv_events=kv_events_spec(config, index),
            )
            workers.append(WorkerProcess(index, device, spec, ring, commands))
        check_endpoints_free([endpoint for w in workers if w.spec.kv_events is not None
                              for endpoint in (w.spec.kv_events.endpoint, w.spec.kv_events.replay_endpoint)
                              if endpoint is not None])
    except Exception as exc:
        release_workers(workers)
        raise StartupError(f"cannot create worker resources: {exc}") from exc
    return workers


def kv_events_spec(config: Config, index: int) -> KVEventsSpec | None:
    """Worker ``index``'s KV events endpoints (the configured ones offset by ``index``), None when off."""
    if config.kv_events_endpoint is None:
        return None
    replay = config.kv_events_replay_endpoint
    return KVEventsSpec(endpoint=offset_endpoint(config.kv_events_endpoint, index),
                        replay_endpoint=None if replay is None else offset_endpoint(replay, index),
                        topic=config.kv_events_topic, rank=index, block_size=config.block_size)


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""When ``1``, PyTorch's CPU allocator asks for transparent huge pages for blocks of 2 MiB and more
(``c10/core/alloc_cpu.cpp``; read once, at the first allocation). A CPU worker reads its weights and
the KV cache of every running sequence at each step; with 4 KiB pages that is thousands of TLB misses
per step. Measured with ``THP_MEM_ALLOC_ENABLE=0|1 python -m ringstream.tools.bench_engine --threads 2 --dtype
bfloat16`` on a 2-core AMD EPYC (THP in ``madvise`` mode): engine 5.8k -> 7.3k tokens/s. Workers get
``1`` unless the daemon's environment sets it (``0`` turns it off)."""


def spawn(worker: WorkerProcess) -> None:
    """Start the worker's process (spawn method)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")  # inherited by the spawned interpreter, before torch loads
    ctx = multiprocessing.get_context("spawn")
    worker.process = ctx.Process(target=run_worker, args=(worker.spec,), name=f"ringstream-worker-{worker.index}")
    worker.process.start()
    worker.pid = worker.process.pid
    worker.alive = True
    worker.last_heartbeat = time.monotonic()
    worker.enter("starting")


def stop_process(worker: WorkerProcess) -> None:
    """Join a worker told to shut down; SIGTERM, then SIGKILL past each deadline. Blocking."""
    if worker.process is None:
        return
    join_with_deadlines(worker.process, f"worker {worker.index}")
    worker.process = None
    worker.alive = False


def release_workers(workers: list[WorkerProcess]) -> None:
    """Close command sockets, unlink rings. Call after every process is stopped."""
    for worker in workers:
        worker.commands.close(linger=0)
        with contextlib.suppress(FileNotFoundError):  # libzmq leaves the socket file behind
            os.unlink(worker.spec.command_address[len("ipc://"):])
        worker.ring.close()
        worker.ring.unlink()


class WorkerPool:
    """Every worker of the daemon: created, spawned, watched, restarted and stopped on the running loop.

    ``on_exit(worker)`` is called (on the loop) when a worker process ends,
    after it is reaped; the pool restarts it only when told to
    (:meth:`restart_later`).
    """

    def __init__(self, workers: list[WorkerProcess], on_exit: Callable[[WorkerProcess], None],
                 on_restart: Callable[[], None] | None = None) -> None:
        self.workers = workers
        self.on_exit = on_exit
        self.on_restart = on_restart or (lambda: None)
        """Counted once per restart scheduled (the front's ``worker_restarts`` metric)."""
        self._watched: set[int] = set()

    def __iter__(self) -> Iterator[WorkerProcess]:
        return iter(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, index: int) -> WorkerProcess:
        return self.workers[index]

    def start(self) -> None:
        """Arm every ring's doorbell and spawn every worker."""
        for worker in self.workers:
            worker.ring.arm()
            self._spawn(worker)

    def _spawn(self, worker: WorkerProcess) -> None:
        spawn(worker)
        asyncio.get_running_loop().add_reader(worker.process.sentinel, self._exited, worker)
        self._watched.add(worker.index)

    def _unwatch(self, worker: WorkerProcess) -> None:
        if worker.index in self._watched and worker.process is not None:
            asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        self._watched.discard(worker.index)

    def _exited(self, worker: WorkerProcess) -> None:
        self._unwatch(worker)
        worker.alive = False
        worker.enter("exited")
        worker.process.join(EXIT_REAP_S)  # the sentinel fired: reaping is immediate, and sets exitcode
        code = worker.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        log.error("worker %d (pid %d) exited: %s", worker.index, worker.pid, how)
        self.on_exit(worker)

    def restart_later(self, worker: WorkerProcess, still_wanted: Callable[[], bool]) -> float:
        """Restart ``worker`` after ``RESTART_BACKOFF_S * 2**(recent failures)`` seconds, capped, if
        ``still_wanted()`` then. Returns the delay, seconds."""
        worker.failures, delay = backoff(worker.failures, time.monotonic())
        self.on_restart()
        log.warning("restarting worker %d in %.1f s (%d failure(s) in %.0f s)",
                    worker.index, delay, len(worker.failures), RESTART_WINDOW_S)
        asyncio.get_running_loop().call_later(delay, self._restart, worker, still_wanted)
        return delay

    def _restart(self, worker: WorkerProcess, still_wanted: Callable[[], bool]) -> None:
        if not still_wanted() or worker.alive:
            return
        worker.process.close()
        self._spawn(worker)  # same ring and command socket; the new producer continues at write_pos
        worker.ring.arm()

    def kill_unresponsive(self, now: float, ready: list[bool], serving: bool,
                          stall_timeout_s: float, start_timeout_s: float) -> list[int]:
        """Kill live workers silent too long: ready ones past ``stall_timeout_s`` without a heartbeat, and
        (while ``serving``) restarted ones not ready after ``start_timeout_s``. Their sentinels then run
        the usual exit path. Returns the indexes killed."""
        killed = []
        for worker, is_ready in zip(self.workers, ready):
            silent_s = now - worker.last_heartbeat  # since its spawn, for a worker still starting
            if not worker.alive:
                continue
            if is_ready and silent_s > stall_timeout_s:
                log.error("worker %d sent no heartbeat for %.0f s; killing it", worker.index, silent_s)
            elif not is_ready and serving and silent_s > start_timeout_s:
                log.error("restarted worker %d not ready after %.0f s; killing it", worker.index, silent_s)
            else:
                continue
            worker.process.kill()
            killed.append(worker.index)
        return killed

    async def stop(self) -> None:
        """Tell every live worker to shut down, join each with deadlines, release rings and sockets."""
        for worker in self.workers:
            self._unwatch(worker)
        try:
            for worker in self.workers:
                if worker.process is not None and worker.process.is_alive() and not worker.send(P.Shutdown()):
                    worker.process.terminate()  # not connected yet (starting): SIGTERM instead of a wasted grace
            await asyncio.gather(*(asyncio.to_thread(stop_process, w) for w in self.workers))
        finally:
            release_workers(self.workers)

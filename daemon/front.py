"""The front process: client socket, request lifecycle, ring reading.

One asyncio loop (uvloop) owns everything here:

* a ZeroMQ ROUTER socket for clients (``ROUTER_MANDATORY``: a send to a gone
  peer raises instead of vanishing; a send at the high-water mark raises
  EAGAIN and the chunk stays pending, coalesced with later tokens, and is
  retried: nothing is dropped silently), optionally CURVE-encrypted with an
  allow-list of client keys (ZAP handler on this loop);
* a monitor of that socket's connections: a client whose connection closes
  has its requests cancelled at once, so an identity that connects again
  never receives chunks of its previous connection's requests. A second
  connection that claims an identity already connected is refused by
  ZeroMQ (``ROUTER_HANDOVER`` stays off: a newcomer cannot take over, and
  read, another connection's streams);
* a PULL socket on which workers report readiness, heartbeats and doorbells;
  both sockets are plain ZeroMQ sockets read by :class:`ringstream.ipc.aio.SocketPump`
  (drained on their file descriptor's wake-up, no future per message) and
  written with non-blocking sends;
* the rings: on a doorbell the front reads every published record, turns them
  into one ``Chunk`` per request (tokens that arrived together travel
  together), frees the ring space, then re-arms the doorbell.

Lifecycle of a request: accept (decode, validate, tokenise) -> waiting ->
running on a worker -> streamed -> exactly one terminal message (a ``Chunk``
with ``finish_reason``, or an ``Error``). The front never blocks on a worker
and never polls: it sleeps until a socket, a sentinel or a timer wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import itertools
import logging
import os
import signal
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import msgspec
import zmq
import zmq.asyncio

from ringstream.daemon import __version__
from ringstream.daemon.clients import ClientState, ClientTable
from ringstream.daemon.config import Config, load_config, parse_devices, runtime_dir
from ringstream.daemon.metrics import Metrics
from ringstream.daemon.model import ModelInfo, load_tokenizer, resolve_model_dir
from ringstream.daemon.notify import Notifier, WatchdogGate
from ringstream.daemon.request import DaemonState, Request, RequestStatus
from ringstream.daemon.scheduler import Scheduler, SchedulerPolicy, WorkerBudget
from ringstream.daemon.settings import LIVE_SETTINGS, change_settings, reload_changes
from ringstream.daemon.supervisor import (
    JOIN_GRACE_S, InstanceLock, StartupError, WorkerProcess, create_workers, ensure_open_files, open_files_needed,
    release_workers, spawn, stop_process,
)
from ringstream.daemon.validate import RequestRejected, Validator
from ringstream.ipc import protocol as P
from ringstream.ipc.address import unix_socket_listening
from ringstream.ipc.aio import SocketPump
from ringstream.ipc.ring import KIND_ERROR, KIND_FINISH, KIND_TOKEN

log = logging.getLogger("ringstream.front")

HOUSEKEEPING_S = 0.25
"""Period of the timer that checks client timeouts and worker start deadlines."""
RETRY_SEND_S = 0.002
"""Delay before retrying chunks that met a full client queue (EAGAIN)."""
CLIENT_SNDHWM = 1000
"""Per-client queued messages before sends raise EAGAIN (then chunks coalesce): bounds what a client that
stops reading costs the front to about this many chunks, whatever its streams produce meanwhile."""
EXIT_REAP_S = 1.0
"""Longest wait to reap a worker whose sentinel reported its exit."""
MAX_RESUMES = 3
"""A request whose worker died this many times ends with WORKER_FAILED instead of resuming again."""
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
RESTART_WINDOW_S = 300.0
"""Worker restarts wait RESTART_BACKOFF_S doubled per failure in the last RESTART_WINDOW_S, at most the max."""
ABORT_GRACE_S = 2.0
"""At shutdown, how long aborted streams get to be confirmed by their worker."""
TIMEOUT_MARGIN_S = 10.0
"""Slack added to the start/stop times announced to systemd (EXTEND_TIMEOUT_USEC)."""
INLINE_TOKENIZE_CHARS = 4096
"""Prompts up to this many characters are tokenised on the event loop (about 10 ms at worst); longer ones on
the tokenizer thread, so that no single frame can stall every other client."""
MAX_TOKENIZING = 64
"""Long prompts waiting for the tokenizer thread at most; more get QUEUE_FULL."""
MAX_UNKNOWN_ANSWERS = 64
"""Unknown ids one Heartbeat gets UNKNOWN_REQUEST answers for, at most: a client names its open ids in every
heartbeat, so the rest are answered by the next ones, and no single frame makes the front send thousands."""
MONITOR_ADDRESS = "inproc://ringstream-client-connections"
"""Where the client socket's monitor (connection accepted / closed events) publishes."""
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
MONITOR_EVENT = struct.Struct("=HI")
"""First frame of a ZeroMQ monitor message: event id (u16), value (u32, the connection's fd here)."""


def policy_of(config: Config) -> SchedulerPolicy:
    """The scheduler settings a config asks for."""
    return SchedulerPolicy(
        queue_size=config.queue_size, max_concurrency=config.max_concurrency,
        priority_limits=config.priority_limits(), aging_rate=config.aging_rate,
        full_policy=config.queue_full_policy, preemption=config.preemption,
    )


def kv_cache_usage(load: P.WorkerHeartbeat) -> float:
    """Blocks held by requests / blocks in the pool, from a worker's last report (0 before any)."""
    if not load.kv_blocks_total:
        return 0.0
    return 1.0 - load.kv_blocks_free / load.kv_blocks_total


class Front:
    """The daemon's front process; ``await Front(config).run()`` serves until a stop signal."""

    def __init__(self, config: Config, config_path: str | None = None, overrides: dict | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides or {}
        """Command-line values, which win over the file at every reload too."""
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        self.stop_event = asyncio.Event()
        """Set by a stop signal (or a start failure): the drain begins."""
        self.stopped_event = asyncio.Event()
        """Set when the drain reached FLUSHING's end: teardown follows."""
        self.shutdown_timer: asyncio.TimerHandle | None = None
        self.aborted_at_shutdown: list[Request] = []
        self.exit_code = 0
        self.ctx = zmq.asyncio.Context()
        self.clients = ClientTable()
        self.by_handle: dict[int, Request] = {}
        self.handles = itertools.count(1)
        self.scheduler = Scheduler(policy_of(config))
        self.blocked: dict[int, Request] = {}
        self.retry_scheduled = False
        self.workers: list[WorkerProcess] = []
        self.model: ModelInfo | None = None
        self.validator: Validator | None = None
        self.lock: InstanceLock | None = None
        self.router: zmq.Socket | None = None
        self.events: zmq.Socket | None = None
        self.client_pump: SocketPump | None = None
        self.event_pump: SocketPump | None = None
        self.monitor: zmq.Socket | None = None
        self.authenticator = None
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringstream-tokenize")
        self.tokenizing = 0
        """Long prompts handed to the tokenizer thread and not yet back."""
        self.metrics = Metrics()
        self.notifier = Notifier()
        self.owned_paths: list[str] = []
        """ipc socket files this daemon bound, removed at stop."""
        self.watchdog_gate = WatchdogGate(self.notifier)
        self.housekeeping_tick = time.monotonic()

    # ------------------------------------------------------------ start / stop

    async def run(self) -> int:
        """Start workers, serve until SIGTERM/SIGINT, drain, stop. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        tasks = []
        try:
            self._setup()
            # Modules, model metadata and tokenizer live as long as the process: keep them out of the
            # collector's full passes, which would otherwise stall the loop for tens of ms each.
            gc.freeze()
            self.notifier.status(f"starting: loading the model on {len(self.workers)} worker(s)")
            self.notifier.extend_timeout(self.config.worker_start_timeout_s + TIMEOUT_MARGIN_S)
            self.client_pump = SocketPump(self.router, self._on_client_message, multipart=True)
            self.event_pump = SocketPump(self.events, self._on_event)
            self.client_pump.start()
            self.event_pump.start()
            coros = [self._housekeeping()]
            if self.notifier.watchdog_interval_s is not None:
                coros.append(self._watchdog())
            tasks = [asyncio.create_task(coro) for coro in coros]
            await self.stop_event.wait()
            self._begin_drain()
            await self.stopped_event.wait()
        except StartupError as exc:
            log.error("start failed: %s", exc)
            self.notifier.status(f"start failed: {exc}")
            self.exit_code = 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._teardown()
        return self.exit_code

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin a graceful stop (signal handlers call this; it only sets state)."""
        if not self.stop_event.is_set():
            log.info("stopping: draining running streams (up to %.0f s)", self.config.drain_timeout_s)
            self.exit_code = self.exit_code or exit_code
            self.notifier.stopping(status=f"draining (up to {self.config.drain_timeout_s:.0f} s)")
            self.notifier.extend_timeout(
                self.config.drain_timeout_s + 2 * ABORT_GRACE_S + 2 * JOIN_GRACE_S + TIMEOUT_MARGIN_S)
            self.stop_event.set()

    def _setup(self) -> None:
        config = self.config
        rundir = runtime_dir()
        rundir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock = InstanceLock(rundir / f"{config.instance}.lock")
        try:
            self.model = resolve_model_dir(config.model)
            if config.max_model_len is not None:
                if config.max_model_len > self.model.max_model_len:
                    raise ValueError(f"max_model_len = {config.max_model_len} exceeds the model's context of "
                                     f"{self.model.max_model_len} tokens")
                self.model = replace(self.model, max_model_len=config.max_model_len)
            self.validator = Validator(load_tokenizer(self.model), self.model)
        except Exception as exc:
            raise StartupError(str(exc)) from exc
        devices = parse_devices(config.devices)
        soft, raised_from = ensure_open_files(open_files_needed(config.max_clients, len(devices)))
        if raised_from is not None:
            log.info("raised the open-file limit from %d to %d (max_clients = %d)",
                     raised_from, soft, config.max_clients)
        if config.metrics_port is not None:
            try:
                self.metrics.serve(config.metrics_port)
            except OSError as exc:
                raise StartupError(f"metrics port {config.metrics_port}: {exc}") from exc
        self.events = zmq.Socket(self.ctx, zmq.PULL)  # plain sockets, read by SocketPumps (ipc.aio)
        event_address = f"ipc://{rundir / f'{config.instance}.events'}"
        self.events.bind(event_address)
        self.owned_paths.append(event_address[len("ipc://"):])
        self.workers = create_workers(config, devices, str(self.model.path), self.ctx, rundir, event_address)
        self.scheduler.workers = [WorkerBudget(w.index) for w in self.workers]
        self.worker_loads = [P.WorkerHeartbeat(worker=w.index, running=0, waiting=0, steps=0) for w in self.workers]
        self.router = zmq.Socket(self.ctx, zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.router.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        self.router.setsockopt(zmq.LINGER, 0)
        if config.curve_secret_key_file is not None:
            self._setup_curve()
        loop = asyncio.get_running_loop()
        self.router.monitor(MONITOR_ADDRESS, CONNECTION_EVENTS)
        self.monitor = zmq.Socket(self.ctx, zmq.PAIR)  # a plain socket: drained synchronously, see _poll_connections
        self.monitor.connect(MONITOR_ADDRESS)
        loop.add_reader(self.monitor.getsockopt(zmq.FD), self._poll_connections)
        address = config.address()
        if address.startswith("ipc://"):
            path = address[len("ipc://"):]
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            refuse_live_socket(path)
            umask = os.umask(0o777 & ~config.socket_mode)  # the socket file never exists with a wider mode
            try:
                self.router.bind(address)
            finally:
                os.umask(umask)
            self.owned_paths.append(path)
            os.chmod(path, config.socket_mode)
        else:
            self.router.bind(address)
        for worker in self.workers:
            worker.ring.arm()
            spawn(worker)
            loop.add_reader(worker.process.sentinel, self._on_worker_exit, worker)
        log.info("listening on %s; model %s; %d worker(s) on %s", address, self.model.path, len(devices), ",".join(devices))

    def _setup_curve(self) -> None:
        """CURVE on the client socket: the server's key pair, and a ZAP handler allowing the listed client keys.

        Raises StartupError for an unreadable certificate or allow-list directory.
        """
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        config = self.config
        try:
            public, secret = zmq.auth.load_certificate(config.curve_secret_key_file)
        except (OSError, ValueError) as exc:
            raise StartupError(f"curve_secret_key_file {config.curve_secret_key_file}: {exc}") from exc
        if not secret:
            raise StartupError(f"curve_secret_key_file {config.curve_secret_key_file}: holds no secret key")
        if not os.path.isdir(config.curve_allowed_clients_dir):
            raise StartupError(f"curve_allowed_clients_dir {config.curve_allowed_clients_dir}: not a directory")
        self.authenticator = AsyncioAuthenticator(self.ctx, log=logging.getLogger("ringstream.auth"))
        self.authenticator.start()
        self._load_allowed_clients()
        self.router.curve_secretkey = secret
        self.router.curve_publickey = public
        self.router.curve_server = True

    def _load_allowed_clients(self) -> None:
        """(Re)read the public keys (``*.key`` certificates) that may connect over CURVE."""
        directory = self.config.curve_allowed_clients_dir
        self.authenticator.configure_curve(domain="*", location=directory)
        allowed = self.authenticator.certs.get("*", {})
        if not allowed:
            log.warning("curve_allowed_clients_dir %s lists no client key: no client can connect", directory)
        else:
            log.info("CURVE: %d client key(s) allowed from %s", len(allowed), directory)

    # Shutdown: DRAINING -> ABORTING -> FLUSHING -> STOPPED, advanced by _advance_shutdown whenever a request
    # ends or is delivered, and by deadline timers; nothing polls.

    def _begin_drain(self) -> None:
        """Graceful stop: refuse new work, end the waiting, let running streams finish (up to ``drain_timeout_s``)."""
        self.state = DaemonState.DRAINING
        for req in self.scheduler.waiting():
            self.scheduler.remove(req)
            self._end(req, P.Error(id=req.id, code=P.ErrorCode.SHUTTING_DOWN, message="daemon is shutting down"))
        self.shutdown_timer = asyncio.get_running_loop().call_later(self.config.drain_timeout_s, self._begin_abort)
        self._advance_shutdown()

    def _begin_abort(self) -> None:
        """Drain over (nothing left, or its deadline): abort what still runs; their workers get ABORT_GRACE_S."""
        self._cancel_shutdown_timer()
        self.state = DaemonState.ABORTING
        self.aborted_at_shutdown = [r for r in self.by_handle.values()
                                    if r.worker is not None or r.status == RequestStatus.PREEMPTING]
        for req in self.aborted_at_shutdown:
            self._abort(req, P.FinishReason.SHUTDOWN)
        self.shutdown_timer = asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._begin_flush)
        self._advance_shutdown()

    def _begin_flush(self) -> None:
        """Aborts confirmed (or their grace is over): end the rest; deliver terminal messages for ABORT_GRACE_S."""
        self._cancel_shutdown_timer()
        self.state = DaemonState.FLUSHING
        for req in self.aborted_at_shutdown:
            if not req.status.is_finished:
                self._finish(req, P.FinishReason.SHUTDOWN)
        self.aborted_at_shutdown = []
        self.shutdown_timer = asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._stopped)
        self._advance_shutdown()

    def _stopped(self) -> None:
        self._cancel_shutdown_timer()
        self.state = DaemonState.STOPPED
        self.stopped_event.set()

    def _cancel_shutdown_timer(self) -> None:
        if self.shutdown_timer is not None:
            self.shutdown_timer.cancel()
            self.shutdown_timer = None

    def _advance_shutdown(self) -> None:
        """Move the shutdown on when its phase's work is done (called after anything ends or is delivered)."""
        match self.state:
            case DaemonState.DRAINING if not self.by_handle and not self.tokenizing:
                self._begin_abort()
            case DaemonState.ABORTING if all(r.status.is_finished for r in self.aborted_at_shutdown):
                self._begin_flush()
            case DaemonState.FLUSHING if not self.blocked:
                self._stopped()

    async def _teardown(self) -> None:
        self.state = DaemonState.STOPPED
        loop = asyncio.get_running_loop()
        for worker in self.workers:
            if worker.process is not None:
                loop.remove_reader(worker.process.sentinel)
        try:
            for worker in self.workers:
                if worker.process is not None and worker.process.is_alive():
                    worker.send(P.Shutdown())  # not connected: the deadline join handles it
            await asyncio.gather(*(asyncio.to_thread(stop_process, w) for w in self.workers))
        finally:
            release_workers(self.workers)
            for pump in (self.client_pump, self.event_pump):
                if pump is not None:
                    pump.stop()
            if self.monitor is not None:
                loop.remove_reader(self.monitor.getsockopt(zmq.FD))
                self.router.disable_monitor()
                self.monitor.close(linger=0)
            if self.authenticator is not None:
                self.authenticator.stop()
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            for sock in (self.router, self.events):
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            for path in self.owned_paths:  # libzmq leaves the files of closed ipc sockets behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self.lock is not None:
                self.lock.release()
            self.metrics.close()
        log.info("stopped")

    # ------------------------------------------------------------ workers

    def _on_event(self, frame: bytes) -> None:
        """One message of a worker (doorbell, heartbeat, ready, start failure)."""
        try:
            event = P.EVENT_DECODER.decode(frame)
        except msgspec.DecodeError:
            self.metrics.dropped.labels("worker_event").inc()
            log.warning("undecodable worker event dropped")
            return
        try:
            self._handle_event(event)
        except Exception:
            # A bug met by one event must not stop the reading of every worker's events.
            log.exception("internal error handling worker event %r", event)
            self.metrics.internal_errors.inc()

    def _handle_event(self, event) -> None:
        match event:
            case P.Doorbell(worker=index):
                self._read_ring(self.workers[index])
            case P.WorkerHeartbeat(worker=index) as beat:
                self.workers[index].last_heartbeat = time.monotonic()
                self._on_worker_load(beat)
            case P.WorkerReady() as ready:
                self._on_worker_ready(ready)
            case P.WorkerStartFailed(worker=index, message=message):
                log.error("worker %d (%s) failed to start: %s", index, self.workers[index].device, message)
                if self.state == DaemonState.STARTING:
                    self.request_stop(exit_code=1)  # a restart that fails retries with backoff instead

    def _on_worker_load(self, beat: P.WorkerHeartbeat) -> None:
        """The engine's own KV figures: block use for the gauges, its counters as deltas (they restart with it)."""
        load = self.worker_loads[beat.worker]
        label = str(beat.worker)
        m = self.metrics
        for name, counter in (("preemptions", m.preemptions.labels(label, "kv_cache")),
                              ("prefix_cache_queries", m.prefix_cache_queries.labels(label)),
                              ("prefix_cache_hits", m.prefix_cache_hits.labels(label))):
            value, last = getattr(beat, name), getattr(load, name)
            delta = value - last if value >= last else value
            if delta:
                counter.inc(delta)
        self.worker_loads[beat.worker] = beat

    def _on_worker_ready(self, ready: P.WorkerReady) -> None:
        budget = self.scheduler.workers[ready.worker]
        budget.max_num_seqs = ready.max_num_seqs
        budget.max_model_len = ready.max_model_len
        budget.kv_cache_tokens = ready.kv_cache_tokens
        budget.kv_cache_bytes = ready.kv_cache_bytes
        budget.block_size = ready.block_size
        budget.prefix_caching = ready.prefix_caching
        budget.prefix_index.clear()
        blocks = ready.kv_cache_tokens // max(ready.block_size, 1)
        self.worker_loads[ready.worker] = P.WorkerHeartbeat(
            worker=ready.worker, running=0, waiting=0, steps=0, kv_blocks_total=blocks, kv_blocks_free=blocks)
        budget.ready = True
        self.workers[ready.worker].last_heartbeat = time.monotonic()
        log.info("worker %d ready on %s (pid %d, %d slots)", ready.worker, ready.device, ready.pid, ready.max_num_seqs)
        if self.state == DaemonState.STARTING and all(b.ready for b in self.scheduler.workers):
            self.state = DaemonState.SERVING
            log.info("ready: serving in %.1f s", time.monotonic() - self.started)
            self.notifier.ready(status=f"serving on {len(self.workers)} worker(s)")
        self._dispatch()

    def _on_worker_exit(self, worker: WorkerProcess) -> None:
        """A worker process ended: take what it published, resume its requests elsewhere, restart it."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(worker.process.sentinel)
        worker.alive = False
        self.scheduler.workers[worker.index].ready = False
        worker.process.join(EXIT_REAP_S)  # the sentinel fired: reaping is immediate, and sets exitcode
        code = worker.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        log.error("worker %d (pid %d) exited: %s", worker.index, worker.pid, how)
        self._read_ring(worker)
        orphans = self.scheduler.clear_worker(worker.index)
        # Preempted (or aborted while preempting) there, not charged any more, awaiting a confirmation that
        # will never come:
        orphans += [r for r in self.by_handle.values() if r.worker is None and r.last_worker == worker.index
                    and r.status in (RequestStatus.PREEMPTING, RequestStatus.ABORTING)]
        for req in orphans:
            req.worker_failures += 1
            if req.status == RequestStatus.ABORTING:
                self._finish(req, req.abort_reason)
            elif req.worker_failures > MAX_RESUMES or self.state != DaemonState.SERVING:
                self._end(req, P.Error(id=req.id, code=P.ErrorCode.WORKER_FAILED,
                                       message=f"worker {worker.index} exited {req.worker_failures} time(s) "
                                               f"while running this request"))
            else:
                self._requeue(req)  # resumes from prompt + tokens already streamed, on a live worker
        if self.state == DaemonState.STARTING:
            self.request_stop(exit_code=1)
        elif self.state == DaemonState.SERVING:
            self._schedule_restart(worker)
        self._dispatch()

    def _schedule_restart(self, worker: WorkerProcess) -> None:
        """Restart after ``RESTART_BACKOFF_S * 2**(recent failures)`` seconds, capped; counts restarts."""
        now = time.monotonic()
        worker.failures = [t for t in worker.failures if now - t < RESTART_WINDOW_S] + [now]
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(worker.failures) - 1))
        self.metrics.worker_restarts.inc()
        log.warning("restarting worker %d in %.1f s (%d failure(s) in %.0f s)",
                    worker.index, delay, len(worker.failures), RESTART_WINDOW_S)
        asyncio.get_running_loop().call_later(delay, self._restart, worker)

    def _restart(self, worker: WorkerProcess) -> None:
        if self.state != DaemonState.SERVING or worker.alive:
            return
        worker.process.close()
        spawn(worker)  # same ring and command socket; the new producer continues at write_pos
        worker.ring.arm()
        asyncio.get_running_loop().add_reader(worker.process.sentinel, self._on_worker_exit, worker)

    def _read_ring(self, worker: WorkerProcess) -> None:
        """Consume every published record of ``worker``'s ring, then re-arm its doorbell."""
        self._poll_connections()  # a closed connection's requests must not stream to its identity's next one
        ring = worker.ring
        ring.disarm()
        self.read_time = time.monotonic()
        touched: dict[int, Request] = {}
        tokens = 0
        while True:
            records = ring.read()
            for rec in records:
                req = self.by_handle.get(rec.handle)
                if req is None:
                    self.metrics.dropped.labels("stale_record").inc()
                    continue
                if rec.kind == KIND_TOKEN:
                    self._on_token(req, rec)
                    tokens += 1
                elif rec.kind == KIND_FINISH:
                    finish = P.FINISH_DECODER.decode(rec.payload)
                    if self._preemption_done(req, finish):
                        continue
                    aborted = req.status == RequestStatus.ABORTING
                    reason = req.abort_reason if aborted else finish.finish_reason
                    self._finish(req, reason, finish.stop_reason, flush=False)
                elif rec.kind == KIND_ERROR:
                    error = P.WORKER_ERROR_DECODER.decode(rec.payload)
                    self._end(req, P.Error(id=req.id, code=error.code, message=error.message), flush=False)
                touched[rec.handle] = req
            if ring.commit():
                worker.send(P.RingSpace())
            if not records and ring.arm():
                break
        if tokens:
            self.metrics.generation_tokens.inc(tokens)
        for req in touched.values():
            self._flush(req)
        self._dispatch()

    def _preemption_done(self, req: Request, finish: P.Finish) -> bool:
        """A preempted request's worker confirmed the abort: back to the queue, resumable."""
        if req.status != RequestStatus.PREEMPTING or finish.finish_reason != P.FinishReason.CANCELLED:
            return False  # not preempted; or it ended anyway (finished first, or was aborted meanwhile)
        log.info("request %s (priority %d) preempted on worker %d after %d tokens; back in the queue",
                 req.id, req.priority, req.last_worker, len(req.output_token_ids))
        self._requeue(req)
        return True

    def _requeue(self, req: Request) -> None:
        """Back to the queue, resumable from the tokens already streamed (ended instead once stopping)."""
        if not self.state.accepts_requests:
            self._finish(req, P.FinishReason.SHUTDOWN)
            return
        req.status = RequestStatus.WAITING
        req.queued_at = time.monotonic()
        self.scheduler.requeue(req)

    def _on_token(self, req: Request, rec) -> None:
        if rec.seq != req.next_token_seq:
            log.error("request %s: token seq %d, expected %d; ending it", req.id, rec.seq, req.next_token_seq)
            self._abort(req, P.FinishReason.ERROR)
            return
        now = self.read_time
        if not req.first_token:
            req.first_token = now
            self.metrics.ttft.observe(now - req.arrival)
        elif now != req.last_token:  # tokens of one stream read together: one sample
            self.metrics.itl.observe(now - req.last_token)
        req.last_token = now
        req.next_token_seq += 1
        self.scheduler.grow(req)
        req.output_token_ids.append(rec.token_id)
        req.pending_ids.append(rec.token_id)
        if rec.payload:
            req.pending_text.append(rec.payload.decode())

    # ------------------------------------------------------------ clients

    def _on_client_message(self, parts: list[zmq.Frame]) -> None:
        """One message from a client: ``[identity, frame...]``."""
        self._poll_connections()
        connection = self._connection_of(parts[-1])
        frames = [part.bytes for part in parts]
        try:
            self._on_frames(frames, connection)
        except Exception:
            # A bug met by one frame must not stop the serving of every client.
            log.exception("internal error handling a frame from client %s", frames[0].hex())
            self.metrics.internal_errors.inc()
            self.metrics.dropped.labels("internal_error").inc()
            self._reply(frames[0], P.Error(id=None, code=P.ErrorCode.INTERNAL, message="internal error"))

    def _connection_of(self, part: zmq.Frame) -> int | None:
        """Serial of the connection a received message came through (None if unknown)."""
        try:
            fd = part.get(zmq.SRCFD)
        except zmq.ZMQError:
            return None
        return self.clients.connection_of(fd)

    def _poll_connections(self) -> None:
        """Apply every pending connection event of the client socket (never blocks).

        Called before each client message and before chunks are sent, so a
        connection's close is known before anything reaches a later
        connection of the same identity.
        """
        while True:
            try:
                event_frame, _endpoint = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = MONITOR_EVENT.unpack(event_frame)
            if event == zmq.EVENT_ACCEPTED:
                self.clients.connection_accepted(fd)
            elif event == zmq.EVENT_DISCONNECTED and (identity := self.clients.connection_closed(fd)) is not None:
                self.metrics.client_events.labels("disconnected").inc()
                self._client_gone(identity, "disconnected")

    def _on_frames(self, frames: list[bytes], connection: int | None = None) -> None:
        identity = frames[0]
        now = time.monotonic()
        client, reconnected = self.clients.heard(identity, connection, now)
        if reconnected:
            self._client_gone(identity, "connected again")  # its previous connection's requests end unseen
            client = None
        if len(frames) != 2:

            self.metrics.dropped.labels("frame_count").inc()
            self._reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST,
                                          message=f"expected 1 message frame, got {len(frames) - 1}"))
            return
        try:
            msg = P.CLIENT_DECODER.decode(frames[1])
        except msgspec.DecodeError as exc:
            self.metrics.invalid.inc()
            self.metrics.dropped.labels("invalid").inc()
            rid = _guess_id(frames[1])
            if client is not None and rid in client.requests:
                rid = None  # never end a live stream because of another, broken frame
            self._reply(identity, P.Error(id=rid, code=P.ErrorCode.INVALID_REQUEST, message=f"bad message: {P.explain(exc, frames[1])}"))
            return
        match msg:
            case P.Generate():
                self._on_generate(identity, msg, now, connection)
            case P.Cancel(id=rid):
                req = client.requests.get(rid) if client else None
                if req is None:
                    self._reply(identity, P.Error(id=rid, code=P.ErrorCode.UNKNOWN_REQUEST, message=f"no open request {rid!r}"))
                else:
                    self._abort(req, P.FinishReason.CANCELLED)
            case P.Heartbeat(open_ids=open_ids):
                self._reply(identity, P.HeartbeatAck())
                known = client.requests if client is not None else {}
                for rid in itertools.islice((rid for rid in open_ids if rid not in known), MAX_UNKNOWN_ANSWERS):
                    self._reply(identity, P.Error(id=rid, code=P.ErrorCode.UNKNOWN_REQUEST,
                                                  message=f"request {rid!r} is not known to this daemon "
                                                          "(it restarted, or the request was cancelled)"))
            case P.Status():
                self._reply(identity, self.status())
            case P.Admin(settings=settings):
                self._on_admin(identity, settings)

    def _on_generate(self, identity: bytes, msg: P.Generate, now: float, connection: int | None = None) -> None:
        client = self.clients.get(identity)
        if client is not None and msg.id in client.requests:
            self.metrics.invalid.inc()
            self.metrics.dropped.labels("invalid").inc()
            self._reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST,
                                          message=f"duplicate request id {msg.id!r}: it is still open"))
            return
        if not self.state.accepts_requests:
            self._reply(identity, P.Error(id=msg.id, code=P.ErrorCode.SHUTTING_DOWN, message="daemon is shutting down"))
            return
        req = Request(identity, msg.id, next(self.handles), msg, [], now, queued_at=now)
        if msg.prompt is not None and len(msg.prompt) > INLINE_TOKENIZE_CHARS:
            self._tokenize_off_loop(req, connection)
            return
        try:
            req.prompt_token_ids = self.validator.check(msg, self.scheduler.max_request_tokens())
        except RequestRejected as exc:
            self._reject(req, exc.code, str(exc))
            return
        self._admit(req, connection)

    def _reject(self, req: Request, code: P.ErrorCode, message: str) -> None:
        """Refuse a request that was never admitted (it may hold its id while a long prompt is tokenised)."""
        if code != P.ErrorCode.QUEUE_FULL:
            self.metrics.invalid.inc()
            self.metrics.dropped.labels("invalid").inc()
        self._reply(req.client, P.Error(id=req.id, code=code, message=message))
        self._forget(req)

    def _admit(self, req: Request, connection: int | None) -> None:
        """Queue a validated request (or refuse it with QUEUE_FULL) and register it with its client."""
        accepted, displaced = self.scheduler.add(req)
        if not accepted:
            self._reject(req, P.ErrorCode.QUEUE_FULL, f"queue full ({self.scheduler.num_waiting} waiting)")
            return
        if displaced is not None:
            self._end(displaced, P.Error(id=displaced.id, code=P.ErrorCode.QUEUE_FULL,
                                         message="displaced from the full queue by a more urgent request"))
        self.clients.add(req, connection, time.monotonic())
        self.by_handle[req.handle] = req
        self.metrics.admitted.inc()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        self._start_timers(req)
        self._dispatch()

    def _tokenize_off_loop(self, req: Request, connection: int | None) -> None:
        """Tokenise a long prompt on the tokenizer thread; the request holds its id (Cancel finds it) meanwhile."""
        limit = self.scheduler.max_request_tokens()
        try:
            self.validator.precheck(req.msg, self.validator.limit(limit))
        except RequestRejected as exc:
            self._reject(req, exc.code, str(exc))
            return
        if self.tokenizing >= MAX_TOKENIZING:
            self._reject(req, P.ErrorCode.QUEUE_FULL, f"{self.tokenizing} long prompts are being tokenised already")
            return
        self.clients.add(req, connection, req.arrival)
        self.tokenizing += 1
        future = asyncio.get_running_loop().run_in_executor(
            self.tokenizer_pool, functools.partial(self.validator.tokenize, req.msg.prompt, release_gil=True))
        future.add_done_callback(functools.partial(self._on_tokenized, req, connection))

    def _on_tokenized(self, req: Request, connection: int | None, future: asyncio.Future) -> None:
        self.tokenizing -= 1
        self._advance_shutdown()
        if future.cancelled() or not req.client:
            return  # stopping, or the client is gone: nothing to answer
        if req.status == RequestStatus.ABORTING:
            self._finish(req, req.abort_reason)  # cancelled meanwhile
            return
        if not self.state.accepts_requests:
            self._reply(req.client, P.Error(id=req.id, code=P.ErrorCode.SHUTTING_DOWN,
                                            message="daemon is shutting down"))
            self._forget(req)
            return
        try:
            ids = future.result()
            limit = self.validator.limit(self.scheduler.max_request_tokens())
            req.prompt_token_ids = self.validator.finish(req.msg, ids, limit)
        except RequestRejected as exc:
            self._reject(req, exc.code, str(exc))
            return
        except Exception:
            log.exception("tokenising the prompt of request %s failed", req.id)
            self.metrics.internal_errors.inc()
            self._reply(req.client, P.Error(id=req.id, code=P.ErrorCode.INTERNAL, message="tokenisation failed"))
            self._forget(req)
            return
        self._admit(req, connection)

    def _start_timers(self, req: Request) -> None:
        """Deadlines: the daemon's defaults, shortened (never lengthened) by the request's own."""
        loop = asyncio.get_running_loop()
        timeout = min(req.msg.timeout_s or self.config.timeout_s, self.config.timeout_s)
        req.timers.append(loop.call_at(loop.time() + timeout, self._abort, req, P.FinishReason.TIMEOUT))
        queue_timeouts = [t for t in (req.msg.queue_timeout_s, self.config.queue_timeout_s) if t]
        if queue_timeouts:
            req.queue_timer = loop.call_at(loop.time() + min(queue_timeouts), self._on_queue_timeout, req)

    def _on_queue_timeout(self, req: Request) -> None:
        if self.scheduler.remove(req):
            waited = time.monotonic() - req.arrival
            self._end(req, P.Error(id=req.id, code=P.ErrorCode.QUEUE_TIMEOUT,
                                   message=f"not scheduled within {waited:.3f} s"))

    def _dispatch(self) -> None:
        """Start what fits; then preempt for the most urgent waiting request, and repeat."""
        now = time.monotonic()
        while True:
            for req, budget in self.scheduler.schedule(now):
                self._assign(req, budget.index, now)
            preempted = self.scheduler.preempt()
            if preempted is None:
                return
            victim, index = preempted
            victim.status = RequestStatus.PREEMPTING
            self.metrics.preemptions.labels(str(index), "priority").inc()
            self.scheduler.workers[index].preemptions += 1
            self.workers[index].send(P.Abort(handle=victim.handle))

    def _assign(self, req: Request, index: int, now: float) -> None:
        req.status = RequestStatus.RUNNING
        req.last_worker = index
        if req.queued_at:
            req.queue_time += now - req.queued_at
            req.queued_at = 0.0
        if not req.dispatched:
            req.dispatched = now
            self.metrics.queue_time.observe(now - req.arrival)
            if req.queue_timer is not None:
                req.queue_timer.cancel()
        msg = req.msg
        self.workers[index].send(P.Assign(
            handle=req.handle, prompt_token_ids=req.prompt_token_ids, sampling=msg.sampling,
            output_token_ids=req.output_token_ids,
            priority=req.priority,
        ))

    def _abort(self, req: Request, reason: P.FinishReason) -> None:
        """End a request early: at once if waiting, else after its worker confirms."""
        if req.status >= RequestStatus.ABORTING:
            return
        if self.scheduler.remove(req):
            self._finish(req, reason)
            return
        running = req.status == RequestStatus.RUNNING  # a PREEMPTING one was told to stop already
        req.status, req.abort_reason = RequestStatus.ABORTING, reason
        if running and req.worker is not None:
            self.workers[req.worker].send(P.Abort(handle=req.handle))

    def _finish(self, req: Request, reason: P.FinishReason, stop_reason=None, flush: bool = True) -> None:
        now = time.monotonic()
        usage = P.Usage(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(req.output_token_ids),
            queue_time_s=req.queue_time + (now - req.queued_at if req.queued_at else 0.0),
            ttft_s=(req.first_token - req.arrival) if req.first_token else 0.0, e2e_s=now - req.arrival,
        )
        self._end(req, P.Chunk(id=req.id, seq=0, finish_reason=reason, stop_reason=stop_reason, usage=usage), flush)

    def _end(self, req: Request, final: P.Chunk | P.Error, flush: bool = True) -> None:
        """Record the terminal message; the request leaves every table once it is sent."""
        if req.status.is_finished:
            return
        req.status, req.final = RequestStatus.of(final), final
        status = final.code if isinstance(final, P.Error) else final.finish_reason
        e2e = time.monotonic() - req.arrival
        self.metrics.requests.labels(status).inc()
        self.metrics.e2e.observe(e2e)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s/%s %s: prompt=%d completion=%d ttft=%.3fs e2e=%.3fs priority=%d",
                      req.client.hex(), req.id, status, req.num_prompt_tokens, len(req.output_token_ids),
                      (req.first_token - req.arrival) if req.first_token else 0.0, e2e, req.priority)
        for timer in req.timers:
            timer.cancel()
        if req.queue_timer is not None:
            req.queue_timer.cancel()
        self.scheduler.finished(req)
        self.by_handle.pop(req.handle, None)
        if flush:
            self._flush(req)
            self._dispatch()
        self._advance_shutdown()

    def _flush(self, req: Request) -> None:
        """Send what is pending for ``req`` as one Chunk (plus its terminal message)."""
        final = req.final
        if not (req.pending_ids or final) or (not req.msg.stream and final is None):
            return
        if isinstance(final, P.Error):
            msg = final
        else:
            msg = P.Chunk(id=req.id, seq=req.chunk_seq, text="".join(req.pending_text), token_ids=req.pending_ids)
            if final is not None:
                msg.finish_reason, msg.stop_reason, msg.usage = final.finish_reason, final.stop_reason, final.usage
        result = self._reply(req.client, msg)
        if result == "sent":
            req.chunk_seq += 1
            req.pending_text = []
            req.pending_ids = []
            self.blocked.pop(req.handle, None)
            if final is not None:
                self._forget(req)
        elif result == "blocked":
            if req.handle not in self.blocked:
                self.metrics.client_events.labels("send_blocked").inc()
            self.blocked[req.handle] = req
            client = self.clients.get(req.client)
            if client and not client.blocked_since:
                client.blocked_since = time.monotonic()
            if not self.retry_scheduled:
                self.retry_scheduled = True
                asyncio.get_running_loop().call_later(RETRY_SEND_S, self._retry_blocked)
        else:
            self._client_gone(req.client)

    def _retry_blocked(self) -> None:
        self.retry_scheduled = False
        self._poll_connections()
        for req in list(self.blocked.values()):
            if self.blocked.get(req.handle) is req:
                self._flush(req)
        for _, client in self.clients:
            if client.blocked_since and not any(r.handle in self.blocked for r in client.requests.values()):
                client.blocked_since = 0.0

    def _forget(self, req: Request) -> None:
        self.clients.remove(req)
        self.blocked.pop(req.handle, None)
        self._advance_shutdown()

    def _client_gone(self, identity: bytes, why: str = "gone") -> None:
        """The client vanished (unroutable, silent, disconnected): cancel its requests, send nothing."""
        client = self.clients.pop(identity)
        if client is None:
            return
        log.info("client %s %s; cancelling %d request(s)", identity.hex(), why, len(client.requests))
        for req in client.requests.values():
            self.blocked.pop(req.handle, None)
            req.client = b""
            if not req.status.is_finished:
                self._abort(req, P.FinishReason.CANCELLED)

    def _reply(self, identity: bytes, msg) -> str:
        """Send one message; returns "sent", "blocked" (EAGAIN at the HWM) or "gone"."""
        if not identity:
            return "gone"
        try:
            # Two sends with int flags: send_multipart combines flag enums per frame, a measurable cost here.
            # A ROUTER refuses or queues the first frame; once queued, the second never fails.
            self.router.send(identity, SNDMORE_NOBLOCK)
            self.router.send(P.encode(msg), NOBLOCK)
        except zmq.Again:
            return "blocked"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "gone"
            raise
        finally:
            self.client_pump.kick()  # a send may take the socket's read edge (see ipc.aio)
        return "sent"

    # ------------------------------------------------------------ timers

    async def _housekeeping(self) -> None:
        start_deadline = self.started + self.config.worker_start_timeout_s
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            self.housekeeping_tick = now
            self._update_gauges()
            timeout = self.config.client_timeout_s  # a live setting: read at every tick
            for identity, client, verdict, seconds in self.clients.expired(now, timeout):
                if verdict == "silent":
                    self._client_gone(identity, f"silent for {timeout:.1f} s")
                elif verdict == "gone":
                    self._client_gone(identity, f"not reading for {seconds:.1f} s")
                else:
                    self._cancel_stuck(identity, client, seconds)
            for worker, budget in zip(self.workers, self.scheduler.workers):
                silent_s = now - worker.last_heartbeat  # since its spawn, for a worker still starting
                if not worker.alive:
                    continue
                if budget.ready and silent_s > self.config.worker_stall_timeout_s:
                    log.error("worker %d sent no heartbeat for %.0f s; killing it", worker.index, silent_s)
                    budget.ready = False
                    worker.process.kill()  # its sentinel then runs the usual exit path
                elif not budget.ready and self.state == DaemonState.SERVING and silent_s > self.config.worker_start_timeout_s:
                    log.error("restarted worker %d not ready after %.0f s; killing it", worker.index, silent_s)
                    worker.process.kill()
            if self.state == DaemonState.STARTING and now > start_deadline:
                log.error("workers not ready after %.0f s", self.config.worker_start_timeout_s)
                self.request_stop(exit_code=1)

    def _cancel_stuck(self, identity: bytes, client: ClientState, stuck_s: float) -> None:
        """Cancel the requests of a client that reads nothing; their last chunks wait for it to read again."""
        open_requests = [r for r in client.requests.values() if r.status < RequestStatus.ABORTING]
        if open_requests:
            self.metrics.client_events.labels("stuck").inc()
            log.info("client %s not reading for %.1f s; cancelling %d request(s)", identity.hex(), stuck_s,
                     len(open_requests))
        for req in open_requests:
            self._abort(req, P.FinishReason.CANCELLED)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.clear()
        for priority, count in self.scheduler.waiting_by_priority().items():
            m.waiting.labels(str(priority)).set(count)
        for worker, budget in zip(self.workers, self.scheduler.workers):
            label = str(worker.index)
            load = self.worker_loads[worker.index]
            m.kv_cache_usage.labels(label).set(kv_cache_usage(load))
            m.kv_cache_blocks.labels(label, "total").set(load.kv_blocks_total)
            m.kv_cache_blocks.labels(label, "free").set(load.kv_blocks_free)
            m.kv_cache_bytes.labels(label).set(budget.kv_cache_bytes)
            m.ring_fill.labels(label).set(worker.ring.fill())
            m.worker_up.labels(label, worker.device).set(1 if budget.ready and worker.alive else 0)

    async def _watchdog(self) -> None:
        """Ping systemd's watchdog every half timeout while the front loop and every ready worker are healthy."""
        interval = self.notifier.watchdog_interval_s
        max_age = self.notifier.watchdog_timeout_s
        while True:
            now = time.monotonic()
            beats = {w.index: w.last_heartbeat for w, b in zip(self.workers, self.scheduler.workers) if b.ready and w.alive}
            if self.watchdog_gate.ping_if_healthy(now - self.housekeeping_tick < max_age, beats, now, max_age):
                self.notifier.status(f"{self.state}: {self.scheduler.num_running} running, "
                                     f"{self.scheduler.num_waiting} waiting, {self.metrics.total('ringstream_requests_admitted')} requests")
            await asyncio.sleep(interval)

    # ------------------------------------------------------------ live settings

    def _on_admin(self, identity: bytes, settings: dict) -> None:
        if not self.config.address().startswith("ipc://"):
            self._reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST,
                                          message="admin is accepted only on an ipc socket (its file mode says who may)"))
            return
        try:
            notes = self.apply_settings(settings)
        except ValueError as exc:
            self._reply(identity, P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST, message=str(exc)))
            return
        self._reply(identity, self.status(notes))

    def apply_settings(self, changes: dict) -> list[str]:
        """Change live settings (names in LIVE_SETTINGS); all or nothing.

        Returns notes on what takes effect differently from what was asked.
        Raises ValueError naming the problem.
        """
        slots = [b.max_num_seqs for b in self.scheduler.workers if b.ready]
        result = change_settings(self.config, changes, slots)
        for note in result.notes:
            log.warning("settings: %s", note)
        if not result.changed:
            log.info("settings unchanged (%s already in force)", ", ".join(sorted(changes)) or "nothing asked")
            return list(result.notes)
        config, old_rate = result.config, self.config.aging_rate
        self.config = config
        policy = policy_of(config)
        policy.aging_rate = old_rate
        self.scheduler.policy = policy
        if config.aging_rate != old_rate:
            self.scheduler.set_aging_rate(config.aging_rate)
        logging.getLogger("ringstream").setLevel(config.log_level.upper())
        log.info("settings changed: %s", ", ".join(f"{k}={v}" for k, v in result.changed.items()))
        self._dispatch()
        return list(result.notes)

    def reload(self) -> None:
        """SIGHUP: re-read the config file and apply its live settings; report the others.

        systemd hears ``RELOADING=1`` ... ``READY=1`` around it, while serving only
        (a READY during start would end the start early).
        """
        serving = self.state == DaemonState.SERVING
        if serving:
            self.notifier.reloading()
        try:
            self._reload()
        finally:
            if serving:
                self.notifier.ready(status="serving (settings reloaded)")

    def _reload(self) -> None:
        if self.authenticator is not None:
            self._load_allowed_clients()
        if self.config_path is None:
            log.warning("SIGHUP: no config file to reload")
            return
        try:
            fresh = load_config(self.config_path, **self.overrides)
        except ValueError as exc:
            log.error("reload failed, settings unchanged: %s", exc)
            return
        live, restart = reload_changes(self.config, fresh)
        if restart:
            log.warning("reload: %s change only after a restart", ", ".join(restart))
        if live:
            try:
                self.apply_settings(live)
            except ValueError as exc:
                log.error("reload failed, settings unchanged: %s", exc)
        else:
            log.info("reload: no live setting changed")

    def status(self, notes: list[str] | tuple[str, ...] = ()) -> P.StatusReply:
        """Live figures, as sent to ``ringstream status`` (and after ``admin set``, with its ``notes``)."""
        counters = self.metrics.counters()
        now = time.monotonic()
        open_requests = list(self.by_handle.values())
        rates = [0.0] * len(self.workers)
        for req in open_requests:
            if req.status == RequestStatus.RUNNING and req.worker is not None:
                rates[req.worker] += decode_rate(req, now)
        oldest = sorted(open_requests, key=lambda req: req.arrival)[:P.MAX_STATUS_REQUESTS]
        generated = self.metrics.generation_tokens.recent
        workers = [
            P.WorkerStatus(
                index=w.index, device=w.device, pid=w.pid, alive=w.alive, running=b.running,
                max_num_seqs=b.max_num_seqs, max_model_len=b.max_model_len, kv_cache_tokens=b.kv_cache_tokens,
                kv_cache_tokens_used=b.kv_tokens_used, ring_fill=w.ring.fill(), requests_served=b.served,
                block_size=b.block_size, kv_blocks_total=load.kv_blocks_total, kv_blocks_free=load.kv_blocks_free,
                kv_cache_usage=kv_cache_usage(load), preemptions_kv_cache=load.preemptions,
                preemptions_priority=b.preemptions,
                prefix_cache_queries=load.prefix_cache_queries, prefix_cache_hits=load.prefix_cache_hits,
                waiting=load.waiting, tokens_per_s=rate,
            )
            for w, b, load, rate in zip(self.workers, self.scheduler.workers, self.worker_loads, rates)
        ]
        return P.StatusReply(
            version=__version__, ready=self.state == DaemonState.SERVING, state=self.state.value,
            uptime_s=time.monotonic() - self.started, waiting=self.scheduler.num_waiting,
            running=self.scheduler.num_running, queue_size=self.scheduler.policy.queue_size,
            max_concurrency=self.scheduler.policy.max_concurrency,
            requests_total=counters["requests_total"],
            tokens_generated_total=counters["tokens_generated_total"], workers=workers,
            settings={name: getattr(self.config, name) for name in LIVE_SETTINGS if getattr(self.config, name) is not None},
            counters=counters,
            metrics=self.metrics.snapshot(), notes=list(notes),
            model=str(self.model.path) if self.model is not None else "",
            tokens_per_s=generated.rate(now), tokens_per_s_window_s=generated.window(now),
            **self.metrics.latency_percentiles(),
            requests_open=len(open_requests), requests=[request_info(req, now) for req in oldest],
        )


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


def refuse_live_socket(path: str) -> None:
    """Raise StartupError if a process already listens on the unix socket ``path``.

    ZeroMQ would silently unlink and re-bind it, stealing another daemon's
    clients; a stale file (nobody listening) is fine to replace.
    """
    try:
        live = unix_socket_listening(path)
    except OSError as exc:
        raise StartupError(f"socket {path}: {exc}") from exc
    if live:
        raise StartupError(f"socket {path} is in use by another process (another daemon?)")


def _guess_id(frame: bytes) -> str | None:
    """Best-effort request id of an undecodable frame, so its sender can match the error."""
    _, rid = P.frame_head(frame)
    return rid if rid and len(rid) <= P.MAX_ID_CHARS else None


def serve(config: Config, config_path: str | None = None, overrides: dict | None = None) -> int:
    """Run a daemon in this process until stopped; returns its exit code."""
    import uvloop

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s front %(message)s")
    return uvloop.run(Front(config, config_path, overrides).run())

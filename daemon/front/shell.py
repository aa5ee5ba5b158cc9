"""The front process's shell: sockets, the event loop, signals; the request lifecycle is the core's.

One asyncio loop (uvloop) owns everything here, and turns what the world
says into calls on :class:`ringstream.daemon.front.core.FrontCore` (requests,
scheduling, streaming, the daemon's state), :class:`ringstream.daemon.front.intake.Intake`
(client messages) and :class:`ringstream.daemon.front.worker_pool.WorkerPool`
(worker processes); the core answers through this shell's ports. The shell
owns:

* the client socket (:mod:`ringstream.daemon.front.client_socket`: a ROUTER with a
  connection monitor, optionally CURVE);
* a PULL socket on which workers report readiness, heartbeats and doorbells;
  both are plain ZeroMQ sockets read by :class:`ringstream.ipc.aio.SocketPump`
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
import gc
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq
import zmq.asyncio

from ringstream.daemon.front.client_socket import ClientSocket
from ringstream.daemon.common.config import Config, load_serve_config, parse_devices, runtime_dir
from ringstream.daemon.front.core import ABORT_GRACE_S, FrontCore
from ringstream.daemon.http.child import HttpChild, HttpSpec, bind_listener
from ringstream.daemon.http.options import HttpOptions
from ringstream.daemon.common.listen import read_api_key
from ringstream.daemon.front.intake import Intake
from ringstream.daemon.front.metrics import Metrics
from ringstream.daemon.common.model_dir import ModelInfo, model_name
from ringstream.daemon.front.model_load import LoadAbandoned, load_model
from ringstream.daemon.front.notify import Notifier, WatchdogGate
from ringstream.daemon.front.ports import SendResult
from ringstream.daemon.front.request import DaemonState
from ringstream.daemon.common.settings import reload_changes
from ringstream.daemon.front.status import build_status, update_gauges
from ringstream.daemon.front.validate import Validator
from ringstream.daemon.front.worker_pool import (
    WorkerPool, WorkerProcess, create_workers, ensure_open_files, open_files_needed,
)
from ringstream.daemon.common.supervision import JOIN_GRACE_S, InstanceLock, StartupError
from ringstream.ipc import protocol as P
from ringstream.ipc.address import bind_private
from ringstream.ipc.aio import SocketPump

log = logging.getLogger("ringstream.front")

HOUSEKEEPING_S = 0.25
"""Period of the timer that checks client timeouts, worker heartbeats and the start deadline."""
TIMEOUT_MARGIN_S = 10.0
"""Slack added to the start/stop times announced to systemd (EXTEND_TIMEOUT_USEC)."""

class Front:
    """The daemon's front process; ``await Front(config).run()`` serves until a stop signal.

    Implements the core's ports (:class:`ringstream.daemon.front.core.Ports`) over
    the client socket, the workers' command sockets and the event loop.
    """

    def __init__(self, config: Config, config_path: str | None = None, overrides: dict | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides or {}
        """Command-line values, which win over the file at every reload too."""
        self.devices = parse_devices(config.devices)
        self.metrics = Metrics()
        self.core = FrontCore(config, self, len(self.devices), self.metrics)
        self.stopped_event = asyncio.Event()
        """Set when the core's shutdown reached STOPPED: teardown follows."""
        self.ctx = zmq.asyncio.Context()
        self.pool: WorkerPool | None = None
        self.http: HttpChild | None = None
        """The HTTP API child process (``http`` / ``http_unix`` set), else None."""
        self.intake: Intake | None = None
        self.model: ModelInfo | None = None
        self.lock: InstanceLock | None = None
        self.client_socket: ClientSocket | None = None
        self.events: zmq.Socket | None = None
        self.event_pump: SocketPump | None = None
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringstream-tokenize")
        self.notifier = Notifier()
        self.owned_paths: list[str] = []
        """ipc socket files this daemon bound, removed at stop."""
        self.watchdog_gate = WatchdogGate(self.notifier)
        self.abandoned_load = False
        """A stop signal ended the start while the model was still resolving (a download thread still runs)."""
        self.housekeeping_tick = time.monotonic()

    @property
    def state(self) -> DaemonState:
        return self.core.state

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.pool.workers if self.pool is not None else []

    # ------------------------------------------------------------ ports (called by the core)

    def send(self, identity: bytes, msg) -> SendResult:
        return self.client_socket.send(identity, msg)

    def send_worker(self, index: int, command) -> None:
        self.pool[index].send(command)

    def call_later(self, delay_s: float, callback, *args):
        return asyncio.get_running_loop().call_later(delay_s, callback, *args)

    def ready(self) -> None:
        self.notifier.ready(status=f"serving on {len(self.workers)} worker(s)")

    def stopping(self) -> None:
        # The HTTP child keeps accepting while the daemon drains: /health answers 503 "draining" and new
        # requests 503 SHUTTING_DOWN (what a load balancer expects), its streams in flight go on.
        drain_s = self.core.config.drain_timeout_s
        self.notifier.stopping(status=f"draining (up to {drain_s:.0f} s)")
        self.notifier.extend_timeout(drain_s + 2 * ABORT_GRACE_S + 2 * JOIN_GRACE_S + TIMEOUT_MARGIN_S)

    def stopped(self) -> None:
        if self.http is not None:
            self.http.terminate()  # every stream's last message is delivered: it relays them, then exits
        self.stopped_event.set()

    def poll_connections(self) -> None:
        """Apply every pending connection event of the client socket (never blocks).

        Called before each client message and before chunks are sent, so a
        connection's close is known before anything reaches a later
        connection of the same identity.
        """
        if self.client_socket is None:
            return
        clients = self.core.clients
        for event, fd in self.client_socket.connection_events():
            if event == zmq.EVENT_ACCEPTED:
                clients.connection_accepted(fd)
            elif event == zmq.EVENT_DISCONNECTED and (identity := clients.connection_closed(fd)) is not None:
                self.metrics.client_events.labels("disconnected").inc()
                self.core.client_gone(identity, "disconnected")

    # ------------------------------------------------------------ start / stop

    async def run(self) -> int:
        """Start workers, serve until SIGTERM/SIGINT, drain, stop. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        tasks = []
        try:
            validator = await self._load_model()
            self._setup(validator)
            # Modules, model metadata and tokenizer live as long as the process: keep them out of the
            # collector's full passes, which would otherwise stall the loop for tens of ms each.
            gc.freeze()
            self.notifier.status(f"starting: loading the model on {len(self.workers)} worker(s)")
            self.notifier.extend_timeout(self.config.worker_start_timeout_s + TIMEOUT_MARGIN_S)
            self.event_pump = SocketPump(self.events, self._on_event)
            self.client_socket.start(self.poll_connections)
            self.event_pump.start()
            coros = [self._housekeeping()]
            if self.notifier.watchdog_interval_s is not None:
                coros.append(self._watchdog())
            tasks = [asyncio.create_task(coro) for coro in coros]
            await self.stopped_event.wait()
        except StartupError as exc:
            if exc.exit_code == 0:
                log.info("%s", exc)
            else:
                log.error("start failed: %s", exc)
                self.notifier.status(f"start failed: {exc}")
            self.core.exit_code = exc.exit_code
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._teardown()
        return self.core.exit_code

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin a graceful stop (signal handlers call this)."""
        self.core.request_stop(exit_code)

    async def _load_model(self) -> Validator:
        """Take the instance lock, then read the model (:func:`ringstream.daemon.front.model_load.load_model`:
        a stop signal meanwhile ends the start, exit 0)."""
        rundir = runtime_dir()
        rundir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock = InstanceLock(rundir / f"{self.config.instance}.lock")
        self.notifier.status(f"starting: resolving the model {self.config.model or '(built-in)'}")
        try:
            self.model, validator = await load_model(self.config, self.request_stop)
        except LoadAbandoned:
            self.abandoned_load = True  # its download threads may never end: serve() exits without joining them
            raise
        return validator

    def _setup(self, validator: Validator) -> None:
        config = self.config
        rundir = runtime_dir()
        soft, raised_from = ensure_open_files(open_files_needed(config.max_clients, len(self.devices)))
        if raised_from is not None:
            log.info("raised the open-file limit from %d to %d (max_clients = %d)",
                     raised_from, soft, config.max_clients)
        if config.metrics_port is not None:
            try:
                self.metrics.serve(config.metrics_port)
            except OSError as exc:
                raise StartupError(f"metrics port {config.metrics_port}: {exc}") from exc
        if config.serves_http:
            self.http = self._http_child()
        self.events = zmq.Socket(self.ctx, zmq.PULL)  # plain sockets, read by SocketPumps (ipc.aio)
        event_address = f"ipc://{rundir / f'{config.instance}.events'}"
        bind_private(self.events, event_address)
        self.owned_paths.append(event_address[len("ipc://"):])
        workers = create_workers(config, self.devices, str(self.model.path), self.ctx, rundir, event_address)
        self.pool = WorkerPool(workers, self._on_worker_exit, on_restart=self.metrics.worker_restarts.inc)
        address = config.address()
        self.intake = Intake(self.core, validator, self._run_off_loop, self.status,
                             admin_allowed=address.startswith("ipc://"))
        self.client_socket = ClientSocket(self.ctx, config, self._on_client_message)
        self.client_socket.bind()
        self.pool.start()
        if self.http is not None:
            self.http.start()
        name = model_name(self.model.path)
        log.info("listening on %s; model %s; %d worker(s) on %s", address,
                 self.model.path if name == self.model.path.name else f"{name} ({self.model.path})", len(self.devices),
                 ",".join(self.devices))

    def _http_child(self) -> HttpChild:
        """The HTTP API child, its TCP port bound here: a taken port or a bad key file fails the start at once."""
        config = self.config
        listener = None
        try:
            if config.api_key_file is not None:
                read_api_key(config.api_key_file)
            if config.http is not None:
                listener = bind_listener(config.http)
        except (OSError, ValueError) as exc:
            raise StartupError(f"http {config.http or config.http_unix}: {exc}") from exc
        spec = HttpSpec(HttpOptions.from_config(config), parent_pid=os.getpid(), log_level=config.log_level)
        return HttpChild(spec, listener, lambda: self.state == DaemonState.SERVING, self._http_start_failed)

    def _http_start_failed(self, message: str) -> None:
        log.error("start failed: %s", message)
        self.notifier.status(f"start failed: {message}")
        self.request_stop(exit_code=1)

    async def _teardown(self) -> None:
        self.core.state = DaemonState.STOPPED
        try:
            stops = [s.stop() for s in (self.pool, self.http) if s is not None]
            await asyncio.gather(*stops)
        finally:
            if self.event_pump is not None:
                self.event_pump.stop()
            if self.client_socket is not None:
                self.client_socket.close()
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            if self.events is not None:
                self.events.close(linger=0)
            self.ctx.term()
            for path in self.owned_paths:  # libzmq leaves the files of closed ipc sockets behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self.lock is not None:
                self.lock.release()
            self.metrics.close()
        log.info("stopped")

    # ------------------------------------------------------------ events

    def _on_client_message(self, parts: list[zmq.Frame]) -> None:
        """One message from a client: ``[identity, frame...]``."""
        self.poll_connections()
        connection = self._connection_of(parts[-1])
        frames = [part.bytes for part in parts]
        try:
            self.intake.on_frames(frames, connection)
        except Exception:
            # A bug met by one frame must not stop the serving of every client.
            log.exception("internal error handling a frame from client %s", frames[0].hex())
            self.metrics.internal_errors.inc()
            self.metrics.dropped.labels("internal_error").inc()
            self.send(frames[0], P.Error(id=None, code=P.ErrorCode.INTERNAL, message="internal error"))

    def _connection_of(self, part: zmq.Frame) -> int | None:
        """Serial of the connection a received message came through (None if unknown)."""
        fd = ClientSocket.source_fd(part)
        return None if fd is None else self.core.clients.connection_of(fd)

    def _run_off_loop(self, fn):
        return asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)

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
                self._read_ring(self.pool[index])
            case P.WorkerHeartbeat(worker=index) as beat:
                self.pool[index].last_heartbeat = time.monotonic()
                self.core.on_worker_load(beat)
            case P.WorkerStarting(worker=index, phase=phase):
                self.pool[index].last_heartbeat = time.monotonic()
                self.pool[index].enter(phase)
            case P.WorkerReady(worker=index) as ready:
                self.pool[index].last_heartbeat = time.monotonic()
                self.pool[index].enter("ready")
                self.core.on_worker_ready(ready)
            case P.WorkerStartFailed(worker=index, message=message, refused=refused):
                self.pool[index].enter("failed")
                log.error("worker %d (%s) failed to start: %s", index, self.pool[index].device, message)
                self.core.on_worker_start_failed(refused)

    def _read_ring(self, worker: WorkerProcess) -> None:
        """Hand every published record of ``worker``'s ring to the core; the doorbell is re-armed after."""
        self.poll_connections()  # a closed connection's requests must not stream to its identity's next one
        self.core.on_ring(worker.read_ring())

    def _on_worker_exit(self, worker: WorkerProcess) -> None:
        """A worker process ended (reaped): take what it published, resume its requests elsewhere, restart it."""
        self.poll_connections()
        if self.core.on_worker_exit(worker.index, worker.read_ring()):
            self.pool.restart_later(worker, lambda: self.state == DaemonState.SERVING)

    # ------------------------------------------------------------ timers

    async def _housekeeping(self) -> None:
        start_deadline = self.core.started + self.config.worker_start_timeout_s
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            self.housekeeping_tick = now
            update_gauges(self.core, self.workers)
            self.core.expire_clients(now)
            budgets = self.core.scheduler.workers
            config = self.core.config  # live settings: read at every tick
            for index in self.pool.kill_unresponsive(now, [b.ready for b in budgets], self.state == DaemonState.SERVING,
                                                     config.worker_stall_timeout_s, config.worker_start_timeout_s):
                budgets[index].ready = False  # no new work before its exit is handled
            if self.state == DaemonState.STARTING and now > start_deadline:
                log.error("workers not ready after %.0f s", config.worker_start_timeout_s)
                self.request_stop(exit_code=1)

    async def _watchdog(self) -> None:
        """Ping systemd's watchdog every half timeout while the front loop and every ready worker are healthy."""
        interval = self.notifier.watchdog_interval_s
        max_age = self.notifier.watchdog_timeout_s
        while True:
            now = time.monotonic()
            beats = {w.index: w.last_heartbeat for w, b in zip(self.workers, self.core.scheduler.workers)
                     if b.ready and w.alive}
            if self.watchdog_gate.ping_if_healthy(now - self.housekeeping_tick < max_age, beats, now, max_age):
                scheduler = self.core.scheduler
                self.notifier.status(f"{self.state}: {scheduler.num_running} running, {scheduler.num_waiting} "
                                     f"waiting, {self.metrics.total('ringstream_requests_admitted')} requests")
            await asyncio.sleep(interval)

    # ------------------------------------------------------------ live settings

    def status(self, notes: list[str] | tuple[str, ...] = ()) -> P.StatusReply:
        """Live figures, as sent to ``ringstream status`` (and after ``admin set``, with its ``notes``)."""
        return build_status(self.core, self.workers, str(self.model.path) if self.model is not None else "", notes)

    def apply_settings(self, changes: dict) -> list[str]:
        """Change live settings; see :meth:`FrontCore.apply_settings`."""
        notes = self.core.apply_settings(changes)
        self.config = self.core.config
        return notes

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
        if self.client_socket is not None:
            self.client_socket.load_allowed_clients()
        if self.config_path is None:
            log.warning("SIGHUP: no config file to reload")
            return
        try:
            fresh = load_serve_config(self.config_path, self.overrides)
        except ValueError as exc:
            log.error("reload failed, settings unchanged: %s", exc)
            return
        live, restart = reload_changes(self.core.config, fresh)
        if restart:
            log.warning("reload: %s change only after a restart", ", ".join(restart))
        if live:
            try:
                self.apply_settings(live)
            except ValueError as exc:
                log.error("reload failed, settings unchanged: %s", exc)
        else:
            log.info("reload: no live setting changed")


def serve(config: Config, config_path: str | None = None, overrides: dict | None = None) -> int:
    """Run a daemon in this process until stopped; returns its exit code.

    A start stopped while a download was under way ends the process here (``os._exit``, after the log is
    flushed): huggingface_hub downloads on worker threads that the interpreter would wait for at exit, for as
    long as a stalled transfer lasts.
    """
    import uvloop

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s front %(message)s")
    front = Front(config, config_path, overrides)
    code = uvloop.run(front.run())
    if front.abandoned_load:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

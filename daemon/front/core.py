"""The front's core: every request's lifecycle and the daemon's state, with no socket, process or loop.

Events in: a validated request (:meth:`FrontCore.admit`), an abort, a
worker's ring records (:meth:`FrontCore.on_ring`), a worker ready, its load
or its exit, a client gone or expired, a timer, new settings, a stop.
Commands out, through :class:`Ports` only: messages to clients
(``send``: "sent", "blocked" or "gone"), commands to workers
(``send_worker``), timers (``call_later``) and the lifecycle's milestones.
The shell (:mod:`ringstream.daemon.front.shell`) owns the sockets, the loop, the
processes and the signals and turns what they say into these calls; unit
tests drive the core with fake ports and records (``tests/daemon/test_core.py``),
as vLLM's scheduler tests drive its scheduler. Dependencies run one way:
shell and intake call the core; the core calls its ports, the scheduler,
the client table and the outbox, never back.

Request statuses: :mod:`ringstream.daemon.front.request`. The shutdown is explicit
states advanced by events: ``DRAINING`` (no new work; running streams
finish) until nothing is open or ``drain_timeout_s`` passes, ``ABORTING``
(the rest aborted; workers confirm) for up to ``ABORT_GRACE_S``,
``FLUSHING`` (terminal messages reach slow readers) for up to
``ABORT_GRACE_S``, then ``STOPPED``. A phase ends as soon as its work is
done: the check runs whenever a request ends or is delivered.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from ringstream.daemon.front.client_table import ClientTable
from ringstream.daemon.common.config import Config
from ringstream.daemon.front.metrics import Metrics, record_worker_load
from ringstream.daemon.front.outbox import Outbox
from ringstream.daemon.front.ports import Ports, Timer
from ringstream.daemon.front.request import DaemonState, Request, RequestStatus
from ringstream.daemon.front.scheduler import Scheduler, SchedulerPolicy, WorkerBudget
from ringstream.daemon.common.settings import change_settings
from ringstream.ipc import protocol as P
from ringstream.ipc.ring import KIND_ERROR, KIND_FINISH, KIND_PROMPT_LOGPROBS, KIND_TOKEN

__all__ = ["ABORT_GRACE_S", "MAX_RESUMES", "FrontCore", "policy_of"]

log = logging.getLogger("ringstream.front")

MAX_RESUMES = 3
"""A request whose worker died this many times ends with WORKER_FAILED instead of resuming again."""
ABORT_GRACE_S = 2.0
"""At shutdown, how long aborted streams get to be confirmed by their worker, and then how long terminal
messages get to reach clients that read slowly."""


def policy_of(config: Config) -> SchedulerPolicy:
    """The scheduler settings a config asks for."""
    return SchedulerPolicy(
        queue_size=config.queue_size, max_concurrency=config.max_concurrency,
        priority_limits=config.priority_limits(), aging_rate=config.aging_rate,
        full_policy=config.queue_full_policy, preemption=config.preemption,
    )


class FrontCore:
    """Requests, their scheduling and streaming, and the daemon's state, driven by events; times are
    ``clock()`` seconds (``time.monotonic`` in the daemon)."""

    def __init__(self, config: Config, ports: Ports, num_workers: int, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.ports = ports
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.state = DaemonState.STARTING
        self.started = clock()
        self.exit_code = 0
        self.clients = ClientTable()
        self.outbox = Outbox(self.clients, ports, self.metrics, clock, self._deliver)
        self.scheduler = Scheduler(policy_of(config))
        self.scheduler.workers = [WorkerBudget(i) for i in range(num_workers)]
        self.worker_loads = [P.WorkerHeartbeat(worker=i, running=0, waiting=0, steps=0) for i in range(num_workers)]
        self.by_handle: dict[int, Request] = {}
        """Every admitted request until its terminal message is recorded."""
        self.tokenizing = 0
        """Requests whose prompt is being tokenised off the loop (the drain waits for them)."""
        self.shutdown_timer: Timer | None = None
        self.aborted_at_shutdown: list[Request] = []
        self.read_time = 0.0

    # ------------------------------------------------------------ admission

    def admit(self, req: Request, connection: int | None) -> None:
        """Queue a validated request (or refuse it: QUEUE_FULL, SHUTTING_DOWN) and register it with its client."""
        if not self.state.accepts_requests:
            self.reject(req, P.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
            return
        accepted, displaced = self.scheduler.add(req)
        if not accepted:
            self.reject(req, P.ErrorCode.QUEUE_FULL, f"queue full ({self.scheduler.num_waiting} waiting)")
            return
        if displaced is not None:
            self.end(displaced, P.Error(id=displaced.id, code=P.ErrorCode.QUEUE_FULL,
                                        message="displaced from the full queue by a more urgent request"))
        self.clients.add(req, connection, self.clock())
        self.by_handle[req.handle] = req
        _note_waiting_for_workers(self)
        self.metrics.admitted.inc()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        self._start_timers(req)
        self.dispatch()

    def reject(self, req: Request, code: P.ErrorCode, message: str) -> None:
        """Refuse a request that was never admitted (it may hold its id while a long prompt is tokenised)."""
        if code in (P.ErrorCode.INVALID_REQUEST, P.ErrorCode.PROMPT_TOO_LONG):
            self.metrics.invalid.inc()
            self.metrics.dropped.labels("invalid").inc()
        req.status, req.final = RequestStatus.FINISHED_ERROR, P.Error(id=req.id, code=code, message=message)
        self.clients.add(req, None, self.clock())  # delivered like any terminal message (held if the client lags)
        self._deliver([req])

    def _start_timers(self, req: Request) -> None:
        """Deadlines: the daemon's defaults, shortened (never lengthened) by the request's own."""
        timeout = min(req.msg.timeout_s or self.config.timeout_s, self.config.timeout_s)
        req.timers.append(self.ports.call_later(timeout, self.abort, req, P.FinishReason.TIMEOUT))
        queue_timeouts = [t for t in (req.msg.queue_timeout_s, self.config.queue_timeout_s) if t]
        if queue_timeouts:
            req.queue_timer = self.ports.call_later(min(queue_timeouts), self._on_queue_timeout, req)

    def _on_queue_timeout(self, req: Request) -> None:
        if self.scheduler.remove(req):
            self.end(req, P.Error(id=req.id, code=P.ErrorCode.QUEUE_TIMEOUT,
                                  message=f"not scheduled within {self.clock() - req.arrival:.3f} s"))

    # ------------------------------------------------------------ scheduling

    def dispatch(self) -> None:
        """Start what fits; then preempt for the most urgent waiting request, and repeat."""
        now = self.clock()
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
            self.ports.send_worker(index, P.Abort(handle=victim.handle))

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
        self.ports.send_worker(index, P.Assign(
            handle=req.handle, prompt_token_ids=req.prompt_token_ids, sampling=req.msg.sampling,
            output_token_ids=req.output_token_ids, priority=req.priority,
        ))

    def _requeue(self, req: Request) -> None:
        """Back to the queue, resumable from the tokens already streamed (ended instead once stopping)."""
        if not self.state.accepts_requests:
            self.finish(req, P.FinishReason.SHUTDOWN)
            return
        req.status = RequestStatus.WAITING
        req.queued_at = self.clock()
        self.scheduler.requeue(req)

    # ------------------------------------------------------------ ending

    def abort(self, req: Request, reason: P.FinishReason) -> None:
        """End a request early: at once if waiting, else after its worker confirms."""
        if req.status >= RequestStatus.ABORTING:
            return
        if self.scheduler.remove(req):
            self.finish(req, reason)
            return
        running = req.status == RequestStatus.RUNNING  # a PREEMPTING one was told to stop already
        req.status, req.abort_reason = RequestStatus.ABORTING, reason
        if running and req.worker is not None:
            self.ports.send_worker(req.worker, P.Abort(handle=req.handle))

    def finish(self, req: Request, reason: P.FinishReason, stop_reason=None, flush: bool = True) -> None:
        """End ``req`` with a terminal Chunk carrying ``reason`` and its usage."""
        usage = req.usage(self.clock())
        self.end(req, P.Chunk(id=req.id, seq=0, finish_reason=reason, stop_reason=stop_reason, usage=usage), flush)

    def end(self, req: Request, final: P.Chunk | P.Error, flush: bool = True) -> None:
        """Record the terminal message; the request leaves every table once it is sent."""
        if req.status.is_finished:
            return
        req.status, req.final = RequestStatus.of(final), final
        status = final.code if isinstance(final, P.Error) else final.finish_reason
        e2e = self.clock() - req.arrival
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
        if flush:  # else the caller delivers (and moves the shutdown on) once its batch is applied
            self._deliver([req])
            self.dispatch()

    # ------------------------------------------------------------ delivery

    def _deliver(self, requests: Iterable[Request] | None = None) -> None:
        """Send what is pending for each request (None: the outbox's retry of what met a full client queue);
        act on clients found gone."""
        if requests is None:
            self.ports.poll_connections()
        for identity in self.outbox.flush(requests) if requests is not None else self.outbox.retry():
            self.client_gone(identity)
        self.advance_shutdown()

    # ------------------------------------------------------------ clients

    def client_gone(self, identity: bytes, why: str = "gone") -> None:
        """The client vanished (unroutable, silent, disconnected): cancel its requests, send nothing."""
        client = self.clients.pop(identity)
        if client is None:
            return
        log.info("client %s %s; cancelling %d request(s)", identity.hex(), why, len(client.requests))
        for req in client.requests.values():
            self.outbox.drop(req)
            req.client = b""
            if not req.status.is_finished:
                self.abort(req, P.FinishReason.CANCELLED)
        self.advance_shutdown()

    def expire_clients(self, now: float) -> None:
        """Housekeeping: end what silent or stuck clients hold (``client_timeout_s``, a live setting)."""
        timeout = self.config.client_timeout_s
        for identity, client, verdict, seconds in self.clients.expired(now, timeout):
            if verdict == "silent":
                self.client_gone(identity, f"silent for {timeout:.1f} s")
            elif verdict == "gone":
                self.client_gone(identity, f"not reading for {seconds:.1f} s")
            else:  # stuck: cancel what it has open; the last chunks wait for it to read again
                open_requests = [r for r in client.requests.values() if r.status < RequestStatus.ABORTING]
                if open_requests:
                    self.metrics.client_events.labels("stuck").inc()
                    log.info("client %s not reading for %.1f s; cancelling %d request(s)", identity.hex(),
                             seconds, len(open_requests))
                for req in open_requests:
                    self.abort(req, P.FinishReason.CANCELLED)

    # ------------------------------------------------------------ workers

    def on_ring(self, batches: Iterable[list]) -> None:
        """Apply one read of a worker's ring: ``batches`` yields lists of records (``ipc.ring`` Record).

        Each batch is applied before the next is asked for (the shell frees the
        ring space between them); then every touched stream gets one Chunk.
        """
        self.read_time = self.clock()
        touched: dict[int, Request] = {}
        tokens = 0
        for records in batches:
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
                    if not self._preemption_done(req, finish):
                        # aborted: the worker confirms with CANCELLED; it may have finished (length, stop) first
                        aborted = req.status == RequestStatus.ABORTING and finish.finish_reason == P.FinishReason.CANCELLED
                        reason = req.abort_reason if aborted else finish.finish_reason
                        self.finish(req, reason, finish.stop_reason, flush=False)
                elif rec.kind == KIND_PROMPT_LOGPROBS:
                    add_prompt_logprobs(req, rec)
                elif rec.kind == KIND_ERROR:
                    error = P.WORKER_ERROR_DECODER.decode(rec.payload)
                    self.end(req, P.Error(id=req.id, code=error.code, message=error.message), flush=False)
                touched[rec.handle] = req
        if tokens:
            self.metrics.generation_tokens.inc(tokens)
        self._deliver(touched.values())
        self.dispatch()

    def _on_token(self, req: Request, rec) -> None:
        if rec.seq != req.next_token_seq:
            log.error("request %s: token seq %d, expected %d; ending it", req.id, rec.seq, req.next_token_seq)
            self.abort(req, P.FinishReason.ERROR)
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
        add_token_payload(req, rec)

    def _preemption_done(self, req: Request, finish: P.Finish) -> bool:
        """A preempted request's worker confirmed the abort: back to the queue, resumable."""
        if req.status != RequestStatus.PREEMPTING or finish.finish_reason != P.FinishReason.CANCELLED:
            return False  # not preempted; or it ended anyway (finished first, or was aborted meanwhile)
        log.info("request %s (priority %d) preempted on worker %d after %d tokens; back in the queue",
                 req.id, req.priority, req.last_worker, len(req.output_token_ids))
        self._requeue(req)
        return True

    def on_worker_ready(self, ready: P.WorkerReady) -> None:
        """A worker (first start or restart) loaded its model: it gets work; all ready: serving."""
        capacity = ready.capacity
        self.scheduler.workers[ready.worker].became_ready(capacity)
        blocks = capacity.kv_cache_tokens // max(capacity.block_size, 1)
        self.worker_loads[ready.worker] = P.WorkerHeartbeat(
            worker=ready.worker, running=0, waiting=0, steps=0, kv_blocks_total=blocks, kv_blocks_free=blocks)
        log.info("worker %d ready on %s (pid %d, %d slots)", ready.worker, ready.device, ready.pid,
                 capacity.max_num_seqs)
        if self.state == DaemonState.STARTING and all(b.ready for b in self.scheduler.workers):
            self.state = DaemonState.SERVING
            log.info("ready: serving in %.1f s", self.clock() - self.started)
            self.ports.ready()
        self.dispatch()

    def on_worker_load(self, beat: P.WorkerHeartbeat) -> None:
        """A worker's heartbeat: its KV figures for the gauges and status."""
        record_worker_load(self.metrics, self.worker_loads[beat.worker], beat)
        self.worker_loads[beat.worker] = beat

    def on_worker_start_failed(self, refused: bool = False) -> None:
        """A worker could not load its model: fatal while starting, exit 2 when the engine ``refused`` the model
        (no retry fixes it), else 1; once serving, its restart retries with backoff instead."""
        if self.state == DaemonState.STARTING:
            self.request_stop(exit_code=2 if refused else 1)

    def on_worker_exit(self, index: int, last_records: Iterable[list] = ()) -> bool:
        """Worker ``index`` exited: apply what it published last (``last_records``, as :meth:`on_ring`
        takes them; no new work goes to it meanwhile), then resume its requests elsewhere, or end them.

        Returns True when the worker should be restarted (the daemon is serving).
        """
        self.scheduler.workers[index].ready = False
        self.on_ring(last_records)
        orphans = self.scheduler.clear_worker(index)
        # Preempted (or aborted while preempting) there, not charged any more, awaiting a confirmation that
        # will never come:
        orphans += [r for r in self.by_handle.values() if r.worker is None and r.last_worker == index
                    and r.status in (RequestStatus.PREEMPTING, RequestStatus.ABORTING)]
        for req in orphans:
            req.worker_failures += 1
            if req.status == RequestStatus.ABORTING:
                self.finish(req, req.abort_reason)
            elif req.worker_failures > MAX_RESUMES or self.state != DaemonState.SERVING:
                self.end(req, P.Error(id=req.id, code=P.ErrorCode.WORKER_FAILED,
                                      message=f"worker {index} exited {req.worker_failures} time(s) "
                                              f"while running this request"))
            else:
                self._requeue(req)  # resumes from prompt + tokens already streamed, on a live worker
        restart = self.state == DaemonState.SERVING
        if self.state == DaemonState.STARTING:
            self.request_stop(exit_code=1)
        self.dispatch()
        return restart

    # ------------------------------------------------------------ settings

    def apply_settings(self, changes: dict) -> list[str]:
        """Change live settings (names in ``settings.LIVE_SETTINGS``); all or nothing.

        Returns notes on what takes effect differently from what was asked.
        Raises ValueError naming the problem.
        """
        slots = [b.capacity.max_num_seqs for b in self.scheduler.workers if b.ready]
        result = change_settings(self.config, changes, slots)
        for note in result.notes:
            log.warning("settings: %s", note)
        if result.changed:
            self.config = result.config
            self.scheduler.set_policy(policy_of(result.config))
            logging.getLogger("ringstream").setLevel(result.config.log_level.upper())
            log.info("settings changed: %s", ", ".join(f"{k}={v}" for k, v in result.changed.items()))
            self.dispatch()
        else:
            log.info("settings unchanged (%s already in force)", ", ".join(sorted(changes)) or "nothing asked")
        return list(result.notes)

    # ------------------------------------------------------------ shutdown

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin the graceful stop (a signal, a start failure): refuse new work, end the waiting; a second
        stop while draining aborts the running streams at once (as a second Ctrl-C does)."""
        if self.state == DaemonState.DRAINING:
            log.info("stopping now: aborting %d running stream(s)", len(self.by_handle))
            self._begin_abort()
            return
        if self.state not in (DaemonState.STARTING, DaemonState.SERVING):
            return
        log.info("stopping: draining %d stream(s) (up to %.0f s)", self.scheduler.num_running, self.config.drain_timeout_s)
        self.exit_code = self.exit_code or exit_code
        self.ports.stopping()
        self.outbox.watch_lag()
        self.state = DaemonState.DRAINING
        for req in self.scheduler.waiting():
            self.scheduler.remove(req)
            self.end(req, P.Error(id=req.id, code=P.ErrorCode.SHUTTING_DOWN, message="daemon is shutting down"))
        self._next_phase(self.config.drain_timeout_s, self._begin_abort)

    def _begin_abort(self) -> None:
        """Drain over (nothing left, or its deadline): abort what still runs; their workers get ABORT_GRACE_S."""
        self.state = DaemonState.ABORTING
        self.aborted_at_shutdown = [r for r in self.by_handle.values()
                                    if r.worker is not None or r.status == RequestStatus.PREEMPTING]
        for req in self.aborted_at_shutdown:
            self.abort(req, P.FinishReason.SHUTDOWN)
        self._next_phase(ABORT_GRACE_S, self._begin_flush)

    def _begin_flush(self) -> None:
        """Aborts confirmed (or their grace is over): end the rest; deliver terminal messages for ABORT_GRACE_S."""
        self.state = DaemonState.FLUSHING
        for req in self.aborted_at_shutdown:
            if not req.status.is_finished:
                self.finish(req, P.FinishReason.SHUTDOWN)
        self.aborted_at_shutdown = []
        self._next_phase(ABORT_GRACE_S, self._stopped)

    def _stopped(self) -> None:
        self.shutdown_timer.cancel()
        self.state = DaemonState.STOPPED
        self.ports.stopped()

    def _next_phase(self, deadline_s: float, begin: Callable[[], None]) -> None:
        """Arm the current phase's deadline (which begins the next), then check whether it is done already."""
        if self.shutdown_timer is not None:
            self.shutdown_timer.cancel()
        self.shutdown_timer = self.ports.call_later(deadline_s, begin)
        self.advance_shutdown()

    def advance_shutdown(self) -> None:
        """Move the shutdown on when its phase's work is done (called after anything ends or is delivered)."""
        match self.state:
            case DaemonState.DRAINING if not self.by_handle and not self.tokenizing:
                self._begin_abort()
            case DaemonState.ABORTING if all(r.status.is_finished for r in self.aborted_at_shutdown):
                self._begin_flush()
            case DaemonState.FLUSHING if not self.outbox.blocked and not self.outbox.lagged:
                # A client that lagged during the stop keeps the whole grace: what the socket queued for
                # it (up to its high-water mark) is delivered only as it reads, and closing drops it.
                self._stopped()


def add_token_payload(req: Request, rec) -> None:
    """A TOKEN record's payload becomes pending for ``req``'s next chunk: its text, and with
    ``FLAG_LOGPROBS`` (a :class:`ringstream.ipc.protocol.TokenPayload`) its logprobs too."""
    if not rec.flags & P.FLAG_LOGPROBS:
        if rec.payload:
            req.pending_text.append(rec.payload.decode())
        return
    token = P.TOKEN_PAYLOAD_DECODER.decode(rec.payload)
    req.pending_logprobs.append(P.TokenLogprob(rec.token_id, token.logprob, token.top))
    if token.text:
        req.pending_text.append(token.text)


def add_prompt_logprobs(req: Request, rec) -> None:
    """A PROMPT_LOGPROBS record: a slice of ``req``'s prompt logprobs from prompt position ``rec.seq``.

    The first slice (``seq`` 1: a prefill computed again after a preemption
    starts over) puts the first prompt token's None in front.
    """
    entries = P.PROMPT_LOGPROBS_DECODER.decode(rec.payload)
    if rec.seq == 1 or req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    req.prompt_logprobs += entries


def _note_waiting_for_workers(core: FrontCore) -> None:
    """During the start, for the first request admitted: log that requests wait in the queue for a worker."""
    if core.state != DaemonState.STARTING or len(core.by_handle) != 1:
        return
    bound = f"{core.config.queue_timeout_s:g} s" if core.config.queue_timeout_s else "no bound"
    log.info("starting: requests wait in the queue until a worker is ready (bounded by their queue_timeout_s, "
             "%s by default)", bound)

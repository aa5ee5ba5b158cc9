"""Worker process: one per device; runs the engine and writes tokens to its ring.

The worker moves messages between its command socket and the engine at step
boundaries (sockets stay out of the engine loop):

1. take every pending command (``Assign``, ``Abort``, ``RingSpace``,
   ``Shutdown``) without blocking while there is work, or block up to one
   heartbeat period when idle;
2. run one engine step;
3. write one TOKEN record per output (and a FINISH record for a request that
   ended) into the ring (a request that asks for logprobs gets them in its
   TOKEN records' payload, flag ``FLAG_LOGPROBS``, and its prompt logprobs in
   PROMPT_LOGPROBS records before its first TOKEN record), publish them at once, and ring the front's doorbell
   only when the front sleeps on it.

When the ring is full the worker waits for a ``RingSpace`` doorbell: nothing is
ever overwritten. It exits when told to, on SIGTERM, or when the front dies
(``PR_SET_PDEATHSIG`` plus a parent-pid check each loop). Until it has
started, SIGTERM (the front's death included) ends it at once, so a worker of
a dead front never reports to, or takes commands from, the next one.

Test hook: the environment variable ``RINGSTREAM_FAULT_INJECT`` (read only
when set, for fault-injection tests) makes engine steps fail on purpose, see
:class:`FaultInjector`. Production deployments leave it unset.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

import zmq

from ringstream.daemon.engine.interface import EngineRequest, PromptTooLong, RequestError
from ringstream.daemon.common.model_dir import ModelRefused
from ringstream.daemon.common.proctitle import set_process_title, worker_title
from ringstream.daemon.worker.faults import FAULT_INJECT_ENV, FaultInjector
from ringstream.daemon.worker.malloc_tuning import release_free_memory, retain_freed_memory
from ringstream.daemon.worker.spec import WorkerSpec
from ringstream.ipc import protocol as P
from ringstream.ipc.ring import KIND_ERROR, KIND_FINISH, KIND_PROMPT_LOGPROBS, KIND_TOKEN, RingProducer

log = logging.getLogger("ringstream.worker")

PR_SET_PDEATHSIG = 1
WAIT_SPACE_POLL_MS = 1000
"""While waiting for ring space, re-check that the front lives this often."""

PROMPT_LOGPROBS_RECORD_BYTES = 40_000
"""Rough payload size of one PROMPT_LOGPROBS record (well under the ring's ``MAX_PAYLOAD``)."""

FINISH_FLAGS = {reason: i for i, reason in enumerate(P.FinishReason)}
"""FINISH record ``flags``: the finish reason's index (the payload has it in full)."""


class FrontGone(Exception):
    """The front process died or asked the worker to stop."""


class DeviceLost(RuntimeError):
    """The engine's device context is unusable after a sticky error; the worker exits for a restart."""


STICKY_DEVICE_ERRORS = (
    "illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
    "misaligned address", "illegal instruction", "uncorrectable ecc error", "cublas_status_execution_failed",
    "launch timed out", "hardware stack error",
)
"""Words of CUDA errors after which the context is unusable ("sticky": every later call fails the same way;
CUDA runtime API, ``cudaErrorIllegalAddress``, ``cudaErrorAssert``, ``cudaErrorLaunchFailure``, ...). An
out-of-memory error is not among them: the context survives it."""


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by an engine step) leaves the CUDA context unusable: a CUDA error of
    :data:`STICKY_DEVICE_ERRORS` (torch raises them as ``torch.AcceleratorError`` or ``RuntimeError``), not an
    out-of-memory error."""
    torch = sys.modules.get("torch")  # a worker without torch (the synthetic engine) has no device to lose
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    message = str(exc).lower()
    return "cuda" in message and any(words in message for words in STICKY_DEVICE_ERRORS)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of the spawned worker process; exits the process when done."""
    set_process_title(worker_title(spec.index, spec.engine.device))
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker{spec.index} %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front drains
    _die_with_parent()
    if os.getppid() != spec.parent_pid:
        sys.exit(0)  # the front died before the death signal was armed
    worker = Worker(spec)
    code = 0
    try:
        worker.run()
    except FrontGone:
        pass
    except Exception:
        log.exception("worker failed")
        code = 1
    finally:
        worker.close()
    sys.exit(code)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        log.debug("prctl unavailable; relying on the parent-pid check")


class Worker:
    """The loop of one worker process; see the module docstring."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.stopping = False
        self.ctx = zmq.Context()
        # Commands never reconnect: the path is bound by our front before we start, and once it is gone a
        # new daemon of the same instance may bind it again; a worker of the old one must not be handed its
        # commands (ZeroMQ would load-balance them to us). Events keep reconnecting: a PUSH without a peer
        # blocks its sends, which would keep a worker of a dead front from ever reaching its exit check.
        self.commands = self.ctx.socket(zmq.PULL)
        self.commands.setsockopt(zmq.RECONNECT_IVL, -1)
        self.commands.connect(spec.command_address)
        self.events = self.ctx.socket(zmq.PUSH)
        self.events.setsockopt(zmq.LINGER, 1000)
        self.events.connect(spec.event_address)
        self.engine = None
        self.ring: RingProducer | None = None
        self.handles: set[int] = set()
        self.deferred: list = []
        self.waiting_space = False
        self.unpublished = False
        self.steps = 0
        self.release_when_idle = False
        """Whether the heap's free pages are handed back when the engine goes idle (:mod:`.malloc_tuning`)."""
        self.next_heartbeat = 0.0
        self.fault: FaultInjector | None = None
        self.kv_events = None
        """The KV events publisher (:mod:`ringstream.daemon.worker.kv_events`) when the spec asks for one."""

    def _on_sigterm(self, signum, frame) -> None:
        self.stopping = True

    def close(self) -> None:
        if self.kv_events is not None:
            try:
                self._publish_kv_events()  # a stop right after a failed step: its changes still go out
            except Exception:  # noqa: BLE001 (closing: the engine may be half gone)
                log.debug("KV events: the last changes could not be taken", exc_info=True)
            self.kv_events.close()
        if self.ring is not None:
            self.ring.close()
        self.commands.close(linger=0)
        self.events.close()
        self.ctx.term()

    def _send(self, message) -> None:
        self.events.send(P.encode(message))

    def _enter(self, phase: str) -> None:
        """Tell the front which phase of the start this worker is in (``ringstream status`` shows it)."""
        self._send(P.WorkerStarting(worker=self.spec.index, phase=phase))

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        """Load the model, build and warm the engine, attach the ring, report ready."""
        spec = self.spec
        try:
            self.fault = FaultInjector.from_env(spec.index)
            self.engine = self._build_engine()
            started = time.monotonic()
            self._enter("warming up")
            log.info("warming up and checking the engine against the model's own forward")
            self.engine.warmup()
            log.info("warm-up and start check done in %.1f s", time.monotonic() - started)
            if self.fault is not None:
                log.warning("test hook %s active: %s", FAULT_INJECT_ENV, self.fault.describe())
                self.engine.step = self.fault.wrap(self.engine.step)
            if os.getppid() != spec.parent_pid:
                raise FrontGone  # the front that started this worker is gone: report nothing to a successor
            self.ring = RingProducer.attach(spec.ring_name, instance_id=spec.ring_instance_id)
            if spec.kv_events is not None:
                self._start_kv_events(spec.kv_events)
        except FrontGone:
            raise
        except Exception as exc:
            log.error("cannot start on %s: %s", spec.engine.device, exc)
            self._send(P.WorkerStartFailed(worker=spec.index, message=f"{type(exc).__name__}: {exc}",
                                           refused=isinstance(exc, ModelRefused)))
            raise FrontGone from exc
        self._report_ready()

    def _start_kv_events(self, kv_spec) -> None:
        """Bind the KV events sockets and start recording the prefix cache's changes (after the warmup, whose
        blocks are gone). RuntimeError naming the endpoint when it cannot be bound."""
        from ringstream.daemon.worker.kv_events import KVEventPublisher

        if not self.engine.enable_prefix_caching:
            log.warning("KV events: prefix caching is off, so the cache keeps no blocks to publish; publishing "
                        "only the initial clear on %s", kv_spec.endpoint)
        try:
            self.kv_events = KVEventPublisher(kv_spec, self.ctx)
        except zmq.ZMQError as exc:
            raise RuntimeError(f"cannot bind the KV events endpoint {kv_spec.endpoint}"
                               f"{'' if kv_spec.replay_endpoint is None else ' or ' + kv_spec.replay_endpoint}: "
                               f"{exc}") from None
        self.engine.record_kv_events()
        log.info("KV events on %s%s (rank %d)", kv_spec.endpoint,
                 "" if kv_spec.replay_endpoint is None else f", replay on {kv_spec.replay_endpoint}", kv_spec.rank)

    def _build_engine(self):
        """The engine the spec asks for: the synthetic one (no torch), else the paged engine over the model."""
        from ringstream.daemon.common.model_dir import check_tokenizer_vocab, load_tokenizer, resolve_model_dir

        config = self.spec.engine
        info = resolve_model_dir(self.spec.model_path, config.max_model_len)
        if config.backend == "synthetic":  # no torch: the synthetic engine starts in a fraction of a second
            from ringstream.daemon.engine.synthetic import SyntheticEngine

            return SyntheticEngine(
                max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len or info.max_model_len,
                step_time_s=config.synthetic_step_s, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
            )
        started = time.monotonic()
        log.info("started (pid %d); importing torch and transformers", os.getpid())
        self._enter("importing torch")
        import torch
        from transformers.utils import logging as hf_logging

        from ringstream.daemon.engine.engine import Engine
        from ringstream.daemon.engine.loader import load_model

        log.info("imported in %.1f s", time.monotonic() - started)

        hf_logging.disable_progress_bar()
        tokenizer = load_tokenizer(info)
        check_tokenizer_vocab(tokenizer, info)  # before the weights: a refusal in a second, naming both sizes
        if config.device == "cpu":
            # before the weights: a step's activations reuse the last step's pages; given back when idle
            self.release_when_idle = retain_freed_memory()
            if config.threads:
                torch.set_num_threads(config.threads)
        elif not torch.cuda.is_available() or int(config.device.split(":")[1]) >= torch.cuda.device_count():
            raise RuntimeError(f"device {config.device} is not available on this host")
        else:  # this worker's GPU is the current one: a library's bare "cuda" opens no context on GPU 0
            torch.cuda.set_device(torch.device(config.device))
        started = time.monotonic()
        shards = sorted(info.path.glob("*.safetensors"))
        log.info("loading the weights of %s on %s as %s (%.0f MiB in %d file(s))", info.path, config.device,
                 config.dtype, sum(f.stat().st_size for f in shards) / 2**20, len(shards))
        self._enter("loading weights")
        model = load_model(info, device=config.device, dtype=config.dtype)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("weights loaded in %.1f s (%.0f MiB); sizing the KV cache", time.monotonic() - started,
                 weights / 2**20)
        started = time.monotonic()
        self._enter("sizing the KV cache")
        engine = Engine(model, tokenizer, config, eos_token_ids=info.eos_token_ids)
        log.info("KV cache sized in %.1f s", time.monotonic() - started)
        return engine

    def _report_ready(self) -> None:
        engine, spec = self.engine, self.spec
        capacity = engine.capacity()
        self._send(P.WorkerReady(worker=spec.index, pid=os.getpid(), device=spec.engine.device, capacity=capacity))
        log.info("ready on %s: max_num_seqs=%d max_model_len=%d, KV cache %d blocks of %d tokens (%.1f MiB)",
                 spec.engine.device, capacity.max_num_seqs, capacity.max_model_len, engine.stats().num_blocks,
                 capacity.block_size, capacity.kv_cache_bytes / 2**20)

    # ---------------------------------------------------------------- loop

    def run(self) -> None:
        self.start()
        signal.signal(signal.SIGTERM, self._on_sigterm)  # from now on: finish the step, then exit
        if self.stopping or os.getppid() != self.spec.parent_pid:
            raise FrontGone
        engine = self.engine
        idle_ms = int(self.spec.heartbeat_s * 1000)
        stepped = False  # since the last release of free heap pages
        while True:
            self._check_alive()
            while self.deferred:
                self._apply(self.deferred.pop(0))
            busy = engine.has_unfinished()
            self._take_commands(0 if busy else idle_ms)
            if not engine.has_unfinished():
                self._publish()  # records written by commands alone (e.g. an abort's FINISH)
                self._publish_kv_events()
                if stepped and self.release_when_idle:
                    release_free_memory()  # a burst's high-water mark back to the system, once per idle spell
                stepped = False
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                if device_lost(exc):
                    # Every later call on this context fails the same way: exit, so that the pool starts a
                    # fresh process (a new context) and resumes these streams, as after a crash.
                    log.critical("device error that poisons the CUDA context; exiting for a restart: %s", exc)
                    raise DeviceLost(str(exc)) from exc
                log.exception("engine step failed; failing %d requests", len(self.handles))
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self._publish_kv_events()  # what the failed step cached or evicted before it failed
                continue
            self.steps += 1
            stepped = True
            for out in outputs:
                self._write_output(out)
            self._publish()
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last call to the KV events publisher (when there is one)."""
        if self.kv_events is not None:
            events = self.engine.take_kv_events()
            if events:
                self.kv_events.publish(events)

    def _check_alive(self) -> None:
        if self.stopping or os.getppid() != self.spec.parent_pid:
            raise FrontGone
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.spec.heartbeat_s
            engine = self.engine
            stats = engine.stats()
            self._send(P.WorkerHeartbeat(
                worker=self.spec.index, running=stats.num_running, waiting=stats.num_waiting, steps=self.steps,
                kv_blocks_total=stats.num_blocks, kv_blocks_free=stats.num_free_blocks,
                preemptions=stats.num_preemptions, prefix_cache_queries=stats.prefix_queries,
                prefix_cache_hits=stats.prefix_hits,
            ))

    def _take_commands(self, timeout_ms: int) -> bool:
        """Handle every queued command; wait up to ``timeout_ms`` for the first.

        Returns True if a ``RingSpace`` doorbell was among them.
        """
        space = False
        if timeout_ms and not self.commands.poll(timeout_ms):
            return False
        while True:
            try:
                frame = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return space
            match P.COMMAND_DECODER.decode(frame):
                case P.RingSpace():
                    space = True
                case P.Shutdown():
                    raise FrontGone
                case command if self.waiting_space:
                    self.deferred.append(command)
                case command:
                    self._apply(command)

    def _apply(self, command) -> None:
        """Apply an Assign or Abort (between steps, never while a write waits)."""
        match command:
            case P.Assign():
                self._assign(command)
            case P.Abort(handle=handle):
                if self.engine.abort(handle):
                    self.handles.discard(handle)
                    self._write_finish(handle, 0, P.Finish(finish_reason=P.FinishReason.CANCELLED))

    def _assign(self, cmd: P.Assign) -> None:
        try:
            self.engine.add(EngineRequest(cmd.handle, cmd.prompt_token_ids, cmd.sampling, cmd.output_token_ids,
                                          cmd.priority))
        except PromptTooLong as exc:
            self._write_error(cmd.handle, P.ErrorCode.PROMPT_TOO_LONG, str(exc))
            return
        except ValueError as exc:
            self._write_error(cmd.handle, P.ErrorCode.INVALID_REQUEST, str(exc))
            return
        except Exception as exc:
            self._write_error(cmd.handle, P.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        self.handles.add(cmd.handle)

    def _fail_all(self, message: str) -> None:
        for handle in list(self.handles):
            self.engine.abort(handle)
            self._write_error(handle, P.ErrorCode.WORKER_FAILED, message)
        self.handles.clear()
        self._publish()

    # ---------------------------------------------------------------- ring

    def _write_output(self, out) -> None:
        if isinstance(out, RequestError):  # that request's step failed; the others go on
            self.handles.discard(out.handle)
            self._write_error(out.handle, P.ErrorCode.INVALID_REQUEST if out.invalid else P.ErrorCode.INTERNAL,
                              out.message)
            return
        if out.prompt_logprobs is not None:
            self._write_prompt_logprobs(out.handle, out.prompt_logprobs)
        if out.logprobs is None:
            self._write(KIND_TOKEN, 0, out.handle, out.seq, out.token_id, out.text.encode())
        else:
            payload = P.encode(P.TokenPayload(text=out.text, logprob=out.logprobs.logprob, top=out.logprobs.top))
            self._write(KIND_TOKEN, P.FLAG_LOGPROBS, out.handle, out.seq, out.token_id, payload)
        if out.finish_reason is not None:
            self.handles.discard(out.handle)
            self._write_finish(out.handle, out.seq + 1, P.Finish(
                finish_reason=P.FinishReason(out.finish_reason), stop_reason=out.stop_reason,
                prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
            ))

    def _write_prompt_logprobs(self, handle: int, entries: list) -> None:
        """PROMPT_LOGPROBS records of ``entries`` (prompt tokens 1, 2, ...), ``seq`` the index of each slice's first."""
        top = len(entries[0].top) if entries else 0
        per_record = max(1, PROMPT_LOGPROBS_RECORD_BYTES // (24 + 16 * top))
        for start in range(0, len(entries), per_record):
            self._write(KIND_PROMPT_LOGPROBS, 0, handle, start + 1, 0,
                        P.encode(entries[start:start + per_record]))

    def _write_finish(self, handle: int, seq: int, finish: P.Finish) -> None:
        self._write(KIND_FINISH, FINISH_FLAGS[finish.finish_reason], handle, seq, 0, P.encode(finish))

    def _write_error(self, handle: int, code: P.ErrorCode, message: str) -> None:
        payload = P.encode(P.WorkerError(code=code, message=message[:1000]))
        self._write(KIND_ERROR, 0, handle, 0, 0, payload)

    def _write(self, kind: int, flags: int, handle: int, seq: int, token_id: int, payload: bytes) -> None:
        """Append one record, waiting (never overwriting) while the ring is full."""
        ring = self.ring
        while not ring.try_write(kind, flags, handle, seq, token_id, payload):
            self._publish()
            if ring.arm_space(ring.record_size(len(payload))):
                self._wait_space()
            ring.disarm_space()
        self.unpublished = True

    def _wait_space(self) -> None:
        """Block until the front frees ring space; Assign/Abort wait for the step's end."""
        self.waiting_space = True
        try:
            while not self._take_commands(WAIT_SPACE_POLL_MS):
                self._check_alive()
        finally:
            self.waiting_space = False

    def _publish(self) -> None:
        if self.unpublished:
            self.unpublished = False
            if self.ring.publish():
                self._send(P.Doorbell(worker=self.spec.index))

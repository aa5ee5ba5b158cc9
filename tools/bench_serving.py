"""Serving-layer measurements: a real daemon under test, the raw ZeroMQ ceiling, idle CPU.

* :func:`running_daemon` is the daemon under test: a
  :class:`ringstream.daemon.launcher.DaemonProcess` on a private ipc
  socket, instance name and runtime directory, ready on enter, stopped on
  exit with nothing left behind.
* :func:`synthetic_engine_support` tells whether this ringstream's ``serve``
  has ``--engine synthetic`` and ``--synthetic-step-ms``.
* :func:`zmq_ceiling` measures how many small msgpack-encoded
  ``ringstream.ipc.protocol.Chunk`` messages one ZeroMQ DEALER in one process can push
  to a ROUTER in another over an ipc socket, each encoded by the sender and
  decoded by the receiver: the most any single socket of the serving layer
  could carry, whatever else it does.
* :func:`loadgen_ceiling` runs the load generator against a stub daemon in
  another process that answers every request at once with ``max_tokens``
  one-token chunks: the most the load generator itself can consume, to show
  it is not what limits a measurement.
* :func:`idle_cpu_percent` measures the CPU a process tree uses while idle.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HELP_TIMEOUT_S = 60.0
"""Bound on ``ringstream serve --help`` (it imports the CLI only)."""
CHILD_EXIT_S = 5.0
"""The measuring processes get this long to exit after they are told to."""
ZMQ_DEFAULT_MESSAGES = 200_000
ZMQ_READY_TIMEOUT_S = 30.0
ZMQ_HWM = 0
"""High-water mark of the ceiling's sockets: 0 = unbounded, nothing is dropped or blocked."""
ZMQ_SAMPLE_CHUNK = dict(id="bench-0123abcd-17", seq=12, text=" t12", token_ids=[1234])
"""Fields of the ceiling's messages: a one-token chunk, as the daemon streams them."""
IDLE_SAMPLE_S = 3.0
STUB_VERSION = "stub"
STUB_POLL_MS = 100
"""The stub daemon checks this often whether it was told to stop."""


def toml_value(value: object) -> str:
    """A str, int, float or bool as a TOML value (strings as JSON-escaped basic strings, which TOML accepts).

    Raises:
        TypeError: another type.
    """
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")


def write_config(directory: Path, settings: dict[str, object]) -> Path:
    """Write ``settings`` (str, int, float, bool values) as a TOML config file; returns its path."""
    path = directory / "bench.toml"
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items()), encoding="utf-8")
    return path


def running_daemon(args: list[str]) -> "DaemonProcess":
    """The daemon of ``ringstream serve ARGS`` under test; use it as a context manager (ready on enter).

    It gets a fresh runtime directory (``XDG_RUNTIME_DIR``), instance name
    and ipc socket, so it never meets another instance.

    Raises (on enter):
        DaemonStartError: the daemon exited or was not ready within its start timeout.
    """
    from ringstream.daemon.launcher import DaemonProcess

    return DaemonProcess(*args, prefix="bench")


def private_rss_bytes(pid: int) -> int:
    """Resident private anonymous memory of process ``pid`` (``RssAnon``), bytes: RSS without files and shared
    memory such as the rings. Raises OSError if the process is gone, RuntimeError if the kernel reports no RssAnon."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def synthetic_engine_support() -> str | None:
    """None if ``ringstream serve`` accepts ``--engine synthetic --synthetic-step-ms``, else the reason it does not."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ringstream.daemon.cli", "serve", "--help"],
            capture_output=True, text=True, timeout=HELP_TIMEOUT_S, check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run 'ringstream serve --help': {exc}"
    if "synthetic" not in out or "--synthetic-step-ms" not in out:
        return "'ringstream serve' has no '--engine synthetic' / '--synthetic-step-ms' option yet"
    return None


def process_cpu_seconds(proc: psutil.Process) -> float:
    """CPU time of a live process's threads, seconds; 0 if it is gone.

    Reads the nanosecond on-CPU time of each thread from Linux's
    ``/proc/PID/task/TID/schedstat`` (first field); elsewhere, or if that is
    unreadable, falls back to ``psutil``'s user + system time, which counts
    in clock ticks (10 ms), too coarse for an idle process over a few seconds.
    """
    total = 0.0
    try:
        for entry in os.scandir(f"/proc/{proc.pid}/task"):
            with open(f"{entry.path}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0]) / 1e9
        return total
    except (OSError, ValueError, IndexError):
        pass
    try:
        times = proc.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def idle_cpu_percent(processes: list[psutil.Process], seconds: float = IDLE_SAMPLE_S) -> float:
    """CPU used by ``processes`` together over ``seconds`` of wall time, percent of one core.

    Processes that exit meanwhile count for the time they lived.
    """
    before = {proc.pid: process_cpu_seconds(proc) for proc in processes}
    start = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - start
    used = sum(max(0.0, process_cpu_seconds(proc) - before[proc.pid]) for proc in processes)
    return 100.0 * used / elapsed


def _zmq_receiver(address: str, messages: int, conn) -> None:
    """Ceiling receiver: bind a ROUTER, decode ``messages`` chunks, report ``(first, last)`` arrival times."""
    import zmq

    from ringstream.ipc import protocol as P

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    conn.send("bound")
    decode = P.SERVER_DECODER.decode
    recv = sock.recv_multipart
    _, frame = recv()
    decode(frame)
    first = time.perf_counter()
    for _ in range(messages - 1):
        _, frame = recv()
        decode(frame)
    last = time.perf_counter()
    conn.send((first, last))
    sock.close()
    ctx.term()


def _zmq_sender(address: str, messages: int, conn) -> None:
    """Ceiling sender: connect a DEALER and send ``messages`` encoded chunks as fast as it can."""
    import zmq

    from ringstream.ipc import protocol as P

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(address)
    conn.recv()
    chunk = P.Chunk(**ZMQ_SAMPLE_CHUNK)
    encode = P.encode
    send = sock.send
    for seq in range(messages):
        chunk.seq = seq
        send(encode(chunk))
    sock.close()
    ctx.term()


def zmq_ceiling(messages: int = ZMQ_DEFAULT_MESSAGES) -> dict:
    """Messages per second from a DEALER process to a ROUTER process (see the module docstring).

    Returns ``{"msg_s", "messages", "seconds", "message_bytes", "transport"}``;
    the rate is measured at the receiver, first to last message.

    Raises:
        RuntimeError: a side failed or timed out.
    """
    from ringstream.ipc import protocol as P

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ringstream-zmq-") as tmp:
        address = f"ipc://{tmp}/ceiling.sock"
        recv_parent, recv_child = ctx.Pipe()
        send_parent, send_child = ctx.Pipe()
        receiver = ctx.Process(target=_zmq_receiver, args=(address, messages, recv_child), daemon=True)
        sender = ctx.Process(target=_zmq_sender, args=(address, messages, send_child), daemon=True)
        receiver.start()
        sender.start()
        try:
            if not recv_parent.poll(ZMQ_READY_TIMEOUT_S):
                raise RuntimeError("zmq ceiling: the receiver did not start")
            recv_parent.recv()
            send_parent.send("go")
            budget = ZMQ_READY_TIMEOUT_S + messages * 1e-4
            if not recv_parent.poll(budget):
                raise RuntimeError(f"zmq ceiling: {messages} messages not received within {budget:.0f} s")
            first, last = recv_parent.recv()
        finally:
            for proc in (sender, receiver):
                proc.join(CHILD_EXIT_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    seconds = last - first
    return {
        "msg_s": (messages - 1) / seconds if seconds > 0 else 0.0,
        "messages": messages,
        "seconds": seconds,
        "message_bytes": len(P.encode(P.Chunk(**ZMQ_SAMPLE_CHUNK))),
        "transport": "ipc",
    }


def _stub_daemon(address: str, stop, conn) -> None:
    """A stand-in daemon for :func:`loadgen_ceiling`: answers instantly, computes nothing.

    ``Status`` gets a ready ``StatusReply``, ``Heartbeat`` a ``HeartbeatAck``,
    ``Generate`` its ``max_tokens`` chunks of one token each (the synthetic
    engine's ids and text), the last with ``finish_reason="length"`` and
    ``usage``; ``Cancel`` is ignored (every stream is already complete).
    """
    import zmq

    from ringstream.daemon.engine.synthetic import synthetic_text
    from ringstream.ipc import protocol as P

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    conn.send("bound")
    ready = P.encode(P.StatusReply(
        version=STUB_VERSION, ready=True, state="serving", uptime_s=0.0, waiting=0, running=0, queue_size=0,
        max_concurrency=0, requests_total=0, tokens_generated_total=0, workers=[],
    ))
    ack = P.encode(P.HeartbeatAck())
    while not stop.is_set():
        if not sock.poll(STUB_POLL_MS):
            continue
        identity, frame = sock.recv_multipart()
        match P.CLIENT_DECODER.decode(frame):
            case P.Status():
                sock.send_multipart((identity, ready))
            case P.Heartbeat():
                sock.send_multipart((identity, ack))
            case P.Generate(id=rid, sampling=P.SamplingParams(max_tokens=count), prompt_token_ids=ids):
                for seq in range(count):
                    chunk = P.Chunk(id=rid, seq=seq, text=synthetic_text(seq), token_ids=[seq])
                    if seq == count - 1:
                        chunk.finish_reason = P.FinishReason.LENGTH
                        chunk.usage = P.Usage(prompt_tokens=len(ids or ()), completion_tokens=count)
                    sock.send_multipart((identity, P.encode(chunk)))
    sock.close()
    ctx.term()


def loadgen_ceiling(config, workload) -> dict:
    """Run the load generator (``ringstream.tools.loadgen.LoadConfig``, address ignored) against a stub daemon.

    Returns ``{"tok_s", "req_s", "requests", "order_violations"}``.

    Raises:
        RuntimeError: the stub did not start.
    """
    from dataclasses import replace

    from ringstream.tools.bench_stats import summarize
    from ringstream.tools.loadgen import run_load

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ringstream-stub-") as tmp:
        address = f"ipc://{tmp}/stub.sock"
        stop = ctx.Event()
        parent_conn, child_conn = ctx.Pipe()
        stub = ctx.Process(target=_stub_daemon, args=(address, stop, child_conn), daemon=True)
        stub.start()
        try:
            if not parent_conn.poll(ZMQ_READY_TIMEOUT_S):
                raise RuntimeError("load generator ceiling: the stub daemon did not start")
            parent_conn.recv()
            result = run_load(replace(config, address=address, check_text=True), workload)
        finally:
            stop.set()
            stub.join(CHILD_EXIT_S)
            if stub.is_alive():
                stub.kill()
                stub.join()
    summary = summarize(result.records)
    return {
        "tok_s": summary["tok_s"],
        "req_s": summary["req_s"],
        "requests": summary["requests"],
        "order_violations": summary["order_violations"],
        "content_errors": summary["content_errors"],
    }

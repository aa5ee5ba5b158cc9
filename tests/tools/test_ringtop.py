"""Tests for tools.ringtop (``ringstream-top``), with and without a daemon."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client
from ringstream.ipc.ring import (
    KIND_ERROR,
    KIND_FINISH,
    KIND_TOKEN,
    SHM_DIR,
    Record,
    RingConsumer,
    RingObserver,
    RingProducer,
)
from ringstream.tools import ringtop
from ringstream.tools.ringtop_keys import KEYS_HELP, VIEW_RINGS, VIEW_SERVING, handle_keys
from ringstream.tools.ringtop_serving import StatusPoller, render_serving

REPO_ROOT = Path(__file__).resolve().parents[2]
CAPACITY = 64 * 1024
SMALL_CAPACITY = 4096
SAMPLE_S = "0.2"
CLI_TIMEOUT_S = 30.0
LIVE_INTERVAL_S = "0.2"
LIVE_ROWS = 40
LIVE_COLUMNS = 240
LIVE_WAIT_S = 20.0
LIVE_EXIT_S = 10.0
READ_CHUNK = 65536
WAIT_STEP_S = 0.02
WRITER_RECORDS = 60
STREAM_TOKENS = 48
STREAM_PROMPT = "The socket module"
STREAM_JOIN_S = 60.0
LONG_STREAM_TOKENS = 400
"""Long enough to outlast the sample; the stream is cancelled after it."""
KILL_STREAM_TOKENS = 400
"""Long enough to be running when ringtop is killed."""

# Records written by populate(); the first CONSUMED are read and committed
# before ringtop starts, so it never sees them.
CONSUMED = 2
SCRIPT = [
    Record(KIND_TOKEN, 0, 1, 0, 101, b"Hel"),
    Record(KIND_TOKEN, 0, 2, 0, 201, b"Wor"),
    Record(KIND_TOKEN, 0, 1, 1, 102, b"lo"),
    Record(KIND_TOKEN, 0, 2, 1, 202, b"ld"),
    Record(KIND_TOKEN, 0, 1, 2, 103, b","),
    Record(KIND_TOKEN, 0, 2, 2, 203, " \u00e9t\u00e9".encode()),
    Record(KIND_TOKEN, 0, 2, 3, 204, b"!"),
    Record(
        KIND_FINISH,
        list(P.FinishReason).index(P.FinishReason.STOP),
        1,
        3,
        0,
        P.encode(P.Finish(P.FinishReason.STOP, stop_reason="\n", prompt_tokens=4, completion_tokens=3)),
    ),
]


@pytest.fixture
def instance() -> Iterator[str]:
    """A unique instance name; its /dev/shm segments are removed afterwards."""
    name = f"rt{uuid.uuid4().hex[:12]}"
    yield name
    for path in glob.glob(os.path.join(SHM_DIR, f"ringstream-{name}-*")):
        os.unlink(path)


@pytest.fixture
def make_ring(instance: str) -> Iterator[Callable[..., tuple[RingConsumer, RingProducer]]]:
    """Create rings of ``instance`` (worker 0 by default) with a producer."""
    made: list[tuple[RingConsumer, RingProducer]] = []

    def make(index: int = 0, capacity: int = CAPACITY) -> tuple[RingConsumer, RingProducer]:
        consumer = RingConsumer.create(ringtop.ring_name(instance, index), capacity)
        try:
            producer = RingProducer.attach(consumer.name, instance_id=consumer.instance_id)
        except BaseException:
            consumer.close()
            consumer.unlink()
            raise
        made.append((consumer, producer))
        return consumer, producer

    yield make
    for consumer, producer in made:
        producer.close()
        consumer.close()
        consumer.unlink()


def populate(consumer: RingConsumer, producer: RingProducer) -> None:
    """Publish SCRIPT and consume its first CONSUMED records."""
    for record in SCRIPT:
        assert producer.try_write(*record)
    producer.publish()
    assert consumer.read(CONSUMED) == SCRIPT[:CONSUMED]
    consumer.commit()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringstream.tools.ringtop", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=CLI_TIMEOUT_S,
        env=None if env is None else dict(os.environ, **env),
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(WAIT_STEP_S)


# -- without a daemon ------------------------------------------------------------


def test_discover_lists_only_the_instance_workers(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    make_ring(10, SMALL_CAPACITY)
    make_ring(2, SMALL_CAPACITY)
    decoys: list[RingConsumer] = []
    try:
        for name in (f"{instance}-w3x", f"{instance}x-w0", f"{instance}-w0-w1"):
            decoys.append(RingConsumer.create(f"ringstream-{name}", SMALL_CAPACITY))
        assert ringtop.discover(instance) == [
            (2, f"ringstream-{instance}-w2"),
            (10, f"ringstream-{instance}-w10"),
        ]
    finally:
        for decoy in decoys:
            decoy.close()
            decoy.unlink()
    with pytest.raises(ValueError):
        ringtop.discover("../etc")


@pytest.mark.e2e
def test_once_json_reports_header_positions_requests_and_finishes(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    consumer, producer = make_ring()
    populate(consumer, producer)
    result = run_cli("--instance", instance, "--once", "--json", "--interval", SAMPLE_S)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["instance"] == instance
    assert document["unreadable"] == []
    [ring] = document["rings"]
    with closing(RingObserver.attach(consumer.name)) as observer:
        header = observer.header()
    assert ring["worker"] == 0
    assert ring["name"] == consumer.name
    assert ring["path"] == consumer.path
    assert ring["version"] == 1
    assert ring["capacity"] == CAPACITY
    assert (ring["owner_pid"], ring["owner_alive"]) == (os.getpid(), True)
    assert (ring["producer_pid"], ring["producer_alive"]) == (os.getpid(), True)
    assert ring["created_ns"] == header["created_ns"]
    assert ring["instance_id"] == consumer.instance_id
    assert ring["write_pos"] == header["write_pos"] == sum(
        RingProducer.record_size(len(record.payload)) for record in SCRIPT
    )
    assert ring["read_pos"] == header["read_pos"] == sum(
        RingProducer.record_size(len(record.payload)) for record in SCRIPT[:CONSUMED]
    )
    assert ring["pending_bytes"] == ring["write_pos"] - ring["read_pos"]
    assert ring["fill_percent"] == pytest.approx(100 * ring["pending_bytes"] / CAPACITY, abs=1e-3)
    assert ring["consumer_waiting"] is False
    assert ring["producer_waiting"] is False
    assert ring["records_seen"] == len(SCRIPT) - CONSUMED
    assert ring["laps"] == 0
    assert ring["in_flight"] == [{"handle": 2, "last_seq": 3, "tokens_seen": 3}]
    assert ring["finish_reasons"] == {"stop": 1}
    assert ring["errors"] == {}
    assert ring["error"] is None
    assert "recent" not in ring
    assert (ring["records_per_s"], ring["bytes_per_s"]) == (0.0, 0.0), "nothing new was written"


@pytest.mark.e2e
def test_once_text_summary(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    consumer, producer = make_ring()
    populate(consumer, producer)
    result = run_cli("--instance", instance, "--once", "--interval", SAMPLE_S)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"instance {instance}, 1 ring(s)" in out
    assert f"worker 0  {consumer.path}" in out
    assert f"owner pid {os.getpid()} (alive), producer pid {os.getpid()} (alive)" in out
    assert "in flight 1: handle 2 seq 3" in out
    assert "finished: stop 1; errors: none" in out


@pytest.mark.e2e
def test_dump_decodes_the_last_records(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    consumer, producer = make_ring()
    populate(consumer, producer)
    error = P.encode(P.WorkerError(P.ErrorCode.INTERNAL, "worker broke"))
    assert producer.try_write(KIND_ERROR, 0, 2, 0, 0, error)
    producer.publish()
    result = run_cli("--instance", instance, "--dump", "3", "--interval", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"worker 0 ({consumer.name}): last 3 record(s) of 7 seen"
    assert lines[1].split() == ["TOKEN", "handle", "2", "seq", "3", "token", "204", "'!'"]
    assert lines[2].split()[:6] == ["FINISH", "handle", "1", "seq", "3", "token"]
    assert lines[2].endswith("reason stop (stop '\\n'), 4 prompt + 3 completion tokens")
    assert lines[3].split()[:3] == ["ERROR", "handle", "2"]
    assert lines[3].endswith("INTERNAL: worker broke")

    result = run_cli("--instance", instance, "--dump", "5", "--json", "--interval", "5")
    assert result.returncode == 0, result.stderr
    [ring] = json.loads(result.stdout)["rings"]
    assert ring["in_flight"] == []
    assert ring["errors"] == {"INTERNAL": 1}
    assert [record["kind"] for record in ring["recent"]] == ["TOKEN"] * 3 + ["FINISH", "ERROR"]
    assert ring["recent"][1] == {
        "kind": "TOKEN", "handle": 2, "seq": 2, "token_id": 203, "flags": 0, "text": " \u00e9t\u00e9",
    }
    assert ring["recent"][3]["finish_reason"] == "stop"
    assert ring["recent"][3]["completion_tokens"] == 3
    assert ring["recent"][4]["message"] == "worker broke"


@pytest.mark.e2e
def test_instance_without_rings_exits_1(instance: str) -> None:
    result = run_cli("--instance", instance, "--once", "--json", "--interval", SAMPLE_S)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"no readable ring of instance '{instance}'" in result.stderr
    assert "is the daemon running?" in result.stderr


@pytest.mark.e2e
def test_usage_errors_exit_2() -> None:
    assert run_cli("--instance", "a/b", "--once").returncode == 2
    assert run_cli("--interval", "0").returncode == 2
    assert run_cli("--dump", "0").returncode == 2


def test_rates_and_laps_in_process(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    consumer, producer = make_ring(0, SMALL_CAPACITY)
    monitor = ringtop.Monitor(instance)
    with closing(monitor):
        monitor.refresh()
        assert list(monitor.watches) == [consumer.name]

        for seq in range(WRITER_RECORDS):
            assert producer.try_write(KIND_TOKEN, 0, 7, seq, seq, b"tok")
            producer.publish()
            consumer.read()
            consumer.commit()
        monitor.poll()
        [ring] = monitor.report(1.0)["rings"]
        assert ring["records_seen"] == WRITER_RECORDS
        assert ring["records_per_s"] * ring["window_s"] == pytest.approx(WRITER_RECORDS)
        assert ring["bytes_per_s"] * ring["window_s"] == pytest.approx(
            WRITER_RECORDS * RingProducer.record_size(len(b"tok"))
        )
        assert ring["in_flight"] == [
            {"handle": 7, "last_seq": WRITER_RECORDS - 1, "tokens_seen": WRITER_RECORDS}
        ]
        assert ring["laps"] == 0

        lap = SMALL_CAPACITY // RingProducer.record_size(len(b"tok"))
        for seq in range(lap):
            assert producer.try_write(KIND_TOKEN, 0, 8, seq, seq, b"tok")
            producer.publish()
            consumer.read()
            consumer.commit()
        assert producer.try_write(KIND_TOKEN, 0, 9, 0, 0, b"tok")
        producer.publish()
        monitor.poll()
        [ring] = monitor.report(1.0)["rings"]
        assert ring["laps"] == 1
        assert ring["in_flight"] == [{"handle": 9, "last_seq": 0, "tokens_seen": 1}]
        assert consumer.arm() is False
        consumer.read()
        consumer.commit()
        assert consumer.arm() is True
        [ring] = monitor.report(1.0)["rings"]
        assert ring["consumer_waiting"] is True
        consumer.disarm()


def test_monitor_follows_rings_that_come_and_go(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    with closing(ringtop.Monitor(instance)) as monitor:
        monitor.refresh()
        assert monitor.watches == {}
        consumer, _producer = make_ring(0, SMALL_CAPACITY)
        monitor.refresh()
        first = monitor.watches[consumer.name]
        consumer.unlink()
        monitor.refresh()
        assert monitor.watches == {}
        assert first.observer.closed
        replacement, _producer = make_ring(0, SMALL_CAPACITY)
        monitor.refresh()
        assert monitor.watches[replacement.name].observer.header()["instance_id"] == (
            replacement.instance_id
        )


def test_undecodable_finish_falls_back_to_flags() -> None:
    length = list(P.FinishReason).index(P.FinishReason.LENGTH)
    decoded = ringtop.decode_record(Record(KIND_FINISH, length, 4, 9, 0, b"\xc1"))
    assert decoded["finish_reason"] == "length"
    assert "payload_error" in decoded
    broken_error = ringtop.decode_record(Record(KIND_ERROR, 0, 4, 0, 0, b""))
    assert broken_error["code"] == "unknown"


@pytest.mark.e2e
def test_import_needs_neither_daemon_nor_torch() -> None:
    probe = (
        "import sys, tools.ringtop; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('daemon', 'torch')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_console_script_is_declared() -> None:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        scripts = tomllib.load(file)["project"]["scripts"]
    module, _, function = scripts["ringstream-top"].partition(":")
    assert getattr(importlib.import_module(module), function) is ringtop.main


class PtyOutput:
    """Collects what a child writes to its terminal."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.data = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, READ_CHUNK)
            except OSError:  # EIO once the child side is closed
                return
            if not chunk:
                return
            with self.lock:
                self.data.extend(chunk)

    def text(self) -> str:
        with self.lock:
            return self.data.decode(errors="replace")


@contextmanager
def live_ringtop(instance: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], PtyOutput]]:
    """Run ``ringstream-top`` in live mode on a pseudo-terminal."""
    with live_terminal(LIVE_COLUMNS, "--instance", instance, *args) as (proc, output, _terminal, _settings):
        yield proc, output


@contextmanager
def live_terminal(
    columns: int, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], PtyOutput, int, list]]:
    """Run ``ringstream-top ARGS`` in live mode on a pseudo-terminal ``columns`` wide; yields the
    process, its output, a descriptor of the terminal and the terminal's settings before the start."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LIVE_ROWS, columns, 0, 0))
    settings = termios.tcgetattr(slave)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringstream.tools.ringtop", "--interval", LIVE_INTERVAL_S, *args],
            stdin=slave, stdout=slave, stderr=slave, cwd=REPO_ROOT,
            env=dict(os.environ, TERM="xterm-256color"),
        )
    except BaseException:
        os.close(slave)
        os.close(master)
        raise
    output = PtyOutput(master)
    try:
        yield proc, output, slave, settings
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(LIVE_EXIT_S)
        os.close(slave)
        output.thread.join(LIVE_EXIT_S)
        os.close(master)


@pytest.mark.e2e
def test_live_view_until_ctrl_c(
    instance: str, make_ring: Callable[..., tuple[RingConsumer, RingProducer]]
) -> None:
    consumer, producer = make_ring()
    populate(consumer, producer)
    before = Path(consumer.path).read_bytes()
    with live_ringtop(instance) as (proc, output):
        wait_until(
            lambda: f"{os.getpid()} (alive)" in output.text() or proc.poll() is not None,
            LIVE_WAIT_S, "the live table",
        )
        assert proc.poll() is None, output.text()
        assert f"instance {instance}" in output.text()
        assert "handle 2 seq 3" in output.text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(LIVE_EXIT_S) == 0, output.text()
    assert Path(consumer.path).read_bytes() == before


# -- with a daemon ---------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon()


@contextmanager
def streaming(
    address: str, max_tokens: int, stop: threading.Event | None = None
) -> Iterator[tuple[threading.Event, list]]:
    """Stream one greedy generation in a thread, leaving it early (which
    cancels it) once ``stop`` is set.  Yields (first chunk seen, results):
    results receives the list of chunks, or the exception."""
    started = threading.Event()
    results: list = []

    def run() -> None:
        try:
            with Client(address) as client:
                chunks = []
                for chunk in client.generate(
                    STREAM_PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True
                ):
                    chunks.append(chunk)
                    started.set()
                    if stop is not None and stop.is_set():
                        break
                results.append(chunks)
        except Exception as exc:  # handed to the test thread below
            results.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield started, results
    finally:
        thread.join(STREAM_JOIN_S)
        assert not thread.is_alive(), "the stream did not end"


@pytest.mark.e2e
def test_reports_a_running_daemon(daemon) -> None:
    names = [name for _index, name in ringtop.discover(daemon.instance)]
    assert [os.path.join(SHM_DIR, name) for name in names] == sorted(daemon.segments())
    stop = threading.Event()
    with streaming(daemon.address, LONG_STREAM_TOKENS, stop) as (started, results):
        assert started.wait(STREAM_JOIN_S)
        result = run_cli("--instance", daemon.instance, "--once", "--json", "--interval", "0.5")
        streamed_throughout = not results
        stop.set()
    assert result.returncode == 0, result.stderr
    [ring] = json.loads(result.stdout)["rings"]
    assert ring["name"] == f"ringstream-{daemon.instance}-w0"
    assert (ring["owner_pid"], ring["owner_alive"]) == (daemon.proc.pid, True)
    assert ring["producer_pid"] in daemon.worker_pids()
    assert ring["producer_alive"] is True
    assert ring["error"] is None
    assert set(ring["finish_reasons"]) <= {str(reason) for reason in P.FinishReason}
    if streamed_throughout:
        assert ring["records_seen"] > 0
        assert ring["bytes_per_s"] > 0
        assert ring["in_flight"] or ring["finish_reasons"], "the stream's request is not shown"
    [chunks] = results
    assert not isinstance(chunks, Exception), chunks


@pytest.mark.e2e
def test_sigkill_of_ringtop_leaves_the_daemon_serving(daemon) -> None:
    """ringtop is killed while it follows the ring, as the first chunk of a
    stream arrives: the stream still completes and the daemon serves the
    next request."""
    with live_ringtop(daemon.instance, "--view", "rings") as (proc, output):
        wait_until(
            lambda: f"{daemon.proc.pid} (alive)" in output.text() or proc.poll() is not None,
            LIVE_WAIT_S, "the live table",
        )
        with streaming(daemon.address, KILL_STREAM_TOKENS) as (started, results):
            assert started.wait(STREAM_JOIN_S)
            assert proc.poll() is None, output.text()
            assert not results, "the stream ended before ringtop was killed"
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(LIVE_EXIT_S) == -signal.SIGKILL
    [chunks] = results
    assert not isinstance(chunks, Exception), chunks
    assert chunks[-1].finish_reason == P.FinishReason.LENGTH
    assert sum(len(chunk.token_ids) for chunk in chunks) == KILL_STREAM_TOKENS
    assert daemon.proc.poll() is None
    assert sorted(daemon.segments()) == [
        os.path.join(SHM_DIR, name) for _index, name in ringtop.discover(daemon.instance)
    ]
    with Client(daemon.address) as client:
        completion = client.complete(STREAM_PROMPT, max_tokens=STREAM_TOKENS, temperature=0,
                                     ignore_eos=True)
    assert completion.finish_reason == P.FinishReason.LENGTH
    assert len(completion.token_ids) == STREAM_TOKENS


# -- the serving view --------------------------------------------------------------

SERVING_COLUMNS = 80
SERVING_STEP_MS = "50"
SERVING_CONCURRENCY = 2
SERVING_STREAMS = 3
"""One more than the daemon runs at once: one request waits."""
SERVING_TOKENS = 400
"""At 50 ms a step, about 20 s of streaming: open while the view is looked at."""
SERVING_WAIT_S = 30.0
SHORT_HEIGHT = 16
LEAVE_ALTERNATE_SCREEN = "\x1b[?1049l"


@pytest.fixture(scope="module")
def synthetic_daemon(start_module_daemon):
    return start_module_daemon("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", SERVING_STEP_MS,
                               "--max-concurrency", str(SERVING_CONCURRENCY))


@contextmanager
def busy(address: str) -> Iterator[None]:
    """SERVING_STREAMS streams open on the daemon for the ``with`` block, then left (cancelled)."""
    stop = threading.Event()
    with contextlib.ExitStack() as streams:
        for _ in range(SERVING_STREAMS):
            streams.enter_context(streaming(address, SERVING_TOKENS, stop))
        streams.callback(stop.set)  # the waiting stream leaves once it is served: after the others left
        yield


def settled_status(poller: StatusPoller) -> P.StatusReply:
    """A status in which every running request streamed a few tokens and one request waits."""
    replies: list[P.StatusReply] = []

    def settled() -> bool:
        reply = poller.poll()
        assert reply is not None, poller.error
        replies.append(reply)
        running = [r for r in reply.requests if r.state == "running"]
        return (len(running) == SERVING_CONCURRENCY and all(r.completion_tokens > 2 for r in running)
                and reply.waiting == SERVING_STREAMS - SERVING_CONCURRENCY)

    wait_until(settled, SERVING_WAIT_S, "running and waiting requests in the status")
    return replies[-1]


def rendered(reply: P.StatusReply, width: int, height: int | None = None) -> list[str]:
    console = Console(width=width, record=True, force_terminal=True, color_system=None)
    console.print(render_serving(reply, width=width, height=height, clock=time.time(),
                                 address="ipc:///a/long/runtime/directory/of/the/daemon/default.sock",
                                 refresh_s=1.0, keys_help=KEYS_HELP))
    return console.export_text().splitlines()


@pytest.mark.e2e
def test_serving_view_of_a_synthetic_daemon_fits_80_columns(synthetic_daemon) -> None:
    poller = StatusPoller(synthetic_daemon.address)
    with busy(synthetic_daemon.address):
        reply = settled_status(poller)
        cli = run_cli("--socket", synthetic_daemon.address, "--view", "serving", "--once",
                      env={"COLUMNS": str(SERVING_COLUMNS)})
        cli_json = run_cli("--socket", synthetic_daemon.address, "--view", "serving", "--json")
    poller.close()
    assert reply.model.endswith("default_model")
    assert reply.requests_open == SERVING_STREAMS and len(reply.requests) == SERVING_STREAMS
    [waiting] = [r for r in reply.requests if r.state == "waiting"]
    assert waiting.worker is None and waiting.ttft_s is None and waiting.completion_tokens == 0
    for request in reply.requests:
        assert request.prompt_tokens > 0 and request.max_tokens == SERVING_TOKENS and request.age_s > 0
        if request.state == "running":
            assert request.worker == 0 and request.ttft_s is not None and request.ttft_s > 0
    [worker] = reply.workers
    assert worker.running == SERVING_CONCURRENCY and worker.tokens_per_s > 0
    assert reply.tokens_per_s > 0 and reply.ttft_p50_s is not None and reply.itl_p50_s is not None

    lines = rendered(reply, SERVING_COLUMNS)
    assert max(map(len, lines)) <= SERVING_COLUMNS, "\n".join(lines)
    text = "\n".join(lines)
    assert f"model {reply.model}"[:SERVING_COLUMNS - 1] in text and "TTFT p50" in text and "ITL p50" in text
    for request in reply.requests:
        [row] = [line for line in lines if line.startswith(request.id)]
        assert request.state in row and f"{request.completion_tokens}/{SERVING_TOKENS}" in row
    assert f"{SERVING_STREAMS} open request(s)" in text

    short = rendered(reply, SERVING_COLUMNS, height=SHORT_HEIGHT)
    assert len(short) <= SHORT_HEIGHT and max(map(len, short)) <= SERVING_COLUMNS, "\n".join(short)
    assert f"of {SERVING_STREAMS} open requests shown" in "\n".join(short)

    assert cli.returncode == 0, cli.stderr
    assert max(map(len, cli.stdout.splitlines())) <= SERVING_COLUMNS, cli.stdout
    assert "workers" in cli.stdout and "requests (oldest first)" in cli.stdout
    assert cli_json.returncode == 0, cli_json.stderr
    document = json.loads(cli_json.stdout)
    assert document["model"] == reply.model and len(document["requests"]) == SERVING_STREAMS


@pytest.mark.e2e
def test_serving_view_without_a_daemon() -> None:
    lines = rendered(None, SERVING_COLUMNS)
    assert any("waiting for the daemon" in line for line in lines)
    result = run_cli("--socket", "ipc:///nonexistent/ringstream.sock", "--view", "serving", "--once")
    assert result.returncode == 1 and "no daemon at" in result.stderr


def test_keys_quit_and_switch_views() -> None:
    assert handle_keys(VIEW_SERVING, "q") is None
    assert handle_keys(VIEW_RINGS, "Q") is None
    assert handle_keys(VIEW_SERVING, "r") == VIEW_RINGS
    assert handle_keys(VIEW_RINGS, "s") == VIEW_SERVING
    assert handle_keys(VIEW_SERVING, "x") == VIEW_SERVING
    assert handle_keys(VIEW_SERVING, "\x1b[12;40R") == VIEW_SERVING  # a terminal's report, not a key
    assert handle_keys(VIEW_SERVING, "rsq") is None


@pytest.mark.e2e
def test_live_serving_view_quits_on_q_and_restores_the_terminal(synthetic_daemon) -> None:
    args = ("--instance", synthetic_daemon.instance, "--socket", synthetic_daemon.address)
    with busy(synthetic_daemon.address):
        with live_terminal(SERVING_COLUMNS, *args) as (proc, output, terminal, before):
            wait_until(lambda: "open request" in output.text() or proc.poll() is not None,
                       LIVE_WAIT_S, "the serving view")
            assert proc.poll() is None, output.text()
            assert "requests (oldest first)" in output.text() and "default_model" in output.text()
            assert termios.tcgetattr(terminal) != before  # cbreak: no echo, no line buffering
            shown = len(output.text())
            os.write(output.master, b"r")
            wait_until(lambda: f"instance {synthetic_daemon.instance}" in output.text()[shown:]
                       or proc.poll() is not None, LIVE_WAIT_S, "the rings view")
            shown = len(output.text())
            os.write(output.master, b"s")
            wait_until(lambda: "open request" in output.text()[shown:] or proc.poll() is not None,
                       LIVE_WAIT_S, "the serving view again")
            os.write(output.master, b"q")
            assert proc.wait(LIVE_EXIT_S) == 0, output.text()
            assert termios.tcgetattr(terminal) == before
            output.thread.join(LIVE_EXIT_S)
            assert LEAVE_ALTERNATE_SCREEN in output.text()
        with live_terminal(SERVING_COLUMNS, *args) as (proc, output, terminal, before):
            wait_until(lambda: "open request" in output.text() or proc.poll() is not None,
                       LIVE_WAIT_S, "the serving view")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(LIVE_EXIT_S) == 0, output.text()
            assert termios.tcgetattr(terminal) == before


@pytest.mark.parametrize("phase", ["starting", "importing torch", "loading weights", "sizing the KV cache",
                                   "warming up"])
def test_a_starting_workers_phase_is_shown_whole_in_80_columns(phase) -> None:
    from ringstream.tools.ringtop_serving import PHASE_LABELS

    worker = P.WorkerStatus(index=0, device="cuda:0", pid=7, alive=True, running=0, max_num_seqs=0, max_model_len=0,
                            kv_cache_tokens=0, kv_cache_tokens_used=0, ring_fill=0.0, requests_served=0, phase=phase,
                            phase_s=3.0)
    reply = P.StatusReply(version="1", ready=False, state="starting", uptime_s=3.0, waiting=0, running=0,
                          queue_size=10, max_concurrency=4, requests_total=0, tokens_generated_total=0,
                          workers=[worker])
    [row] = [line for line in rendered(reply, 80) if line.lstrip().startswith("0 ")]
    assert PHASE_LABELS.get(phase, phase) in row and "…" not in row, row

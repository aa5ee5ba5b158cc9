"""Client faults: killed, stopped, slow and stuck clients; one identity on two connections; reconnects.

The daemon runs the synthetic engine (5 ms steps, so a 400-token stream lasts
about 2 s) with ``client_timeout_s = 1``.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import zmq

from ringstream.daemon.front.client_table import STUCK_GIVE_UP_FACTOR
from ringstream.daemon.front.shell import HOUSEKEEPING_S
from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client, DaemonUnavailable
from tests.daemon_helpers import running_daemon
from tests.reliability.helpers import MIB, killed_on_exit, rss, status
from ringstream.tools.soak import check_synthetic_stream, gauges_idle, raw_socket, start_streaming_client, wait_for

# Timed against real processes on a shared 2-core host: one rerun absorbs a host hiccup.
pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]

CLIENT_TIMEOUT_S = 1.0
STEP_S = 0.005
LONG_TOKENS = 400
"""A stream of this many tokens lasts LONG_TOKENS * STEP_S = 2 s: longer than every fault below takes to act."""
RSS_BOUND = 30 * MIB
HEARTBEAT = P.encode(P.Heartbeat())
HEARTBEAT_S = 0.25


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(engine="synthetic", synthetic_step_ms=STEP_S * 1000, devices="cpu",
                               client_timeout_s=CLIENT_TIMEOUT_S)


@pytest.fixture
def connect(daemon):
    """``connect(identity=None, **socket_options)``: a raw DEALER socket to the daemon, closed after the test."""
    ctx = zmq.Context()
    made = []

    def make(identity: bytes | None = None, **options: int) -> zmq.Socket:
        made.append(raw_socket(ctx, daemon.address, identity, **options))
        return made[-1]

    yield make
    for sock in made:
        sock.close(linger=0)
    ctx.term()


def _generate(rid: str, max_tokens: int = LONG_TOKENS) -> bytes:
    return P.encode(P.make_generate(id=rid, prompt_token_ids=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True))


def _read_streams(sock: zmq.Socket, ids: set[str], timeout_s: float = 30.0) -> dict[str, list[P.Chunk]]:
    """Read (and heartbeat, as clients do) until every id in ``ids`` has its terminal message; Errors fail the test."""
    streams: dict[str, list[P.Chunk]] = {rid: [] for rid in ids}
    open_ids = set(ids)
    deadline = time.monotonic() + timeout_s
    next_heartbeat = 0.0
    while open_ids:
        if time.monotonic() >= next_heartbeat:
            sock.send(HEARTBEAT)
            next_heartbeat = time.monotonic() + HEARTBEAT_S
        assert time.monotonic() < deadline, f"no terminal for {sorted(open_ids)}"
        if not sock.poll(int(HEARTBEAT_S * 1000)):
            continue
        msg = P.SERVER_DECODER.decode(sock.recv())
        if isinstance(msg, P.HeartbeatAck):
            continue
        assert isinstance(msg, P.Chunk), msg
        assert msg.id in open_ids, f"chunk for {msg.id!r} after its terminal message"
        streams[msg.id].append(msg)
        if msg.finish_reason is not None:
            open_ids.discard(msg.id)
    return streams


def _pause_reading(sock: zmq.Socket, seconds: float, pid: int) -> int:
    """Send heartbeats but read nothing for ``seconds``; return the front's largest RSS growth meanwhile."""
    start_rss = peak = rss(pid)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.send(HEARTBEAT)
        time.sleep(HEARTBEAT_S)
        peak = max(peak, rss(pid))
    return peak - start_rss


def test_a_killed_client_has_its_requests_cancelled_at_once(daemon):
    child = start_streaming_client(daemon.address, streams=8, max_tokens=LONG_TOKENS)
    with killed_on_exit(child):
        assert status(daemon.address).running == 8
        start = time.monotonic()
        child.kill()
        child.wait()
        assert wait_for(lambda: gauges_idle(daemon.address), CLIENT_TIMEOUT_S), "requests still running"
        # its connection closed: no need to wait for the client timeout
        assert time.monotonic() - start < CLIENT_TIMEOUT_S
    # noticed by the connection monitor ("disconnected") or, when a chunk was sent first, by the send that
    # found the peer unroutable ("gone"): either way at once, not after the silence timeout
    assert re.search(r"(disconnected|gone); cancelling 8 request\(s\)", daemon.log())


def test_a_stopped_client_has_its_requests_cancelled_within_the_client_timeout(daemon):
    child = start_streaming_client(daemon.address, streams=8, max_tokens=LONG_TOKENS)
    with killed_on_exit(child):
        start = time.monotonic()
        os.kill(child.pid, signal.SIGSTOP)  # connection open, nothing read or sent
        assert wait_for(lambda: gauges_idle(daemon.address), CLIENT_TIMEOUT_S + 2 * HOUSEKEEPING_S + 0.5)
        assert CLIENT_TIMEOUT_S <= time.monotonic() - start < LONG_TOKENS * STEP_S
    assert "silent for 1.0 s; cancelling 8 request(s)" in daemon.log()


def test_a_slow_reader_gets_every_stream_whole_with_chunks_coalesced(daemon, connect):
    """Paused below the client timeout: the front meets the high-water mark, keeps the tokens and coalesces them."""
    before = status(daemon.address).counters
    sock = connect(RCVHWM=1, RCVBUF=4096)
    ids = {f"slow{i}" for i in range(48)}
    for rid in ids:
        sock.send(_generate(rid))
    growth = _pause_reading(sock, 0.8 * CLIENT_TIMEOUT_S, daemon.proc.pid)
    streams = _read_streams(sock, ids)
    for rid, chunks in streams.items():
        assert check_synthetic_stream(chunks, LONG_TOKENS) is None, rid
    counters = status(daemon.address).counters
    assert counters["client_sends_blocked_total"] > before["client_sends_blocked_total"], "never met the HWM"
    assert sum(len(c) for c in streams.values()) < len(ids) * LONG_TOKENS, "nothing was coalesced"
    assert counters["clients_stuck_total"] == before["clients_stuck_total"]
    assert growth < RSS_BOUND
    assert wait_for(lambda: gauges_idle(daemon.address), 2.0)


def test_a_client_that_stops_reading_past_the_timeout_gets_an_explicit_end(daemon, connect):
    """Not read for longer than client_timeout_s (while heartbeating): streams end cancelled, with no gap."""
    before = status(daemon.address).counters
    sock = connect(RCVHWM=1, RCVBUF=4096)
    ids = {f"stuck{i}" for i in range(48)}
    for rid in ids:
        sock.send(_generate(rid))
    growth = _pause_reading(sock, 1.6 * CLIENT_TIMEOUT_S, daemon.proc.pid)
    assert 1.6 < STUCK_GIVE_UP_FACTOR
    streams = _read_streams(sock, ids)
    for rid, chunks in streams.items():
        assert check_synthetic_stream(chunks) is None, rid
        assert chunks[-1].finish_reason == P.FinishReason.CANCELLED, rid
        assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks) < LONG_TOKENS
    counters = status(daemon.address).counters
    assert counters["clients_stuck_total"] == before["clients_stuck_total"] + 1
    assert growth < RSS_BOUND
    assert wait_for(lambda: gauges_idle(daemon.address), 2.0)


def test_a_second_connection_with_the_same_identity_is_refused_and_harms_nothing(daemon):
    identity = b"shared-identity"
    chunks: list[P.Chunk] = []
    with Client(daemon.address, identity=identity) as first:
        reader = threading.Thread(target=lambda: chunks.extend(
            first.generate(prompt_token_ids=[5, 6, 7], max_tokens=LONG_TOKENS, ignore_eos=True)))
        reader.start()  # reads (and heartbeats) all along
        try:
            assert wait_for(lambda: chunks, 30.0, 0.01)
            with Client(daemon.address, identity=identity, timeout_s=0.4, heartbeat_s=0.1) as second:
                with pytest.raises(DaemonUnavailable):
                    second.status()
                with pytest.raises(DaemonUnavailable):
                    list(second.generate(prompt_token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True))
            assert reader.is_alive(), "the first stream ended before the second client was refused"
        finally:
            reader.join(60)
    assert check_synthetic_stream(chunks, LONG_TOKENS) is None
    with Client(daemon.address, identity=identity) as later:  # once the first one left, the identity is free
        assert later.complete(prompt_token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True).finish_reason == "length"


def test_a_client_reconnecting_with_its_identity_gets_nothing_of_its_previous_connection(daemon, connect):
    """The old connection's request was still waiting when it closed; it must not stream to the new one."""
    identity = b"fixed-identity"
    with Client(daemon.address) as admin, Client(daemon.address) as blocker:
        admin.admin(max_concurrency=1)
        try:
            busy = blocker.generate(prompt_token_ids=[5, 6, 7], max_tokens=100, ignore_eos=True)
            first = next(busy)  # holds the only slot for about 0.5 s
            old = connect(identity)
            old.send(_generate("r"))
            assert wait_for(lambda: status(daemon.address).waiting == 1, 5.0)
            old.close(linger=0)  # gone without a Cancel, as a crashed client
            time.sleep(0.05)
            new = connect(identity)
            new.send(_generate("r", max_tokens=50))  # the same request id again
            assert check_synthetic_stream([first, *busy], 100) is None
            streams = _read_streams(new, {"r"})
        finally:
            admin.admin(max_concurrency=64)
    assert check_synthetic_stream(streams["r"], 50) is None
    assert not new.poll(300), "a message after the terminal one"
    assert wait_for(lambda: gauges_idle(daemon.address), 2.0)


def test_a_graceful_stop_delivers_every_terminal_message_to_a_slow_reader(tmp_path):
    """Terminal messages queued in the client socket at the stop are flushed (ZeroMQ linger), not discarded."""
    streams = 64
    with running_daemon(tmp_path, "--engine", "synthetic", "--synthetic-step-ms", "2", "--devices", "cpu") as d:
        ctx = zmq.Context()
        sock = raw_socket(ctx, d.address)
        try:
            for i in range(streams):
                sock.send(P.encode(P.make_generate(id=f"r{i}", prompt_token_ids=[5], max_tokens=300, ignore_eos=True)))
            ended: set[str] = set()
            stop_at = time.monotonic() + 0.3
            deadline = time.monotonic() + 30
            while len(ended) < streams and time.monotonic() < deadline:
                if stop_at and time.monotonic() > stop_at:
                    d.proc.send_signal(signal.SIGTERM)
                    stop_at = 0
                if not sock.poll(1000):
                    if d.proc.poll() is not None:
                        break  # stopped, and nothing more queued for us
                    continue
                msg = P.SERVER_DECODER.decode(sock.recv())
                if isinstance(msg, P.Error) or msg.finish_reason is not None:
                    ended.add(msg.id)
                time.sleep(0.0005)  # a slow reader
            assert len(ended) == streams, f"{streams - len(ended)} streams never got their terminal message"
            assert d.proc.wait(30) == 0
        finally:
            sock.close(linger=0)
            ctx.term()

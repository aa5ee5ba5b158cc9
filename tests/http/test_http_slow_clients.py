"""Slow, stuck, idle and vanishing HTTP clients hold nothing without bound, and the others are served meanwhile.

* Headers or a body sent byte by byte (slowloris), or a body never finished:
  dropped at the keep-alive (header) or body deadline, 408 for a body.
* A streaming client that stops reading (a small receive buffer, never read):
  its connection is aborted at the write deadline and its daemon requests
  cancelled, while another stream flows at full speed.
* A client that disconnects mid-answer, streamed or not, cleanly or with a
  reset: its daemon requests are cancelled at once.
* Thousands of idle connections: a completion is still served, the server's
  RSS stays bounded, connections over the cap get 503 and the ones being
  served are untouched.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from ringstream.daemon.http.limits import OWN_FILES, REFUSAL
from ringstream.daemon.http.options import LINGER_S, HttpLimits
from ringstream.daemon.common.listen import ConfigError
from ringstream.ipc.client import Client
from tests.http.helpers import body_of, exchange, host_port, post_bytes, read_until_closed, running_http, status_of
from tests.reliability.helpers import MIB, rss

# Timed against real processes on a shared 2-core host: one rerun absorbs a host hiccup.
pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]

STEP_MS = 10
STEP_ARGS = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", str(STEP_MS))
KEEPALIVE_S = 2.0
BODY_S = 2.0
WRITE_S = 1.5
MARGIN_S = 2.0
"""Slack on every deadline for a busy host."""
LONG_TOKENS = 480
"""A long stream: 4.8 s at 10 ms a step (the built-in model's context is 512)."""


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(*STEP_ARGS)


@pytest.fixture(scope="module")
def server(daemon):
    with running_http(daemon.address, "--keepalive-timeout", str(KEEPALIVE_S), "--body-timeout", str(BODY_S),
                      "--write-timeout", str(WRITE_S)) as s:
        yield s


def status(daemon):
    with Client(daemon.address) as client:
        return client.status()


def wait_idle(daemon, timeout_s: float) -> float:
    """Seconds until the daemon has no open request; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while status(daemon).requests_open:
        assert time.monotonic() - start < timeout_s, f"requests still open after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def completion(url: str, **fields) -> dict:
    """One non-streaming completion on a fresh connection (http.client); the decoded answer."""
    conn = http.client.HTTPConnection(*host_port(url), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "ignore_eos": True, **fields}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())
    finally:
        conn.close()


def streamed_text(url: str, **fields) -> str:
    """A streamed completion read to its end: the concatenated text of choice 0."""
    conn = http.client.HTTPConnection(*host_port(url), timeout=30)
    try:
        conn.request("POST", "/v1/completions",
                     json.dumps({"prompt": "x", "stream": True, "ignore_eos": True, **fields}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = resp.read().decode().split("\n\n")
    finally:
        conn.close()
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert chunks[-1]["finish_reason"] == "length", chunks[-1]
    return "".join(c["text"] for c in chunks)


def synthetic(count: int) -> str:
    return "".join(f" t{i}" for i in range(count))


@contextlib.contextmanager
def closing_sockets():
    """A list to put sockets in; every one is closed when the block ends."""
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def trickle(url: str, head: bytes, body: bytes, interval_s: float, limit_s: float) -> tuple[float, bytes]:
    """Send ``head`` at once, then ``body`` one byte every ``interval_s``, reading whatever comes back, until
    the server closes the connection (no ``body``: send ``head`` and wait). Returns (seconds from connect
    until closed, what the server sent)."""
    with socket.create_connection(host_port(url), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(head)
        if not body:
            got = read_until_closed(sock, limit_s)
            return time.monotonic() - start, got
        got = b""
        for i in range(len(body)):
            try:
                sock.sendall(body[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(interval_s)
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                chunk = None
            except ConnectionResetError:
                break
            if chunk == b"":
                break
            got += chunk or b""
            assert time.monotonic() - start < limit_s, f"still open after {limit_s} s"
        else:
            raise AssertionError("the whole trickle was accepted")
        return time.monotonic() - start, got


def test_slowloris_clients_are_dropped_at_their_deadlines_while_others_are_served(server):
    slow_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"
    body_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n"
    limit = KEEPALIVE_S + BODY_S + LINGER_S + MARGIN_S
    with ThreadPoolExecutor(3) as pool:
        headers = pool.submit(trickle, server.url, b"", slow_head, 0.05, limit)
        body = pool.submit(trickle, server.url, body_head, b'{"prompt": "' + b"a" * 380, 0.05, limit)
        silent = pool.submit(trickle, server.url, body_head + b'{"pro', b"", 0.0, limit)
        time.sleep(0.5)  # all three are connected and trickling
        start = time.monotonic()
        served = completion(server.url, max_tokens=3)
        served_s = time.monotonic() - start
        results = {name: f.result() for name, f in (("headers", headers), ("body", body), ("silent", silent))}
    assert served["choices"][0]["text"] == synthetic(3) and served_s < 1.0

    seconds, answer = results["headers"]
    assert answer == b"" and KEEPALIVE_S - 0.1 < seconds < KEEPALIVE_S + MARGIN_S, results["headers"]
    for name in ("body", "silent"):
        seconds, answer = results[name]
        assert status_of(answer) == 408, (name, answer)
        assert json.loads(body_of(answer))["error"]["code"] == "body_timeout"
        assert BODY_S - 0.1 < seconds < BODY_S + LINGER_S + MARGIN_S, (name, seconds)


def test_a_client_that_stops_reading_is_cut_off_and_its_requests_cancelled(server, daemon):
    choices = 64
    before = status(daemon).tokens_generated_total
    with closing_sockets() as socks:
        stuck = socket.socket()
        socks.append(stuck)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(host_port(server.url))
        stuck.sendall(post_bytes("/v1/completions", json.dumps(
            {"prompt": "x", "n": choices, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}).encode()))
        start = time.monotonic()
        assert streamed_text(server.url, max_tokens=100) == synthetic(100)  # flows meanwhile
        flowing_s = time.monotonic() - start
        cancelled_s = time.monotonic() - start + wait_idle(daemon, 10.0)
        port = stuck.getsockname()[1]
        still = [c for c in psutil.Process(server.proc.pid).net_connections() if c.raddr and c.raddr[1] == port]
        answer = read_until_closed(stuck, 10.0)  # what the buffers held, then the end of the abort
    generated = status(daemon).tokens_generated_total - before - 100
    full = choices * LONG_TOKENS * 200  # bytes the whole stream would have been (each event is ~200)
    assert status_of(answer) == 200 and len(answer) < full / 4
    assert not answer.endswith(b"data: [DONE]\n\n")
    assert generated < 0.75 * choices * LONG_TOKENS, "the stuck stream ran on"
    assert flowing_s < 100 * STEP_MS / 1000 + MARGIN_S
    assert cancelled_s < LONG_TOKENS * STEP_MS / 1000, f"cancelled after {cancelled_s:.1f} s"
    assert still == [], "the server kept the stuck connection"
    assert completion(server.url, max_tokens=2)["choices"][0]["text"] == synthetic(2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_a_disconnect_mid_answer_cancels_the_daemon_requests(server, daemon, stream, reset):
    sock = socket.create_connection(host_port(server.url), timeout=5)
    try:
        sock.sendall(post_bytes("/v1/completions", json.dumps(
            {"prompt": "x", "n": 4, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": stream}).encode()))
        deadline = time.monotonic() + 5
        while status(daemon).requests_open < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        if reset:  # RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()
    assert wait_idle(daemon, 5.0) < 2.0  # far less than the 4.8 s the answer would take


def _raise_open_file_limit() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def test_thousands_of_idle_connections_cost_little_and_the_cap_refuses_only_new_ones(daemon):
    soft, hard = _raise_open_file_limit()
    try:
        idle = min(2000, hard - 300)  # what this host's open-file limit allows (2000 wherever it can)
        assert idle >= 500, f"the open-file hard limit ({hard}) is too low for this test"
        cap = idle + 20
        with running_http(daemon.address, "--max-connections", str(cap), "--keepalive-timeout", "60") as server:
            _idle_connections(server, daemon, idle, cap)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _idle_connections(server, daemon, idle: int, cap: int) -> None:
    pid, address = server.proc.pid, host_port(server.url)
    kept = http.client.HTTPConnection(*address, timeout=30)  # admitted before the flood, kept alive
    try:
        for _ in range(3):  # warm-up: the first requests allocate caches
            _keep_alive_completion(kept)
            completion(server.url, max_tokens=2)
        time.sleep(0.3)  # the server has closed the completions' connections
        base_rss, base_fds = rss(pid), psutil.Process(pid).num_fds()
        with closing_sockets() as socks:
            for _ in range(idle):
                sock = socket.socket()
                socks.append(sock)
                sock.connect(address)
            _wait(lambda: psutil.Process(pid).num_fds() >= base_fds + idle - 2, 20.0, "the server to accept them")
            start = time.monotonic()
            assert completion(server.url, max_tokens=3)["choices"][0]["text"] == synthetic(3)
            assert time.monotonic() - start < 2.0
            growth = rss(pid) - base_rss
            assert growth < 40 * MIB, f"{idle} idle connections cost {growth / MIB:.1f} MiB"

            # fill the cap, then go over it: a stream in flight and a kept-alive connection are untouched
            results: list[str] = []
            streaming = threading.Thread(target=lambda: results.append(streamed_text(server.url, max_tokens=150)))
            streaming.start()
            _wait(lambda: status(daemon).requests_open == 1, 5.0, "the stream to start")
            extra = 30
            over = [socket.create_connection(address, timeout=10) for _ in range(cap - idle - 2 + extra)]
            socks.extend(over)  # the kept and streaming connections hold two places
            time.sleep(1.0)  # refusals are answered at once
            refused = 0
            for sock in over:
                sock.setblocking(False)
                try:
                    first = sock.recv(65536)
                except BlockingIOError:
                    continue  # admitted: waits for its request
                assert first + read_until_closed(sock, 5.0) == REFUSAL
                refused += 1
            assert extra <= refused <= extra + 2, refused
            assert _keep_alive_completion(kept) == synthetic(2)
            streaming.join(30)
            assert results == [synthetic(150)]
        _wait(lambda: psutil.Process(pid).num_fds() < base_fds + 10, 20.0, "the server to close them")
        assert completion(server.url, max_tokens=2)["choices"][0]["text"] == synthetic(2)  # room again
        assert rss(pid) - base_rss < 40 * MIB
    finally:
        kept.close()


def _keep_alive_completion(conn: http.client.HTTPConnection) -> str:
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and not resp.will_close
    return json.loads(resp.read())["choices"][0]["text"]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)


def test_limits_are_checked_and_fitted_to_the_open_file_limit():
    with pytest.raises(ConfigError, match="write_timeout_s"):
        HttpLimits(write_timeout_s=0)
    out = subprocess.run([sys.executable, "-P", "-m", "ringstream.daemon.http.server", "--socket", "ipc:///nowhere",
                          "--max-connections", "0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "max_connections = 0: must be > 0" in out.stderr
    script = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200)); "
              "from ringstream.daemon.http.limits import fit_open_files; "
              "print(fit_open_files(100), fit_open_files(1000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["100", str(200 - OWN_FILES), "200"], out.stderr
    assert f"allows {200 - OWN_FILES} connections, not 1000" in out.stderr


def test_a_stop_with_clients_that_do_not_read_ends_after_the_grace(daemon):
    """aiohttp alone would wait the grace twice over for a handler blocked writing to a client that does not
    read; the server aborts such connections once the grace (plus a margin) is over."""
    grace = 3.0
    with running_http(daemon.address, "--shutdown-grace", str(grace), "--write-timeout", "60") as server, \
            closing_sockets() as socks:
        for _ in range(2):
            stuck = socket.socket()
            socks.append(stuck)
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(host_port(server.url))
            stuck.sendall(post_bytes("/v1/completions", json.dumps(
                {"prompt": "x", "n": 4, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True,
                 "logprobs": 20}).encode()))
        time.sleep(1.5)  # their buffers fill; the handlers block writing
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(4 * grace) == 0
        assert time.monotonic() - started < 2 * grace - 0.5, "the stop waited the grace twice"

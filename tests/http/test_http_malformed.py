"""Malformed HTTP and abusive bodies: each gets a clean 4xx, the server keeps serving; /health while starting.

Every case is sent raw on its own connection (the parser's errors never
reach the application, so they are aiohttp's plain 400). The server's RSS
stays flat over the whole barrage.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import zmq

from ringstream.daemon.http.options import MAX_FIELD_BYTES, MAX_HEADERS, MAX_LINE_BYTES
from ringstream.daemon.http.openai_schema import MAX_CHOICES, MAX_MESSAGES
from ringstream.ipc import protocol as P
from tests.http.helpers import body_of, exchange, post_bytes, running_http
from tests.reliability.helpers import MIB, rss

pytestmark = pytest.mark.e2e

STEP_ARGS = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", "5")
RSS_BOUND = 30 * MIB
PLAIN = "plain"
"""In place of the parameter name: aiohttp's parser answers (plain text, not OpenAI's error body)."""
DEEP = 100_000
"""Nesting depth of the deeply nested bodies: far past the interpreter's recursion limit."""


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(*STEP_ARGS)


@pytest.fixture(scope="module")
def server(daemon):
    with running_http(daemon.address) as s:
        yield s


def _json_post(body: bytes, path: str = "/v1/completions") -> bytes:
    return post_bytes(path, body)


def _completion(**fields) -> bytes:
    return _json_post(json.dumps({"model": "default_model", **fields}).encode())


CASES = {
    # the HTTP layer (aiohttp's parser)
    "invalid request line": (b"GARBAGE\r\n\r\n", 400, PLAIN),
    "bad HTTP version": (b"GET /health HTTP/9.Z\r\nHost: x\r\n\r\n", 400, PLAIN),
    "non-numeric Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
                                   400, PLAIN),
    "negative Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
                                400, PLAIN),
    "two Content-Lengths": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                            b"Content-Length: 3\r\n\r\n{}", 400, PLAIN),
    "chunked garbage": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                        b"Connection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, PLAIN),
    "chunked and Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                   b"Content-Length: 5\r\n\r\n0\r\n\r\n", 400, PLAIN),
    "request line too long": (b"GET /" + b"a" * (MAX_LINE_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, PLAIN),
    "header too long": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_FIELD_BYTES + 10) + b"\r\n\r\n",
                        400, PLAIN),
    "too many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n"
                         + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 10)) + b"\r\n", 400, PLAIN),
    "binary noise": (bytes(range(256)) * 4, 400, PLAIN),
    # the body
    "non-UTF-8 JSON": (_json_post(b'{"prompt": "\xff\xfe\xfd"}'), 400, None),
    "JSON not an object": (_json_post(b'[1, 2, 3]'), 400, None),
    "JSON a string": (_json_post(b'"prompt"'), 400, None),
    "empty body": (_json_post(b""), 400, None),
    "deeply nested arrays": (_json_post(b"[" * DEEP + b"]" * DEEP), 400, None),
    "deeply nested prompt": (_json_post(b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"), 400, "prompt"),
    "deeply nested unknown field": (_json_post(b'{"prompt": "x", "future": ' + b'{"a": ' * DEEP + b"1"
                                               + b"}" * DEEP + b"}"), 400, "future"),
    "deeply nested free-form field": (_json_post(b'{"prompt": "x", "response_format": ' + b'{"a": ' * DEEP + b"1"
                                                 + b"}" * DEEP + b"}"), 400, None),
    "deeply nested chat_template_kwargs": (_json_post(b'{"messages": [{"role": "user", "content": "x"}], '
                                                      b'"chat_template_kwargs": {"k": ' + b"[" * DEEP + b"]" * DEEP
                                                      + b"}}", "/v1/chat/completions"), 400, None),
    "huge n": (_completion(prompt="x", n=10**30), 400, "n"),
    "n over the cap": (_completion(prompt="x", n=MAX_CHOICES + 1), 400, "n"),
    "huge max_tokens": (_completion(prompt="x", max_tokens=10**12), 400, "max_tokens"),
    "100k prompts": (_completion(prompt=["p"] * 100_000), 400, "prompt"),
    "100k token-id prompts": (_completion(prompt=[[1]] * 100_000), 400, "prompt"),
    "too many messages": (_json_post(json.dumps({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
                                     .encode(), "/v1/chat/completions"), 400, "messages"),
    "huge token id": (_completion(prompt=[2**40]), 400, "prompt"),
    "body over the limit": (post_bytes("/v1/completions", b" " * (9 * MIB)), 413, None),
}


def test_malformed_requests_get_clean_4xx_and_the_server_keeps_serving(server):
    pid = server.proc.pid
    for data, _, _ in CASES.values():  # warm-up: allocator, parser, decoder caches
        exchange(server.url, data)
    before = rss(pid)
    for name, (data, status, param) in CASES.items():
        got, answer = exchange(server.url, data)
        assert got == status, f"{name}: {answer[:300]!r}"
        if param != PLAIN:
            error = json.loads(body_of(answer))["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert param is None or error["param"] == param, f"{name}: {error}"
        ok, answer = exchange(server.url, _completion(prompt="still", max_tokens=2, ignore_eos=True))
        assert ok == 200, f"after {name}: {answer[:300]!r}"
        assert json.loads(body_of(answer))["choices"][0]["text"] == " t0 t1"
    growth = rss(pid) - before
    assert growth < RSS_BOUND, f"HTTP server RSS grew {growth / MIB:.1f} MiB"
    assert server.proc.poll() is None


def test_a_deeply_nested_body_is_refused_quickly(server):
    start = time.monotonic()
    status, answer = exchange(server.url, _json_post(b'{"prompt": "x", "response_format": ' + b"[" * 1_000_000
                                                  + b"]" * 1_000_000 + b"}"))
    assert status == 400 and "nested too deeply" in json.loads(body_of(answer))["error"]["message"]
    assert time.monotonic() - start < 2.0


@contextlib.contextmanager
def fake_daemon(address: str, reply: P.StatusReply):
    """A ZeroMQ ROUTER on ``address`` answering every Status with ``reply`` and every Heartbeat with an ack."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    stop = threading.Event()
    asked = []

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            identity, frame = sock.recv_multipart()
            msg = P.CLIENT_DECODER.decode(frame)
            asked.append(type(msg).__name__)
            answer = reply if isinstance(msg, P.Status) else P.HeartbeatAck() if isinstance(msg, P.Heartbeat) else None
            if answer is not None:
                sock.send_multipart([identity, P.encode(answer)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        ctx.term()


def test_health_while_the_daemon_is_starting(tmp_path):
    worker = P.WorkerStatus(index=0, device="cpu", pid=1, alive=True, running=0, max_num_seqs=64, max_model_len=0,
                            kv_cache_tokens=0, kv_cache_tokens_used=0, ring_fill=0.0, requests_served=0)
    starting = P.StatusReply(version="0", ready=False, state="starting", uptime_s=0.5, waiting=0, running=0,
                             queue_size=16, max_concurrency=4, requests_total=0, tokens_generated_total=0,
                             workers=[worker], model="")
    address = f"ipc://{tmp_path}/starting.sock"
    with fake_daemon(address, starting) as asked, running_http(address) as s:
        status, answer = exchange(s.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 503 and b"Retry-After: 1" in answer
        assert json.loads(body_of(answer)) == {"status": "starting", "workers_alive": 1}
        status, answer = exchange(s.url, _completion(prompt="x"))  # no model loaded yet: a typed 503
        assert status == 503 and json.loads(body_of(answer))["error"]["code"] == "starting"
        assert "Status" in asked

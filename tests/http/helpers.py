"""Start and stop real HTTP API server processes for tests, leaving nothing behind; raw HTTP exchanges with them."""

from __future__ import annotations

import contextlib
import re
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ringstream.daemon.http.server import READY_LINE

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
HTTP_CHILD_WAIT_S = 20.0
"""How long :func:`http_url` waits for a daemon's HTTP child to log its URL."""


class HttpProcess:
    """A running ``python -m ringstream.daemon.http.server``: its ``url`` (the first bound) and ``proc``."""

    def __init__(self, proc: subprocess.Popen, urls: list[str]) -> None:
        self.proc = proc
        self.urls = urls
        self.url = urls[0]


def _read_ready_line(proc: subprocess.Popen, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(READY_LINE):
                    return line[len(READY_LINE):].split()
    raise RuntimeError(f"the HTTP server did not start (exit code {proc.poll()}):\n{proc.stderr.read()}"
                       if proc.poll() is not None else "the HTTP server did not start in time")


@contextlib.contextmanager
def running_http(socket_address: str, *args: str, listen: str = "127.0.0.1:0"):
    """Run the HTTP server on ``socket_address`` for the ``with`` block; yields an :class:`HttpProcess`.

    On exit it is stopped with SIGTERM (SIGKILL after :data:`STOP_TIMEOUT_S`);
    a clean block fails unless the server exited 0 on its own.
    """
    command = [sys.executable, "-P", "-m", "ringstream.daemon.http.server", "--socket", socket_address,
               "--shutdown-grace", "1", "--log-level", "warning"]
    if listen:
        command += ["--listen", listen]
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clean = False
    try:
        server = HttpProcess(proc, _read_ready_line(proc, START_TIMEOUT_S))
        yield server
        clean = True
    finally:
        proc.terminate()
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    if clean:
        assert code == 0, f"the HTTP server exited with {code}:\n{err}"


def http_url(daemon) -> str:
    """The URL the HTTP child logged it serves on (the port the front bound for ``--http 127.0.0.1:0``)."""
    deadline = time.monotonic() + HTTP_CHILD_WAIT_S
    while time.monotonic() < deadline:
        match = re.search(r"http serving on (http://\S+)", daemon.log())
        if match:
            return match.group(1)
        time.sleep(0.1)
    raise AssertionError(f"the HTTP child did not start:\n{daemon.log_tail()}")


def raw(url: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One HTTP request with the standard library: (status, headers, body)."""
    req = urllib.request.Request(url + path, data=body, headers=headers or {}, method="POST" if body is not None
                                 else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def host_port(url: str) -> tuple[str, int]:
    """``("127.0.0.1", 8000)`` of ``http://127.0.0.1:8000``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def post_bytes(path: str, body: bytes, *headers: str) -> bytes:
    """A whole ``POST`` request with ``Connection: close`` and ``Content-Length``, as bytes."""
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json", "Connection: close",
             f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(url: str, data: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send ``data`` on a fresh connection and read until the server closes it: (status, the whole answer).

    Status 0: the server closed (or reset) the connection without answering.
    """
    with socket.create_connection(host_port(url), timeout=timeout_s) as sock:
        sock.sendall(data)
        answer = read_until_closed(sock, timeout_s)
    return status_of(answer), answer


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything ``sock`` receives until EOF or a reset; TimeoutError if it stays open past ``timeout_s``."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            raise TimeoutError(f"the server kept the connection open past {timeout_s} s") from None
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP answer, 0 for none."""
    if not answer.startswith(b"HTTP/1."):
        return 0
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> bytes:
    return answer.partition(b"\r\n\r\n")[2]

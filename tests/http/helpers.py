"""Start and stop real HTTP API server processes for tests, leaving nothing behind."""

from __future__ import annotations

import contextlib
import selectors
import subprocess
import sys
import time

from ringstream.daemon.http_api import READY_LINE

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


class HttpProcess:
    """A running ``python -m ringstream.daemon.http_api``: its ``url`` (the first bound) and ``proc``."""

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
    command = [sys.executable, "-P", "-m", "ringstream.daemon.http_api", "--socket", socket_address,
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

"""sd_notify end to end: a real daemon talking to a real unix datagram socket."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from tests.daemon_helpers import running_daemon

pytestmark = pytest.mark.e2e

WATCHDOG_USEC = 2_000_000


class NotifySocket:
    """A bound AF_UNIX datagram socket that records every message (thread)."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def times(self, key: str) -> list[float]:
        return [t for t, fields in self.messages if key in fields]

    def wait_for(self, key: str, timeout_s: float = 120.0) -> float:
        deadline = time.monotonic() + timeout_s
        while not self.times(key):
            assert time.monotonic() < deadline, f"no {key} within {timeout_s} s: {self.messages}"
            time.sleep(0.02)
        return self.times(key)[0]

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def test_ready_watchdog_and_stopping(tmp_path, notify):
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with running_daemon(tmp_path, env=env) as d:
        ready = notify.wait_for("READY")
        time.sleep(2.5)
        pings = [t for t in notify.times("WATCHDOG") if t > ready]
        assert len(pings) >= 2, notify.messages
        worker = d.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            time.sleep(WATCHDOG_USEC / 1e6 + 2.5)
            late = [t for t in notify.times("WATCHDOG") if t > stopped_at + WATCHDOG_USEC / 1e6 + 1.1]
            assert not late, "watchdog pings went on while a worker was stopped"
        finally:
            os.kill(worker, signal.SIGCONT)
        time.sleep(WATCHDOG_USEC / 1e6 + 1.5)
        assert [t for t in notify.times("WATCHDOG") if t > time.monotonic() - 2], "pings did not resume"
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGHUP)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0
    stopping = notify.times("STOPPING")
    assert stopping and stopping[0] >= sent
    assert [t for t in notify.times("RELOADING") if t >= sent] or stopping  # reload may race the stop


def test_no_ready_and_nonzero_exit_for_a_bad_model(tmp_path, notify):
    env = {"NOTIFY_SOCKET": notify.path}
    with running_daemon(tmp_path, "--model", str(tmp_path / "missing"), ready=False, env=env) as d:
        assert d.proc.wait(60) != 0
    assert not notify.times("READY")
    assert any("start failed" in f.get("STATUS", "") for _, f in notify.messages)

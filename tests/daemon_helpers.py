"""Start and stop real daemons for end-to-end tests, leaving nothing behind.

:func:`running_daemon` starts ``ringstream serve`` in a child process on a
private ipc socket and a unique instance name, waits for the ready handshake
(``Status.ready``), and on exit stops it with SIGTERM (SIGKILL after a
deadline), then removes any /dev/shm segment of that instance and fails the
test if the daemon left one or a worker process behind.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from ringstream.ipc.client import Client

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
CHILD_EXIT_S = 5.0
"""Children (workers, multiprocessing's resource tracker) get this long to exit after the daemon."""


def wait_exit(pids: list[int], timeout_s: float) -> list[int]:
    """Wait for processes to exit; return those still running (zombies count as exited)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@dataclass
class Daemon:
    """A running daemon under test."""

    proc: subprocess.Popen
    address: str
    instance: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def segments(self) -> list[str]:
        return glob.glob(f"/dev/shm/ringstream-{self.instance}-*")

    def child_pids(self) -> list[int]:
        """Every descendant: workers and multiprocessing's resource tracker."""
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker_pids(self) -> list[int]:
        """The worker processes (spawned by multiprocessing), in start order."""
        workers = []
        for pid in self.child_pids():
            try:
                if "spawn_main" in " ".join(psutil.Process(pid).cmdline()):
                    workers.append(pid)
            except psutil.NoSuchProcess:
                pass
        return workers

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the daemon and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not stop within {STOP_TIMEOUT_S} s:\n{self.log()[-3000:]}")


@contextlib.contextmanager
def running_daemon(tmp_path: Path, *args: str, ready: bool = True, env: dict | None = None,
                   preexec_fn=None):
    """Run ``ringstream serve ARGS`` for the duration of the ``with`` block; yields a :class:`Daemon`.

    ``env``: extra environment variables for the daemon. ``preexec_fn``: run in
    the daemon's process before it starts (e.g. to lower a resource limit).
    """
    instance = args[list(args).index("--instance") + 1] if "--instance" in args else f"t{uuid.uuid4().hex[:10]}"
    address = f"ipc://{tmp_path}/{instance}.sock"
    log_path = tmp_path / f"{instance}.log"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), **(env or {}))
    cmd = [sys.executable, "-m", "ringstream.daemon.cli", "serve", "--instance", instance, "--socket", address, *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn)
    daemon = Daemon(proc, address, instance, log_path)
    children: list[int] = []
    clean_exit = False
    try:
        if ready:
            with Client(address) as client:
                client.wait_ready(READY_TIMEOUT_S)
            children = daemon.child_pids()
        yield daemon
        clean_exit = True
    finally:
        children = children or daemon.child_pids()
        if proc.poll() is None:
            daemon.stop()
        leftovers = [] if not ready else daemon.segments()
        for path in leftovers:
            os.unlink(path)
        alive = [pid for pid in wait_exit(children, CHILD_EXIT_S)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        if clean_exit:
            assert not leftovers, f"daemon left /dev/shm segments: {leftovers}"
            assert not alive, f"daemon left worker processes: {alive}"

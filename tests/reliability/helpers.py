"""Small helpers shared by the reliability tests (the drivers themselves live in :mod:`ringstream.tools.soak`)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import psutil

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client

MIB = 2**20


def write_config(directory: Path, text: str) -> str:
    """Write ``text`` as ``ringstream.toml`` in ``directory``; returns its path."""
    path = directory / "ringstream.toml"
    path.write_text(text)
    return str(path)


def status(address: str, **client_args) -> P.StatusReply:
    """One ``Status`` round trip on a fresh client."""
    with Client(address, timeout_s=10.0, **client_args) as client:
        return client.status()


def rss(pid: int) -> int:
    """Resident set size of process ``pid``, bytes."""
    return psutil.Process(pid).memory_info().rss


@contextlib.contextmanager
def killed_on_exit(*procs):
    """Make sure each ``subprocess.Popen`` in ``procs`` is dead (SIGCONT + SIGKILL) when the block ends."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()

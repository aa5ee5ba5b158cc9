"""One ``ringstream serve`` child process, started and stopped the same way by every launcher.

:class:`DaemonProcess` runs ``python -P -m ringstream.daemon.cli serve`` on
its own instance name and ipc socket (in a runtime directory it makes, or
one it is given), waits for the ready handshake (a ``Status`` reply with
``ready``), and has one stop path: SIGTERM, a join with a deadline, SIGKILL
past it, then SIGKILL of any worker left behind; it removes the instance's
/dev/shm segments and the runtime directory it made. The end-to-end tests'
helper, the soak, the serving benchmark and ``ringstream demo`` all start
their daemons with it.

It speaks to the daemon only through ``ringstream.ipc`` and the ``serve``
command line: it imports none of the daemon's processes.

Example::

    with DaemonProcess("--engine", "synthetic", "--devices", "cpu") as daemon:
        with Client(daemon.address) as client:
            print(client.complete(prompt_token_ids=[5, 6, 7], max_tokens=4).text)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client, DaemonUnavailable

START_TIMEOUT_S = 300.0
"""Seconds from start to the ready reply at most: the workers load the model first (a large one on CPU takes
minutes). A daemon that exits before it is ready fails the start at once, whatever is left of this."""
STOP_TIMEOUT_S = 60.0
"""Seconds from SIGTERM to the daemon's exit before it is SIGKILLed: room for its drain (``drain_timeout_s``,
30 s by default) and its deadline joins of the workers."""
CHILD_EXIT_S = 5.0
"""Workers (and multiprocessing's resource tracker) get this long to exit after the front did."""
READY_POLL_S = 0.25
"""While waiting for the ready reply, check this often that the daemon still runs."""
LOG_TAIL_CHARS = 3000
"""Characters of the daemon's log quoted in a start error."""
SEGMENT_GLOB = "/dev/shm/ringstream-{instance}-*"
WORKER_MARKS = ("ringstream: worker", "spawn_main")
"""A worker's command line holds its process title, or multiprocessing's bootstrap while it starts."""
PR_SET_PDEATHSIG = 1


class DaemonStartError(RuntimeError):
    """The daemon exited, or was not ready within :data:`START_TIMEOUT_S`."""


@dataclass
class Leftovers:
    """What a stopped daemon left behind (and :meth:`DaemonProcess.close` removed)."""

    segments: list[str] = field(default_factory=list)
    """/dev/shm segments of its instance."""
    processes: list[int] = field(default_factory=list)
    """Pids of its processes still running :data:`CHILD_EXIT_S` after the front exited (then SIGKILLed)."""
    killed: bool = False
    """The front did not exit within :data:`STOP_TIMEOUT_S` of the stop signal and was SIGKILLed."""

    @property
    def clean(self) -> bool:
        return not (self.segments or self.processes or self.killed)

    def as_dict(self) -> dict:
        """``{"segments": [...], "processes": [...], "killed": bool}``, for a JSON report."""
        return dataclasses.asdict(self)


def serve_command(instance: str, address: str, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``ringstream serve`` command line (this interpreter; ``-P``: nothing imported from the current
    directory). ``args`` come last, so that they win over the instance and socket given here."""
    return [sys.executable, "-P", "-m", "ringstream.daemon.cli", "serve", "--instance", instance,
            "--socket", address, *args]


def wait_exit(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` seconds for processes to exit; returns the pids still running (a zombie has
    exited: a reparented child of a dead front may wait for a reaper that never comes)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return [p.pid for p in _wait_gone(procs, timeout_s)]


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        _, alive = psutil.wait_procs(procs, timeout=max(0.0, min(READY_POLL_S, deadline - time.monotonic())))
        running = []
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
        if not running or time.monotonic() >= deadline:
            return running
        procs = running


class DaemonProcess:
    """A ``ringstream serve`` child process; a context manager (``start()`` on enter, ``close()`` on exit).

    Args:
        *args: more ``serve`` arguments (``--engine synthetic``, ``--config FILE``...); a ``--socket`` or
            ``--instance`` among them wins over the generated one (keep ``address``/``instance`` in step).
        runtime_dir: the daemon's ``XDG_RUNTIME_DIR`` and the folder of its socket and log; default: a fresh
            temporary directory, removed by :meth:`close`. Keep its path short: the daemon's ipc sockets under
            it must fit the 107 bytes of a Unix socket address.
        instance: the instance name; default: ``prefix`` plus 10 random hex digits.
        address: the client socket; default ``ipc://RUNTIME_DIR/INSTANCE.sock``.
        env: more environment variables for the daemon.
        log: True: the daemon's stdout and stderr go to ``RUNTIME_DIR/INSTANCE.log``; False: they are this
            process's own (a terminal).
        own_session: start the daemon in a session of its own, so that a Ctrl-C meant for the launcher does
            not reach it (the launcher stops it through :meth:`close`).
        die_with_parent: the daemon gets SIGTERM when the thread that started it exits (``PR_SET_PDEATHSIG``).
        preexec_fn: run in the daemon's process before it execs (e.g. to lower a resource limit).
        remove_segments: :meth:`close` removes the instance's /dev/shm segments (False: leave them to the next
            daemon of this instance to reclaim).
    """

    def __init__(self, *args: str, runtime_dir: str | Path | None = None, instance: str | None = None,
                 address: str | None = None, env: dict[str, str] | None = None, log: bool = True,
                 own_session: bool = False, die_with_parent: bool = False, preexec_fn=None,
                 remove_segments: bool = True, prefix: str = "rs") -> None:
        self._made_dir = runtime_dir is None
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="ringstream-") if runtime_dir is None else runtime_dir)
        self.instance = instance or f"{prefix}{uuid.uuid4().hex[:10]}"
        self.address = address or f"ipc://{self.runtime_dir}/{self.instance}.sock"
        self.log_path: Path | None = self.runtime_dir / f"{self.instance}.log" if log else None
        self.command = serve_command(self.instance, self.address, args)
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(self.runtime_dir), **(env or {}))
        self.own_session = own_session
        self.remove_segments = remove_segments
        self._hooks = [preexec_fn] if preexec_fn else []
        if die_with_parent:  # resolved here: the child between fork and exec only calls it
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            self._hooks.insert(0, functools.partial(prctl, PR_SET_PDEATHSIG, signal.SIGTERM))
        self.proc: subprocess.Popen | None = None
        self.killed = False
        self.leftovers: Leftovers | None = None
        """Set by :meth:`close`."""
        self._seen: dict[int, psutil.Process] = {}

    # ------------------------------------------------------------ start

    def _preexec(self) -> None:
        for hook in self._hooks:
            hook()

    def start(self, wait_ready: bool = True) -> P.StatusReply | None:
        """Start the daemon; with ``wait_ready``, wait for its ready reply and return it.

        Raises:
            DaemonStartError: the daemon exited or was not ready within :data:`START_TIMEOUT_S`.
        """
        if self.proc is not None:
            raise RuntimeError("the daemon was started already")
        preexec = self._preexec if self._hooks else None
        with contextlib.ExitStack() as stack:
            out = None if self.log_path is None else stack.enter_context(open(self.log_path, "wb"))
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=None if out is None else subprocess.STDOUT,
                                         env=self.env, start_new_session=self.own_session, preexec_fn=preexec)
        return self.wait_ready() if wait_ready else None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> P.StatusReply:
        """Wait for a ``Status`` reply with ``ready`` (every worker loaded) and return it.

        Raises:
            DaemonStartError: the daemon exited first, or ``timeout_s`` seconds passed.
        """
        deadline = time.monotonic() + timeout_s
        with Client(self.address, timeout_s=READY_POLL_S) as client:
            while True:
                if self.proc.poll() is not None:
                    raise DaemonStartError(f"the daemon exited with code {self.proc.returncode} before it was "
                                           f"ready{self._quoted_log()}")
                try:
                    reply = client.wait_ready(READY_POLL_S)
                    break
                except DaemonUnavailable:
                    if time.monotonic() > deadline:
                        raise DaemonStartError(f"the daemon was not ready after {timeout_s:.0f} s"
                                               f"{self._quoted_log()}") from None
        self._remember_children()
        return reply

    # ------------------------------------------------------------ inspect

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """The daemon's log so far ("" when it logs to this process's own output)."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        """The last :data:`LOG_TAIL_CHARS` characters of the log."""
        return self.log()[-LOG_TAIL_CHARS:]

    def _quoted_log(self) -> str:
        tail = self.log_tail()
        return f":\n{tail}" if tail else ""

    def segments(self) -> list[str]:
        """The /dev/shm segments of this daemon's instance."""
        return glob.glob(SEGMENT_GLOB.format(instance=self.instance))

    def processes(self) -> list[psutil.Process]:
        """The front and every descendant still running (workers, multiprocessing's resource tracker)."""
        try:
            front = psutil.Process(self.proc.pid)
            return [front, *front.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def child_pids(self) -> list[int]:
        """Pids of every descendant still running."""
        return [p.pid for p in self.processes()[1:]]

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes, in start order."""
        workers = []
        for proc in self.processes()[1:]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if any(mark in " ".join(proc.cmdline()) for mark in WORKER_MARKS):
                    workers.append(proc.pid)
        return workers

    def _remember_children(self) -> None:
        """Note the descendants now: once the front is gone they are nobody's children."""
        for proc in self.processes()[1:]:
            self._seen.setdefault(proc.pid, proc)

    # ------------------------------------------------------------ stop

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig`` (unless the daemon exited), wait up to ``timeout_s`` seconds, SIGKILL it past that (and
        set ``killed``). Returns its exit code (negative: the signal that ended it)."""
        if self.proc.poll() is None:
            self._remember_children()
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.killed = True
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> Leftovers:
        """Stop the daemon (:meth:`stop`), SIGKILL whatever of it still runs :data:`CHILD_EXIT_S` later, remove
        its /dev/shm segments and the runtime directory made for it. Returns (and keeps in ``leftovers``) what
        was left behind. Safe to call twice."""
        if self.leftovers is not None:
            return self.leftovers
        leftovers = Leftovers()
        if self.proc is not None:
            self._remember_children()
            self.stop()
            leftovers.killed = self.killed
            for proc in _wait_gone(list(self._seen.values()), CHILD_EXIT_S):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
                leftovers.processes.append(proc.pid)
        if self.remove_segments:
            leftovers.segments = self.segments()
            for path in leftovers.segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if self._made_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.leftovers = leftovers
        return leftovers

    def __enter__(self) -> "DaemonProcess":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

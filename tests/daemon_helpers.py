"""Start and stop real daemons for end-to-end tests, leaving nothing behind.

:func:`running_daemon` starts ``ringstream serve`` with
:class:`ringstream.daemon.launcher.DaemonProcess` on a private ipc
socket and a unique instance name, waits for the ready handshake
(``Status.ready``), and on exit stops it (SIGTERM, SIGKILL after a
deadline), removes any /dev/shm segment of that instance and fails the test
if the daemon left one, left a worker process behind or had to be killed.

:class:`DaemonFactory` does the same for any number of daemons, stopped
together by :meth:`DaemonFactory.close`: the ``start_daemon`` (per test) and
``start_module_daemon`` (per module) fixtures of ``tests/conftest.py`` are
built on it, and :func:`running_daemon` is one daemon of a factory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from ringstream.daemon.launcher import DaemonProcess, wait_exit

__all__ = ["Daemon", "DaemonFactory", "running_daemon", "settings_toml", "wait_exit"]

Daemon = DaemonProcess
"""A running daemon under test."""


CONFIG_NAME = "ringstream.toml"
"""The config file :class:`DaemonFactory` writes a daemon's settings to, in its runtime directory."""


def settings_toml(settings: dict) -> str:
    """``key = value`` lines of a config file, one per setting (str, bool, int, float or a dict of them)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"no TOML form for the setting value {v!r}")

    return "".join(f"{key} = {value(v)}\n" for key, v in settings.items())


def leftover_problems(daemon: DaemonProcess, left) -> list[str]:
    """What a stopped daemon did wrong: it had to be killed, left /dev/shm segments or worker processes."""
    problems = []
    if left.killed:
        problems.append(f"daemon did not stop within its deadline:\n{daemon.log_tail()}")
    if left.segments:
        problems.append(f"daemon left /dev/shm segments: {left.segments}")
    if left.processes:
        problems.append(f"daemon left worker processes: {left.processes}")
    return problems


class DaemonFactory:
    """Starts ``ringstream serve`` daemons; :meth:`close` stops every one it started.

    ``factory(*args, ready=True, env=None, preexec_fn=None, runtime_dir=None, **settings)`` starts
    ``ringstream serve ARGS`` on a private ipc socket and a unique instance name (a ``--instance`` among
    ``args`` wins) and returns its :class:`DaemonProcess`:

    * ``ready=False``: return at once, without waiting for the ready reply, and leave the instance's
      segments (a test of a failed start, or of the next start reclaiming them);
    * ``env``: extra environment variables for the daemon; ``preexec_fn``: run in the daemon's process
      before it starts (e.g. to lower a resource limit);
    * ``runtime_dir``: the daemon's runtime directory (socket, log); default: a fresh one from ``make_dir``;
    * ``settings``: config-file settings (``max_concurrency=2``, ``engine="synthetic"``), written to
      ``ringstream.toml`` in the runtime directory and passed with ``--config``; the daemon's
      ``config_path`` is that file (None without settings).

    A daemon that fails to start is stopped before the error propagates.
    """

    def __init__(self, make_dir: Callable[[], Path]) -> None:
        self._make_dir = make_dir
        self._daemons: list[DaemonProcess] = []

    def __call__(self, *args: str, ready: bool = True, env: dict | None = None, preexec_fn=None,
                 runtime_dir: str | Path | None = None, **settings) -> DaemonProcess:
        runtime = Path(runtime_dir) if runtime_dir is not None else self._make_dir()
        config_path = None
        if settings:
            if "--config" in args:
                raise TypeError("give the daemon's settings either as keywords or in a --config file, not both")
            config_path = runtime / CONFIG_NAME
            config_path.write_text(settings_toml(settings))
            args = (*args, "--config", str(config_path))
        instance = args[list(args).index("--instance") + 1] if "--instance" in args else None
        daemon = DaemonProcess(*args, runtime_dir=runtime, instance=instance, env=env, preexec_fn=preexec_fn,
                               remove_segments=ready, prefix="t")
        daemon.config_path = config_path
        self._daemons.append(daemon)
        try:
            daemon.start(wait_ready=ready)
        except BaseException:
            self._daemons.remove(daemon)
            daemon.close()
            raise
        return daemon

    def close(self, check: bool = True) -> None:
        """Stop every daemon started (the latest first, each even when stopping another failed); with
        ``check``, then fail (AssertionError) if any had to be killed or left segments or processes."""
        problems: list[str] = []
        error: BaseException | None = None
        while self._daemons:
            daemon = self._daemons.pop()
            try:
                problems += leftover_problems(daemon, daemon.close())
            except BaseException as exc:  # stop the others first
                error = error or exc
        if error is not None:
            raise error
        if check and problems:
            raise AssertionError("\n".join(problems))


@contextlib.contextmanager
def running_daemon(tmp_path: Path, *args: str, ready: bool = True, env: dict | None = None,
                   preexec_fn=None):
    """Run ``ringstream serve ARGS`` for the duration of the ``with`` block; yields a :class:`DaemonProcess`.

    ``tmp_path`` is the daemon's runtime directory; ``ready``, ``env`` and
    ``preexec_fn`` as for :class:`DaemonFactory`. A block that ends with an
    exception is not failed for what the daemon left behind (it is removed all
    the same).
    """
    factory = DaemonFactory(lambda: tmp_path)
    clean_exit = False
    try:
        yield factory(*args, ready=ready, env=env, preexec_fn=preexec_fn)
        clean_exit = True
    finally:
        factory.close(check=clean_exit)

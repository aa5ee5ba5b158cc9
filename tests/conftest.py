"""Fixtures shared by the whole suite: daemons under test, and the guard of the ``e2e`` marker.

Daemons: ``start_daemon`` (per test) and ``start_module_daemon`` (per module)
are one :class:`tests.daemon_helpers.DaemonFactory` each::

    @pytest.fixture(scope="module")
    def daemon(start_module_daemon):
        return start_module_daemon("--engine", "synthetic", "--devices", "cpu", max_concurrency=2)

Each call starts ``ringstream serve ARGS`` on a private runtime directory and
socket and waits until it is ready; at the end of the scope every daemon the
factory started is stopped and removed, also when the test failed, and the test
fails if one had to be killed or left segments or worker processes behind (a
per-test daemon is not checked for leftovers after its test failed).

The ``e2e`` marker: the fast tier (``-m "not e2e"``) must start no process. A
test not marked ``e2e`` that starts one (``subprocess``, ``multiprocessing``,
``os.fork``...), directly or through a fixture of any scope set up for it,
fails with an AssertionError that names it.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import multiprocessing.process
import multiprocessing.util
import os
import signal
import subprocess

import pytest


def pytest_configure(config):
    """Ctrl-C at its default for the run: a runner started in the background by a non-interactive shell
    (``pytest &``) ignores SIGINT, every process the tests start inherits that, and the tests that press Ctrl-C on a
    demo or a live view would see it ignored. A handled SIGINT goes back to its default across exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


E2E = "e2e"
_FAILED = pytest.StashKey[bool]()
_current_item: pytest.Item | None = None
"""The test being set up, run or torn down (None between tests and while collecting)."""


# ------------------------------------------------------------ daemons


def _failed(node: pytest.Item) -> bool:
    return node.stash.get(_FAILED, False)


@pytest.fixture
def start_daemon(request, tmp_path_factory):
    """``start_daemon(*args, ready=True, env=None, preexec_fn=None, runtime_dir=None, **settings)``: a
    running daemon (:class:`ringstream.daemon.launcher.DaemonProcess`), stopped after the test."""
    from tests.daemon_helpers import DaemonFactory

    factory = DaemonFactory(lambda: tmp_path_factory.mktemp("daemon"))
    yield factory
    factory.close(check=not _failed(request.node))


@pytest.fixture(scope="module")
def start_module_daemon(tmp_path_factory):
    """As ``start_daemon``, for daemons shared by the tests of a module: stopped after its last test."""
    from tests.daemon_helpers import DaemonFactory

    factory = DaemonFactory(lambda: tmp_path_factory.mktemp("daemon"))
    yield factory
    factory.close()


# ------------------------------------------------------------ the e2e guard


@pytest.fixture(scope="session")
def _native_kernels():
    """Build (or load from the cache) the engine's native CPU kernels before the guard is armed: the build runs
    the compiler, which is the session's setup, not a test's process. Every engine of the session then finds
    them loaded; without a compiler it finds None and takes the pure-torch path, as a worker would."""
    from ringstream.daemon.engine.kernels import native_ops

    native_ops()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current_item
    _current_item = item
    try:
        return (yield)
    finally:
        _current_item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "setup":  # a new run of the test (a rerun starts afresh)
        item.stash[_FAILED] = report.failed
    elif report.failed:
        item.stash[_FAILED] = True
    return report


def refuse_unless_e2e(what: str) -> None:
    """Raise AssertionError if the current test is not marked ``e2e`` (outside a test: do nothing)."""
    item = _current_item
    if item is not None and item.get_closest_marker(E2E) is None:
        raise AssertionError(
            f"{item.nodeid} starts a process ({what}) but is not marked e2e: mark the test with "
            f"@pytest.mark.e2e (or its module with pytestmark = pytest.mark.e2e when all its tests start one); "
            f"the fast tier (-m 'not e2e') must start no process")


def _guarded(function, what: str):
    @functools.wraps(function)
    def guarded(*args, **kwargs):
        refuse_unless_e2e(what)
        return function(*args, **kwargs)

    return guarded


GUARDED = [
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
    (multiprocessing.util, "spawnv_passfds", "multiprocessing.util.spawnv_passfds"),
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),
    *((os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
      if hasattr(os, name)),
]
"""(owner, attribute, name): every way a test could start a process, each checked before it does."""


@pytest.fixture(scope="session", autouse=True)
def _e2e_guard(_native_kernels):
    """For the whole session: starting a process fails in a test not marked ``e2e`` (see the module)."""
    with pytest.MonkeyPatch.context() as patch:
        for owner, attribute, what in GUARDED:
            patch.setattr(owner, attribute, _guarded(getattr(owner, attribute), what))
        yield

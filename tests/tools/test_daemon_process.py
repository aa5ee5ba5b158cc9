"""The one daemon launcher: ready handshake, start errors, the stop path, nothing left behind."""

from __future__ import annotations

import contextlib
import signal

import psutil
import pytest

from ringstream.ipc.client import Client
from ringstream.daemon.launcher import DaemonProcess, DaemonStartError, wait_exit
from tests.daemon_helpers import DaemonFactory

pytestmark = pytest.mark.e2e

SYNTHETIC = ("--engine", "synthetic")


def test_ready_on_enter_and_nothing_left_after_exit():
    with DaemonProcess(*SYNTHETIC, "--devices", "cpu,cpu") as daemon:
        assert daemon.proc.poll() is None
        assert len(daemon.worker_pids()) == 2
        workers = daemon.worker_pids()
        with Client(daemon.address) as client:
            assert client.status().ready
            assert client.complete(prompt_token_ids=[5, 6, 7], max_tokens=2).text == " t0 t1"
        assert daemon.segments()
        runtime_dir = daemon.runtime_dir
    assert daemon.proc.returncode == 0
    assert daemon.leftovers.clean, daemon.leftovers
    assert not daemon.segments()
    assert not wait_exit(workers, 0.0)
    assert not runtime_dir.exists(), "the runtime directory made for the daemon was not removed"


def test_a_daemon_that_exits_before_it_is_ready_fails_the_start_with_its_log(tmp_path):
    daemon = DaemonProcess(*SYNTHETIC, "--devices", "cpu", "--config", str(tmp_path / "missing.toml"),
                           runtime_dir=tmp_path)
    with pytest.raises(DaemonStartError, match="exited with code 2 before it was ready") as error:
        with daemon:
            pass
    assert "missing.toml" in str(error.value)  # the daemon's own message, quoted from its log
    assert daemon.leftovers.clean
    assert tmp_path.exists(), "a runtime directory it was given is not its to remove"


def test_a_daemon_that_does_not_stop_is_killed_past_the_deadline(tmp_path):
    with contextlib.closing(DaemonProcess(*SYNTHETIC, "--devices", "cpu", runtime_dir=tmp_path)) as daemon:
        daemon.start()
        workers = daemon.worker_pids()
        daemon.proc.send_signal(signal.SIGSTOP)  # a hung front: SIGTERM stays pending
        assert daemon.stop(timeout_s=0.5) == -signal.SIGKILL
        assert daemon.killed
    assert daemon.leftovers.killed and not daemon.leftovers.processes
    assert not wait_exit(workers, 0.0)
    assert not daemon.segments()
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(daemon.pid).status()


def test_the_tests_daemon_factory_writes_settings_and_stops_every_daemon_it_started(tmp_path_factory):
    factory = DaemonFactory(lambda: tmp_path_factory.mktemp("factory"))
    first = factory(*SYNTHETIC, "--devices", "cpu", max_concurrency=3, engine="synthetic")
    second = factory(*SYNTHETIC, "--devices", "cpu")
    assert first.config_path.read_text() == 'max_concurrency = 3\nengine = "synthetic"\n'
    assert second.config_path is None and first.runtime_dir != second.runtime_dir
    with pytest.raises(DaemonStartError, match="before it was ready"):
        factory(*SYNTHETIC, "--devices", "cpu", no_such_setting=1)
    factory.close()
    for daemon in (first, second):
        assert daemon.proc.returncode == 0 and daemon.leftovers.clean, daemon.leftovers

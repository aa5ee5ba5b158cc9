"""Resources: shared memory too small, repeated kills, open-file limits."""

from __future__ import annotations

import glob
import os
import resource
import shutil
import subprocess
import time
import uuid

import psutil
import pytest

from ringstream.daemon.front.worker_pool import open_files_needed
from ringstream.ipc.client import Client
from ringstream.daemon.launcher import serve_command
from tests.daemon_helpers import running_daemon, wait_exit
from tests.reliability.helpers import write_config
from ringstream.tools.soak import wait_for

pytestmark = pytest.mark.e2e

START_FAILURE_S = 60.0
CYCLES = 20
SYNTHETIC = ("--engine", "synthetic", "--devices", "cpu")


def test_rings_larger_than_dev_shm_are_a_clear_start_error(tmp_path):
    free = shutil.disk_usage("/dev/shm").free
    assert 2**40 > free
    config = write_config(tmp_path, f"ring_bytes = {2**40}\n")
    with running_daemon(tmp_path, *SYNTHETIC, "--config", config, ready=False) as d:
        assert d.proc.wait(START_FAILURE_S) == 1  # an exit status, not a signal (SIGBUS would be -7)
        assert "/dev/shm has" in d.log() and f"the ring needs {2**40 + 256}" in d.log()
        assert not d.segments()


def test_a_dev_shm_too_small_for_the_default_rings_is_a_clear_start_error(tmp_path):
    """In a private mount namespace /dev/shm is a 64 KiB tmpfs: the 4 MiB ring cannot be reserved."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs unshare --mount (root or CAP_SYS_ADMIN)")
    instance = f"shm{uuid.uuid4().hex[:8]}"
    serve = serve_command(instance, f"ipc://{tmp_path}/{instance}.sock", SYNTHETIC)
    script = 'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$@"'
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", *serve], capture_output=True, text=True,
                            timeout=START_FAILURE_S, env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path)))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "/dev/shm has" in result.stderr and "bytes free; the ring needs" in result.stderr


def test_twenty_start_and_kill_cycles_leave_no_pile_of_segments_or_processes(tmp_path):
    """Each front is SIGKILLed while its worker still loads (every fifth: once serving) and the next starts at once.

    A worker of a killed front must neither survive nor disturb the next
    start (it would find the next front's ring and report a failed start to it).
    """
    instance = f"cyc{uuid.uuid4().hex[:8]}"
    segments = f"/dev/shm/ringstream-{instance}-*"
    counts, children = [], []
    for cycle in range(CYCLES):
        # ready=False: the rings outlive each killed front, for the next start to reclaim
        with running_daemon(tmp_path, "--instance", instance, *SYNTHETIC, ready=False) as d:
            assert wait_for(lambda: glob.glob(segments) or d.proc.poll() is not None, START_FAILURE_S, 0.01)
            if cycle % 5 == 4:
                with Client(d.address) as client:
                    client.wait_ready(START_FAILURE_S)
            assert d.proc.poll() is None, d.log()[-2000:]
            children += d.child_pids()
            d.proc.kill()
            d.proc.wait()
            counts.append(len(glob.glob(segments)))
    leaked = wait_exit(children, 5.0)
    for pid in leaked:
        psutil.Process(pid).kill()
    assert leaked == []
    assert max(counts) <= 1, counts  # one worker: its ring, reclaimed by each next start
    with running_daemon(tmp_path, "--instance", instance, *SYNTHETIC) as d:
        with Client(d.address) as client:
            assert client.complete(prompt_token_ids=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3
        assert d.stop() == 0
    assert glob.glob(segments) == []


def _limit_open_files(soft: int, hard: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return apply


def test_a_hard_open_file_limit_below_max_clients_is_a_clear_start_error(tmp_path):
    config = write_config(tmp_path, "max_clients = 1024\n")
    with running_daemon(tmp_path, *SYNTHETIC, "--config", config, ready=False,
                        preexec_fn=_limit_open_files(64, 64)) as d:
        assert d.proc.wait(START_FAILURE_S) == 1
        assert f"open-file limit too low: {open_files_needed(1024, 1)} files needed" in d.log()
        assert "hard limit (RLIMIT_NOFILE) is 64" in d.log()
        assert not d.segments()


def test_a_low_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path):
    hard = open_files_needed(1024, 1) + 100
    with running_daemon(tmp_path, *SYNTHETIC, preexec_fn=_limit_open_files(64, hard)) as d:
        assert psutil.Process(d.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (hard, hard)
        assert f"raised the open-file limit from 64 to {hard}" in d.log()
        clients = [Client(d.address) for _ in range(100)]  # more connections than the original soft limit
        try:
            assert all(c.status().ready for c in clients)
        finally:
            for client in clients:
                client.close()
        time.sleep(0.1)

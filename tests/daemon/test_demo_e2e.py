"""``ringstream demo`` end to end: Ctrl-C while it streams ends it with one line, its daemon stopped."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import shutil
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from ringstream.ipc.client import Client
from ringstream.daemon.launcher import START_TIMEOUT_S, STOP_TIMEOUT_S, wait_exit
from ringstream.tools.soak import wait_for

pytestmark = pytest.mark.e2e

POLL_S = 0.01
MAX_TOKENS = 480
"""Near the built-in model's 512-token context: the streams are still running when SIGINT comes."""


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path: the daemon's ipc socket paths under it stay within the
    107 bytes of a Unix socket address (pytest's tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ctrl_c_while_streaming_cancels_stops_the_daemon_and_prints_one_line(short_tmp):
    tmp_path = short_tmp
    demo = subprocess.Popen([sys.executable, "-m", "ringstream.daemon.cli", "demo", "--max-tokens", str(MAX_TOKENS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # the demo's daemon socket goes to TMPDIR; its steps sleep 2 ms (the worker's test
                            # hook), so its streams are still running when SIGINT comes, however fast the engine is
                            env=dict(os.environ, TMPDIR=str(tmp_path), RINGSTREAM_FAULT_INJECT="step_delay_ms=2"))
    daemon: list[psutil.Process] = []
    try:
        sockets = wait_for(lambda: glob.glob(f"{tmp_path}/ringstream-*/*.sock") or demo.poll() is not None,
                           START_TIMEOUT_S, POLL_S)
        assert demo.poll() is None, demo.communicate()
        with Client(f"ipc://{sockets[0]}") as client:
            client.wait_ready(START_TIMEOUT_S)
            daemon = psutil.Process(demo.pid).children(recursive=True)
            streaming = wait_for(lambda: (s := client.status()).running and s.tokens_generated_total,
                                 START_TIMEOUT_S, POLL_S)
            assert streaming, "the demo's streams did not start"
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=STOP_TIMEOUT_S)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.communicate()
        for proc in daemon:  # a session of its own: the demo's group signals do not reach it
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    assert demo.returncode == 130, out + err
    assert "Traceback" not in err and "never retrieved" not in err, err
    # nothing on stderr but the worker's note that the test hook is on
    assert all("test hook RINGSTREAM_FAULT_INJECT active" in line for line in err.strip().splitlines()), err
    assert out.splitlines()[-1].startswith("interrupted: streams cancelled, daemon stopped (exit code 0)"), out
    assert sum(line.startswith("interrupted") for line in out.splitlines()) == 1, out
    assert daemon and not wait_exit([p.pid for p in daemon], 0.0), "the demo's daemon outlived it"
    assert not glob.glob(f"/dev/shm/ringstream-demo-{demo.pid}-*")
    assert not list(tmp_path.glob("ringstream-*")), "the demo left its runtime directory"

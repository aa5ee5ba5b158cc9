"""Every process of a daemon is named by its title in ``ps`` (/proc/PID/cmdline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringstream.ipc.client import Client
from tests.daemon_helpers import running_daemon

pytestmark = pytest.mark.e2e


def _ps_args(pid: int) -> str:
    """The command line as ``ps aux`` shows it: /proc/PID/cmdline's NUL-separated parts joined by spaces."""
    return " ".join(part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part)


def test_front_and_workers_are_named_by_role_instance_and_device(tmp_path):
    # the synthetic engine only names its device, so cuda:0 needs no GPU
    with running_daemon(tmp_path, "--engine", "synthetic", "--devices", "cpu,cuda:0") as d:
        with Client(d.address) as client:
            workers = [w.pid for w in client.status().workers]
        assert _ps_args(d.pid) == f"ringstream: front [{d.instance}]"
        assert [_ps_args(pid) for pid in workers] == ["ringstream: worker 0 cpu", "ringstream: worker 1 cuda:0"]
        assert d.worker_pids() == workers

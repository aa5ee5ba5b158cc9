"""Start-up against leftovers: stale rings of a dead instance, names held by live processes."""

from __future__ import annotations

import glob
import uuid

import pytest

from ringstream.ipc.client import Client
from ringstream.ipc.ring import RingConsumer
from tests.daemon_helpers import running_daemon, wait_exit

pytestmark = pytest.mark.e2e


def test_rings_of_a_killed_instance_are_reclaimed_at_the_next_start(tmp_path):
    instance = f"r{uuid.uuid4().hex[:8]}"
    with running_daemon(tmp_path, "--instance", instance) as first:
        workers = first.worker_pids()
        first.proc.kill()
        first.proc.wait()
        assert not wait_exit(workers, 5.0)
        stale = glob.glob(f"/dev/shm/ringstream-{instance}-*")
        assert stale, "a SIGKILLed front cannot unlink its rings"
        with running_daemon(tmp_path, "--instance", instance) as second:
            with Client(second.address) as client:
                assert client.complete("Return the", max_tokens=3).usage.completion_tokens == 3
            assert second.stop() == 0
        assert not glob.glob(f"/dev/shm/ringstream-{instance}-*")


def test_a_ring_name_held_by_a_live_process_is_a_clear_start_error(tmp_path):
    instance = f"r{uuid.uuid4().hex[:8]}"
    holder = RingConsumer.create(f"ringstream-{instance}-w0", 4096)
    try:
        with running_daemon(tmp_path, "--instance", instance, ready=False) as d:
            assert d.proc.wait(60) == 1
            assert f"ringstream-{instance}-w0" in d.log()
        assert glob.glob(f"/dev/shm/ringstream-{instance}-w0"), "the daemon removed a ring it does not own"
    finally:
        holder.close()
        holder.unlink()

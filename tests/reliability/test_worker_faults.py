"""Worker faults under load: repeated SIGKILL and SIGSTOP, and exceptions inside engine steps.

Every request ends with exactly one terminal message (its stream finished,
resumed on a live worker, or WORKER_FAILED), no stream hangs or loses a
token, and a worker that does not fail is not disturbed.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter

import pytest

from ringstream.ipc.client import Client
from tests.daemon_helpers import running_daemon
from tests.reliability.helpers import status, write_config
from ringstream.tools.soak import check_synthetic_stream, gauges_idle, run_streams, wait_for

pytestmark = pytest.mark.e2e

STEP_MS = 5.0
STALL_S = 1.0
START_TIMEOUT_S = 8.0
DEADLINE_S = 60.0
"""A stream without its terminal message this long after it started counts as hung."""
SYNTHETIC = f'engine = "synthetic"\nsynthetic_step_ms = {STEP_MS}\ndevices = "cpu,cpu"\n'


@pytest.fixture(scope="module")
def daemon(start_module_daemon, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    config = write_config(tmp, SYNTHETIC + f"worker_stall_timeout_s = {STALL_S}\nworker_heartbeat_s = 0.2\n"
                                           f"worker_start_timeout_s = {START_TIMEOUT_S}\n")
    return start_module_daemon("--config", config, runtime_dir=tmp)


def _busy_worker_pid(address: str, exclude: set[int]) -> int:
    """A worker running requests now that is not in ``exclude`` (already hit); waits up to 30 s."""
    pid = wait_for(lambda: next((w.pid for w in status(address).workers
                                 if w.alive and w.running and w.pid not in exclude), 0), 30.0, 0.01)
    assert pid, "no worker became busy"
    return pid


def _check(results, max_tokens: int) -> Counter:
    outcomes = Counter(outcome for outcome, _, _ in results)
    assert set(outcomes) <= {"length", "WORKER_FAILED"}, outcomes  # nothing lost, hung or out of order
    for outcome, chunks, _ in results:
        assert check_synthetic_stream(chunks, max_tokens if outcome == "length" else None) is None
    return outcomes


def test_a_worker_hung_while_restarting_is_killed_after_the_start_timeout(daemon):
    """Found by the soak: a restarted worker stopped before it was ready was never noticed (no heartbeat expected)."""
    before = status(daemon.address)
    readies = daemon.log().count("front worker 0 ready on")
    original = {w.pid for w in before.workers}
    victim = before.workers[0].pid
    os.kill(victim, signal.SIGKILL)
    replacement = wait_for(lambda: next((p for p in daemon.worker_pids() if p not in original), 0), 60.0, 0.005)
    assert replacement
    os.kill(replacement, signal.SIGSTOP)  # hung while it loads
    try:
        assert wait_for(lambda: "restarted worker 0 not ready after" in daemon.log(), START_TIMEOUT_S + 10.0)
        assert wait_for(lambda: daemon.log().count("front worker 0 ready on") > readies, 60.0), "not replaced"
        assert status(daemon.address).workers[0].pid not in (victim, replacement)
    finally:
        try:
            os.kill(replacement, signal.SIGCONT)
        except ProcessLookupError:
            pass
    served = [w.requests_served for w in status(daemon.address).workers]
    results = asyncio.run(run_streams(daemon.address, count=32, concurrency=16,
                                      params=dict(max_tokens=20, ignore_eos=True), deadline_s=DEADLINE_S))
    assert _check(results, 20) == Counter(length=32)
    assert all(w.requests_served > s for w, s in zip(status(daemon.address).workers, served))


def test_repeated_sigkill_and_sigstop_of_workers_under_load(daemon):
    before = status(daemon.address).counters["worker_restarts_total"]
    faults = [signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL]
    stopped, hit = [], set()

    async def inject():
        rng = random.Random(3)
        for sig in faults:
            await asyncio.sleep(rng.uniform(0.3, 0.8))
            pid = await asyncio.to_thread(_busy_worker_pid, daemon.address, hit)
            os.kill(pid, sig)
            hit.add(pid)
            if sig == signal.SIGSTOP:
                stopped.append(pid)

    async def main():
        return await run_streams(daemon.address, count=120, concurrency=16,
                                 params=dict(max_tokens=150, ignore_eos=True), deadline_s=DEADLINE_S,
                                 on_started=inject)

    try:
        results = asyncio.run(main())
    finally:
        for pid in stopped:  # the front killed them; this only guards against a test failure before that
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    outcomes = _check(results, 150)
    assert len(results) == 120
    assert outcomes["length"] >= len(results) // 2, outcomes
    assert wait_for(lambda: gauges_idle(daemon.address), 10.0)
    assert wait_for(lambda: all(w.alive for w in status(daemon.address).workers), 60.0), "a worker was not restarted"
    after = status(daemon.address)
    assert after.counters["worker_restarts_total"] - before == len(faults)
    assert not {w.pid for w in after.workers} & set(stopped)
    with Client(daemon.address) as client:
        chunks = list(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=20, ignore_eos=True))
    assert check_synthetic_stream(chunks, 20) is None


def test_exceptions_in_engine_steps_fail_that_workers_requests_only(tmp_path):
    """Worker 0's engine raises every 40th step (test hook); worker 1 serves on, undisturbed."""
    env = {"RINGSTREAM_FAULT_INJECT": "step_exception_every=40,worker=0"}
    with running_daemon(tmp_path, "--config", write_config(tmp_path, SYNTHETIC), env=env) as d:
        before = status(d.address)
        results = asyncio.run(run_streams(d.address, count=48, concurrency=8,
                                          params=dict(max_tokens=60, ignore_eos=True), deadline_s=DEADLINE_S))
        assert wait_for(lambda: gauges_idle(d.address), 10.0)
        after = status(d.address)
        assert "test hook RINGSTREAM_FAULT_INJECT active" in d.log()
    outcomes = _check(results, 60)
    served = [w.requests_served - b.requests_served for w, b in zip(after.workers, before.workers)]
    # A 60-token request on worker 0 meets a failing step before it ends; one on worker 1 never does.
    assert outcomes["WORKER_FAILED"] == served[0] > 0
    assert outcomes["length"] == served[1] > 0
    assert [w.pid for w in after.workers] == [w.pid for w in before.workers]
    assert all(w.alive for w in after.workers)
    assert after.counters["worker_restarts_total"] == 0


def test_a_sticky_device_error_restarts_the_worker_and_resumes_its_streams(tmp_path):
    """Worker 0's engine raises a CUDA error that poisons the context (test hook): the worker exits instead of
    failing every later request, the pool starts a fresh one, and its streams resume; worker 1 is undisturbed."""
    env = {"RINGSTREAM_FAULT_INJECT": "step_exception_every=60,worker=0,kind=device"}
    config = write_config(tmp_path, SYNTHETIC + f"worker_start_timeout_s = {START_TIMEOUT_S}\n")
    with running_daemon(tmp_path, "--config", config, env=env) as d:
        before = status(d.address)
        results = asyncio.run(run_streams(d.address, count=32, concurrency=8,
                                          params=dict(max_tokens=60, ignore_eos=True), deadline_s=DEADLINE_S))
        assert wait_for(lambda: gauges_idle(d.address), 10.0)
        assert wait_for(lambda: all(w.alive for w in status(d.address).workers), 60.0), "worker 0 not restarted"
        after = status(d.address)
        log = d.log()
    assert "device error that poisons the CUDA context; exiting for a restart" in log
    outcomes = _check(results, 60)
    assert outcomes["length"] == len(results), outcomes  # resumed, not failed: each stream whole and in order
    assert after.counters["worker_restarts_total"] >= 1
    assert after.workers[0].pid != before.workers[0].pid
    assert after.workers[1].pid == before.workers[1].pid

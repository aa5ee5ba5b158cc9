"""Supervision end to end: killed or hung workers are restarted and their streams resume intact."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ipc.client import AsyncClient, Client, WorkerFailed
from tests.daemon_helpers import running_daemon

PROMPTS = ["The socket module", "Return the", "A list of", "If the file"]
PARAMS = dict(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sup")
    config = tmp / "ringstream.toml"
    config.write_text("worker_stall_timeout_s = 3.0\n")
    with running_daemon(tmp, "--devices", "cpu,cpu", "--config", str(config)) as d:
        with Client(d.address) as client:
            d.alone = {p: client.complete(p, **PARAMS).token_ids for p in PROMPTS}
        yield d


def _busy_worker_pid(daemon) -> int:
    """Pid of a live worker that is running requests now (waits until there is one)."""
    deadline = time.monotonic() + 60
    with Client(daemon.address) as client:
        while time.monotonic() < deadline:
            workers = [w for w in client.status().workers if w.alive and w.running]
            if workers:
                return workers[0].pid
            time.sleep(0.01)
    raise AssertionError("no worker became busy")


async def _round(daemon, fault):
    """Run the prompts at once, inject ``fault`` after a few tokens; return each stream's outcome."""
    async with AsyncClient(daemon.address) as client:
        started = asyncio.Event()

        async def one(prompt):
            chunks = []
            try:
                async for chunk in client.generate(prompt, **PARAMS):
                    chunks.append(chunk)
                    if sum(len(c.token_ids) for c in chunks) >= 3:
                        started.set()
            except WorkerFailed:
                return chunks, "failed"
            return chunks, chunks[-1].finish_reason

        tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
        await started.wait()
        await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def _check(daemon, results):
    for prompt, (chunks, outcome) in zip(PROMPTS, results):
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        if outcome == "failed":
            continue
        assert outcome == "length"
        assert [t for c in chunks for t in c.token_ids] == daemon.alone[prompt], "resumed stream differs"


def test_sigkill_a_busy_worker_ten_times(daemon):
    with Client(daemon.address) as client:
        before = client.status().counters["worker_restarts_total"]
    outcomes = []
    for _ in range(10):
        results = asyncio.run(_round(daemon, lambda: os.kill(_busy_worker_pid(daemon), signal.SIGKILL)))
        _check(daemon, results)
        outcomes += [o for _, o in results]
    assert outcomes.count("length") >= len(outcomes) // 2, outcomes
    with Client(daemon.address) as client:
        assert client.complete("Return the", **PARAMS).token_ids == daemon.alone["Return the"]
        assert client.status().counters["worker_restarts_total"] - before == 10


def test_a_stopped_worker_counts_as_dead_and_its_streams_resume(daemon):
    stopped = []

    def stop_one():
        pid = _busy_worker_pid(daemon)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        results = asyncio.run(_round(daemon, stop_one))
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    _check(daemon, results)
    assert all(o == "length" for _, o in results)
    with Client(daemon.address) as client:
        deadline = time.monotonic() + 120
        while True:
            workers = client.status().workers
            if all(w.alive for w in workers) and stopped[0] not in {w.pid for w in workers}:
                break
            assert time.monotonic() < deadline, "the stopped worker was not replaced"
            time.sleep(0.1)

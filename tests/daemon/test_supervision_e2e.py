"""Supervision end to end: killed or hung workers are restarted and their streams resume intact."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request

import pytest

from ringstream.daemon.worker.faults import FAULT_INJECT_ENV
from ringstream.ipc.client import AsyncClient, Client, WorkerFailed

pytestmark = pytest.mark.e2e

PROMPTS = ["The socket module", "Return the", "A list of", "If the file"]
PARAMS = dict(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    port = _free_port()
    # Every engine step sleeps 5 ms (the worker's test hook): a 60-token stream lasts >= 0.3 s however fast the
    # engine is, so a worker is still busy when the fault comes.
    d = start_module_daemon("--devices", "cpu,cpu", "--metrics-port", str(port), worker_stall_timeout_s=3.0,
                            env={FAULT_INJECT_ENV: "step_delay_ms=5"})
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    with Client(d.address) as client:
        d.alone = {p: client.complete(p, **PARAMS).token_ids for p in PROMPTS}
    return d


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name{labels}": value} (labels without quotes, as in status --json)."""
    samples = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key.replace('"', "")] = float(value)
    return samples


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


KILLS = 6
"""Rounds of SIGKILL: restart backoff doubles per failure, so each more round costs more than the last."""


def test_sigkill_a_busy_worker_repeatedly(daemon):
    with Client(daemon.address) as client:
        before = client.status().counters["worker_restarts_total"]
    outcomes = []
    for _ in range(KILLS):
        results = asyncio.run(_round(daemon, lambda: os.kill(_busy_worker_pid(daemon), signal.SIGKILL)))
        _check(daemon, results)
        outcomes += [o for _, o in results]
    assert outcomes.count("length") >= len(outcomes) // 2, outcomes
    with Client(daemon.address) as client:
        assert client.complete("Return the", **PARAMS).token_ids == daemon.alone["Return the"]
        status = client.status()
        assert status.counters["worker_restarts_total"] - before == KILLS
    scraped = _scrape(daemon.metrics_url)
    assert scraped["ringstream_worker_restarts_total"] == status.metrics["ringstream_worker_restarts_total"] >= KILLS


def test_metrics_exporter_and_status_show_the_same_figures(daemon):
    with Client(daemon.address) as client:
        before = _scrape(daemon.metrics_url)
        for prompt in PROMPTS:
            client.complete(prompt, max_tokens=5, temperature=0.0)
        try:
            client.complete("x", max_tokens=10**6)
        except Exception:
            pass
        time.sleep(0.6)  # gauges refresh every housekeeping tick
        status = client.status()
    after = _scrape(daemon.metrics_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["ringstream_requests_total{status=length}"] == len(PROMPTS)
    assert delta["ringstream_generation_tokens_total"] == 5 * len(PROMPTS)
    assert delta["ringstream_time_to_first_token_seconds_count"] == len(PROMPTS)
    # one sample per stream per ring read that carried its tokens: 4 gaps each, fewer when tokens were read together
    assert len(PROMPTS) <= delta["ringstream_inter_token_latency_seconds_count"] <= 4 * len(PROMPTS)
    assert delta["ringstream_dropped_messages_total{reason=invalid}"] == 1
    for key in ("ringstream_kv_cache_usage_ratio{worker=0}", "ringstream_ring_fill_ratio{worker=1}",
                "ringstream_worker_up{device=cpu,worker=0}", "ringstream_requests_running"):
        assert key in after and key in status.metrics
    assert status.metrics["ringstream_generation_tokens_total"] == after["ringstream_generation_tokens_total"]


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

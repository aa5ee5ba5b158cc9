"""Overload: about ten times the daemon's capacity, offered at a fixed rate.

Requests beyond the bounded queue get QUEUE_FULL at once (P99 round trip
under 10 ms, measured by the client); admitted ones finish within their
deadline; the front's RSS stays flat; every gauge returns to zero.
"""

from __future__ import annotations

import gc
import time
import urllib.request
import weakref

import pytest

from ringstream.daemon.front.shell import HOUSEKEEPING_S
from ringstream.daemon.front.scheduler import Scheduler, SchedulerPolicy, WorkerBudget
from ringstream.ipc import protocol as P
from tests.reliability.helpers import MIB, rss, status
from ringstream.tools.soak import gauges_idle, offer_load, percentile, wait_for

# Timed against a real daemon on a shared 2-core host: one rerun absorbs a host hiccup.
pytestmark = pytest.mark.flaky(reruns=2)

STEP_S = 0.002
SLOTS = 4
QUEUE_SIZE = 16
MAX_TOKENS = 16
CAPACITY_HZ = SLOTS / (MAX_TOKENS * STEP_S)
"""Requests per second the worker can finish: 4 slots, 16 steps of 2 ms each = 125/s."""
OFFERED_HZ = 10 * CAPACITY_HZ
LOAD_S = 4.0
TIMEOUT_S = 2.0
"""Each request's own deadline; the worst wait (a full queue ahead) is QUEUE_SIZE / CAPACITY_HZ = 0.13 s."""
QUEUE_FULL_P99_S = 0.050
"""CI bound for the QUEUE_FULL round trip at P99. The target is 10 ms, which the soak measures on a
quiet host (docs/RELIABILITY.md); two shared cores running the worker and the load make CI noisier."""
RSS_BOUND = 30 * MIB


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    port = _free_port()
    d = start_module_daemon("--metrics-port", str(port), engine="synthetic", synthetic_step_ms=STEP_S * 1000,
                            devices="cpu", max_num_seqs=SLOTS, max_concurrency=SLOTS, queue_size=QUEUE_SIZE)
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return d


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(i: int) -> P.Generate:
    return P.make_generate(id=f"r{i}", prompt_token_ids=[5, 6, 7], max_tokens=MAX_TOKENS, ignore_eos=True,
                           stream=False, timeout_s=TIMEOUT_S)


def _gauges(url: str) -> dict[str, float]:
    samples = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(("ringstream_requests_running", "ringstream_requests_waiting", "ringstream_kv_cache_usage")):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


@pytest.mark.e2e
def test_ten_times_capacity_is_refused_fast_and_the_admitted_meet_their_deadlines(daemon):
    offer_load(daemon.address, OFFERED_HZ, 1.0, _request)  # warm-up
    rss_before = rss(daemon.proc.pid)
    outcomes = offer_load(daemon.address, OFFERED_HZ, LOAD_S, _request)
    growth = rss(daemon.proc.pid) - rss_before

    assert len(outcomes) >= 0.95 * OFFERED_HZ * LOAD_S, "the client could not offer the load"
    unanswered = [rid for rid, o in outcomes.items() if not o.kind]
    assert unanswered == []
    full = [o.answered - o.sent for o in outcomes.values() if o.kind == "QUEUE_FULL"]
    admitted = [o for o in outcomes.values() if o.kind != "QUEUE_FULL"]
    assert len(full) > 0.8 * len(outcomes)
    assert percentile(full, 99) < QUEUE_FULL_P99_S, f"QUEUE_FULL P99 {percentile(full, 99) * 1000:.1f} ms"
    assert len(admitted) >= 0.5 * CAPACITY_HZ * LOAD_S
    assert {o.kind for o in admitted} == {"length"}
    assert all(o.answered - o.sent < TIMEOUT_S for o in admitted)
    assert all(len(o.chunks) == 1 and len(o.chunks[0].token_ids) == MAX_TOKENS for o in admitted)
    assert growth < RSS_BOUND, f"front RSS grew {growth / MIB:.1f} MiB"


@pytest.mark.e2e
def test_every_gauge_is_back_to_zero_afterwards(daemon):
    offer_load(daemon.address, OFFERED_HZ, 1.0, _request, drain_s=0.0)  # leaves requests running and waiting
    assert wait_for(lambda: gauges_idle(daemon.address), 5.0)
    time.sleep(2 * HOUSEKEEPING_S)  # the exported gauges refresh every housekeeping tick
    gauges = _gauges(daemon.metrics_url)
    assert gauges["ringstream_requests_running"] == 0
    assert gauges["ringstream_kv_cache_usage_ratio{worker=\"0\"}"] == 0
    assert all(v == 0 for k, v in gauges.items() if k.startswith("ringstream_requests_waiting"))
    reply = status(daemon.address)
    worker = reply.workers[0]
    assert (reply.running, reply.waiting, worker.running, worker.kv_cache_tokens_used) == (0, 0, 0, 0)


class _Request:
    """The fields the scheduler reads and writes (its Schedulable protocol)."""

    def __init__(self, arrival: float) -> None:
        self.priority, self.arrival, self.num_prompt_tokens, self.max_tokens = 0, arrival, 3, MAX_TOKENS
        self.prompt_token_ids, self.num_output_tokens, self.kv_charge = [5, 6, 7], 0, 0
        self.worker, self.started, self.sched_token, self.served_on = None, 0.0, 0, None


def test_the_scheduler_keeps_no_request_that_left_it():
    """Found by the soak: stale entries of the eviction heap kept every admitted request alive (RSS grew)."""
    sched = Scheduler(SchedulerPolicy(queue_size=QUEUE_SIZE, max_concurrency=SLOTS))
    capacity = P.WorkerCapacity(max_num_seqs=SLOTS, max_model_len=512, kv_cache_tokens=10**6, block_size=0)
    sched.workers = [WorkerBudget(0, capacity, ready=True)]
    gone = []
    for i in range(10_000):
        req = _Request(arrival=i * 0.001)
        sched.add(req)
        gone.append(weakref.ref(req))
        for placed, _ in sched.schedule(now=i * 0.001):
            sched.finished(placed)
    del req, placed
    gc.collect()
    alive = sum(ref() is not None for ref in gone)
    assert alive <= 2 * QUEUE_SIZE + 64, f"{alive} requests still referenced"

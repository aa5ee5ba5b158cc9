"""Scheduler driven by hand-made requests and fake worker outcomes: no torch, no sockets."""

import itertools
import random

from ringstream.daemon.front.scheduler import Scheduler, SchedulerPolicy, WorkerBudget
from ringstream.ipc import protocol as P

_ids = itertools.count()


class FakeRequest:
    def __init__(self, priority=0, arrival=0.0, prompt=10, max_tokens=10):
        self.id = next(_ids)
        self.priority = priority
        self.arrival = arrival
        self.num_prompt_tokens = prompt
        self.prompt_token_ids = [self.id % 1000 + 3] * prompt
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.worker = None
        self.started = 0.0
        self.served_on = None
        self.sched_token = 0
        self.kv_charge = 0
        self.preemptible = True

    def __repr__(self):
        return f"R{self.id}(p={self.priority}, t={self.arrival})"


def make(workers=1, slots=2, kv_tokens=1000, max_model_len=512, **policy):
    sched = Scheduler(SchedulerPolicy(**{"max_concurrency": 64, **policy}))
    capacity = P.WorkerCapacity(max_num_seqs=slots, max_model_len=max_model_len, kv_cache_tokens=kv_tokens,
                                block_size=0)
    sched.workers = [WorkerBudget(i, capacity, ready=True) for i in range(workers)]
    return sched


def started(sched, now=0.0):
    return [r for r, _ in sched.schedule(now)]


def test_lower_priority_first_then_fifo():
    sched = make(slots=10, aging_rate=0.0)
    reqs = [FakeRequest(priority=p, arrival=t) for t, p in enumerate([5, 0, 5, -1, 0])]
    for r in reqs:
        assert sched.add(r) == (True, None)
    assert started(sched) == [reqs[3], reqs[1], reqs[4], reqs[0], reqs[2]]


def test_aging_bounds_the_wait_under_a_constant_stream_of_urgent_work():
    """A priority-10 request is served within 10 / aging_rate s plus one slot turnover."""
    rate = 2.0
    sched = make(slots=1, aging_rate=rate)
    low = FakeRequest(priority=10, arrival=0.0)
    sched.add(low)
    running = None
    t = 0.0
    while True:
        sched.add(FakeRequest(priority=0, arrival=t))  # a fresh urgent request every 0.1 s
        if running is not None:
            sched.finished(running)
        now_started = started(sched, t)
        assert len(now_started) == 1
        running = now_started[0]
        if running is low:
            break
        t += 0.1
        assert t < 100, "starved"
    assert t <= 10 / rate + 0.1 + 1e-9


def test_queue_bound_and_priority_limits_reject():
    sched = make(queue_size=3, priority_limits={10: 1})
    assert sched.add(FakeRequest(priority=10))[0]
    assert sched.add(FakeRequest(priority=10)) == (False, None)
    assert sched.add(FakeRequest(priority=0))[0] and sched.add(FakeRequest(priority=0))[0]
    assert sched.add(FakeRequest(priority=-5)) == (False, None)
    assert sched.num_waiting == 3 and sched.waiting_by_priority() == {0: 2, 10: 1}


def test_evict_policy_displaces_the_least_urgent_newest_request():
    sched = make(queue_size=3, full_policy="evict", aging_rate=0.0)
    a, b, c = FakeRequest(5, 0.0), FakeRequest(9, 1.0), FakeRequest(9, 2.0)
    for r in (a, b, c):
        sched.add(r)
    same = FakeRequest(9, 3.0)
    assert sched.add(same) == (False, None)  # not strictly more urgent
    urgent = FakeRequest(0, 4.0)
    assert sched.add(urgent) == (True, c)
    assert sched.waiting() == [urgent, a, b]


def test_budget_is_never_exceeded_never_negative_and_returns_to_zero():
    rng = random.Random(7)
    sched = make(workers=3, slots=4, kv_tokens=300, queue_size=10_000)
    running = []
    for step in range(2000):
        if rng.random() < 0.6:
            sched.add(FakeRequest(rng.randint(0, 3), step, rng.randint(1, 100), rng.randint(1, 100)))
        if running and rng.random() < 0.5:
            sched.finished(running.pop(rng.randrange(len(running))))
        running += started(sched, step)
        for w in sched.workers:
            assert 0 <= w.running <= 4 and 0 <= w.kv_tokens_used <= 300
    for r in running:
        sched.finished(r)
    while sched.num_waiting:
        for r in started(sched):
            sched.finished(r)
    assert all(w.running == 0 and w.kv_tokens_used == 0 for w in sched.workers)


def test_head_of_line_is_never_overtaken():
    sched = make(slots=8, kv_tokens=100, aging_rate=0.0)
    first = FakeRequest(0, 0.0, 40, 40)
    sched.add(first)
    started(sched)
    big, small = FakeRequest(0, 1.0, 60, 40), FakeRequest(0, 2.0, 1, 1)  # 41 + 61 > 100 tokens
    sched.add(big)
    sched.add(small)
    assert started(sched) == []
    sched.finished(first)
    assert started(sched) == [big, small]


def test_equal_workers_get_equal_shares_and_unready_get_none():
    sched = make(workers=3, slots=8, queue_size=16)
    sched.workers[2].ready = False
    for _ in range(8):
        sched.add(FakeRequest())
    placed = sched.schedule(0.0)
    assert [sum(1 for _, w in placed if w.index == i) for i in range(3)] == [4, 4, 0]


def test_max_concurrency_caps_slots_and_can_change_live():
    sched = make(slots=16, max_concurrency=8)
    for t in range(20):
        sched.add(FakeRequest(arrival=t))
    first = started(sched)
    assert len(first) == 8
    sched.policy.max_concurrency = 2
    for r in first[:5]:
        sched.finished(r)
    assert started(sched) == []  # 3 still running > 2: drains down, nothing killed
    for r in first[5:7]:
        sched.finished(r)
    assert len(started(sched)) == 1
    sched.policy.max_concurrency = 16
    assert len(started(sched)) == 11 and sched.num_running == 13 and sched.num_waiting == 0


def test_preemption_picks_least_urgent_most_recent_and_only_when_strictly_more_urgent():
    sched = make(slots=3, aging_rate=0.0)
    old10, mid5, new10 = FakeRequest(10, 0.0), FakeRequest(5, 1.0), FakeRequest(10, 2.0)
    for i, r in enumerate((old10, mid5, new10)):
        sched.add(r)
        started(sched, now=float(i))
    peer = FakeRequest(10, 3.0)
    sched.add(peer)
    assert sched.preempt() is None  # equal priority never preempts
    sched.remove(peer)
    urgent = FakeRequest(0, 4.0)
    sched.add(urgent)
    victim, worker = sched.preempt()
    assert victim is new10 and worker == 0 and new10.worker is None
    assert started(sched) == [urgent]
    sched.requeue(new10)
    assert sched.waiting() == [new10]
    assert sched.workers[0].served == 4  # each request once
    sched.finished(urgent)
    assert started(sched) == [new10]
    assert sched.workers[0].served == 4, "a request resumed where it ran counts once"


def test_no_preemption_when_switched_off_or_when_capacity_is_free():
    sched = make(slots=2, preemption=False)
    sched.add(FakeRequest(10))
    started(sched)
    sched.add(FakeRequest(10))
    started(sched)
    sched.add(FakeRequest(0))
    assert sched.preempt() is None
    sched.policy.preemption = True
    assert sched.preempt() is not None


def test_aging_rate_change_rekeys_the_queue():
    sched = make(slots=1, aging_rate=0.0)
    old_low, new_high = FakeRequest(5, 0.0), FakeRequest(0, 100.0)
    sched.add(old_low)
    sched.add(new_high)
    assert sched.waiting() == [new_high, old_low]
    sched.set_aging_rate(1.0)  # old_low: 5 + 0 = 5 < new_high: 0 + 100
    assert sched.waiting() == [old_low, new_high]


def test_clear_worker_returns_its_running_requests():
    sched = make(workers=2, slots=2)
    reqs = [FakeRequest(arrival=t) for t in range(4)]
    for r in reqs:
        sched.add(r)
    placed = sched.schedule(0.0)
    on_one = {r for r, w in placed if w.index == 1}
    assert set(sched.clear_worker(1)) == on_one
    assert sched.workers[1].running == 0 and not sched.workers[1].ready


def test_budget_follows_tokens_in_use():
    """A request is charged prompt + output so far + 1, grows per token streamed, and frees it all at the end."""
    sched = make(slots=8, kv_tokens=100, aging_rate=0.0)
    a, b = FakeRequest(0, 0.0, 40, 1000), FakeRequest(0, 1.0, 40, 1000)
    sched.add(a)
    sched.add(b)
    assert started(sched) == [a, b]  # max_tokens is not reserved: 41 + 41 <= 100
    worker = sched.workers[0]
    assert worker.kv_tokens_used == 82
    for _ in range(10):
        sched.grow(a)
    assert worker.kv_tokens_used == 92 and a.kv_charge == 51
    c = FakeRequest(0, 2.0, 10, 1)
    sched.add(c)
    assert started(sched) == []  # 92 + 11 > 100
    sched.finished(a)
    assert worker.kv_tokens_used == 41 and a.kv_charge == 0
    assert started(sched) == [c]
    resumed = FakeRequest(0, 3.0, 10, 100)
    resumed.num_output_tokens = 20
    assert sched.kv_tokens(resumed) == 31


def test_prefix_aware_placement_prefers_the_worker_holding_the_prefix():
    sched = make(workers=2, slots=8, kv_tokens=1000, aging_rate=0.0)
    for w in sched.workers:
        w.capacity.block_size, w.capacity.prefix_caching = 4, True
    shared = list(range(3, 23))
    first = FakeRequest(0, 0.0, 0, 1)
    first.prompt_token_ids, first.num_prompt_tokens = shared + [50], 21
    sched.add(first)
    (placed,) = sched.schedule(0.0)
    home = placed[1]
    other = sched.workers[1 - home.index]
    other.kv_tokens_used = 0  # the other worker is idle: least used, yet the prefix wins
    second = FakeRequest(0, 1.0, 0, 1)
    second.prompt_token_ids, second.num_prompt_tokens = shared + [60, 61], 22
    sched.add(second)
    assert sched.schedule(0.0)[0][1] is home
    # a prompt sharing nothing goes to the least used worker
    third = FakeRequest(0, 2.0, 0, 1)
    third.prompt_token_ids, third.num_prompt_tokens = list(range(500, 530)), 30
    sched.add(third)
    assert sched.schedule(0.0)[0][1] is other
    # the prefix's worker clearly busier: balance wins
    home.kv_tokens_used = 900
    fourth = FakeRequest(0, 3.0, 0, 1)
    fourth.prompt_token_ids, fourth.num_prompt_tokens = shared + [70], 21
    sched.add(fourth)
    assert sched.schedule(0.0)[0][1] is other


def test_max_request_tokens_is_the_largest_ready_worker_limit():
    sched = make(workers=2, kv_tokens=1000, max_model_len=512)
    assert sched.max_request_tokens() == 512
    for w in sched.workers:
        w.ready = False
    assert sched.max_request_tokens() == 0


def test_a_prefix_placed_on_a_worker_is_not_charged_again():
    """Eight 105-token prompts sharing 96 tokens fit a 180-token worker together (one alone costs 106)."""
    sched = make(workers=1, slots=8, kv_tokens=180, aging_rate=0.0)
    sched.workers[0].capacity.block_size, sched.workers[0].capacity.prefix_caching = 16, True
    shared = list(range(3, 99))  # six full blocks
    requests = []
    for i in range(8):
        req = FakeRequest(0, float(i), 0, 1)
        req.prompt_token_ids, req.num_prompt_tokens = shared + [200 + i] * 9, 105
        requests.append(req)
        sched.add(req)
    assert started(sched) == requests
    assert [r.kv_charge for r in requests] == [106] + [10] * 7
    assert sched.workers[0].kv_tokens_used == 106 + 70
    for req in requests:
        sched.finished(req)
    assert sched.workers[0].kv_tokens_used == 0


def test_priority_preemption_still_works_when_running_requests_outgrew_the_charged_capacity():
    """Running requests grow past the charged capacity (the engine pages them); a more urgent one still gets a slot."""
    sched = make(slots=2, kv_tokens=100, aging_rate=0.0)
    low = [FakeRequest(5, 0.0, 10, 500), FakeRequest(5, 1.0, 10, 500)]
    for now, req in enumerate(low):
        sched.add(req)
        assert started(sched, float(now)) == [req]
    for req in low:
        sched.grow(req, 80)  # 2 x 91 charged > 100
    urgent = FakeRequest(-10, 2.0, 10, 10)
    sched.add(urgent)
    assert started(sched) == []
    victim, _ = sched.preempt()
    assert victim is low[1]  # the least urgent, most recently started
    assert started(sched) == [urgent]

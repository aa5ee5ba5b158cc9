"""Scheduler without sockets or torch: queue bounds, FIFO order, budgets, placement."""

from dataclasses import dataclass

from daemon.scheduler import Scheduler, WorkerBudget


@dataclass(eq=False)
class FakeRequest:
    num_prompt_tokens: int
    max_tokens: int
    worker: int | None = None


def make(queue_size=4, max_concurrency=2, workers=1, slots=2, kv_tokens=1000, max_model_len=512):
    sched = Scheduler(queue_size, max_concurrency)
    sched.workers = [WorkerBudget(i, max_num_seqs=slots, max_model_len=max_model_len, kv_cache_tokens=kv_tokens,
                                  ready=True) for i in range(workers)]
    return sched


def test_queue_is_bounded():
    sched = make(queue_size=2)
    assert sched.add(FakeRequest(1, 1)) and sched.add(FakeRequest(1, 1))
    assert not sched.add(FakeRequest(1, 1))
    assert len(sched.waiting) == 2


def test_fifo_and_concurrency_limit():
    sched = make(max_concurrency=2, slots=4)
    reqs = [FakeRequest(10, 10) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    placed = [r for r, _ in sched.schedule()]
    assert placed == reqs[:2]
    assert list(sched.waiting) == reqs[2:]
    sched.finished(reqs[0])
    assert [r for r, _ in sched.schedule()] == [reqs[2]]


def test_kv_budget_is_never_exceeded_and_returns_to_zero():
    sched = make(max_concurrency=8, slots=8, kv_tokens=100)
    reqs = [FakeRequest(30, 20) for _ in range(4)]
    for r in reqs:
        sched.add(r)
    placed = [r for r, _ in sched.schedule()]
    assert len(placed) == 2 and sched.workers[0].kv_tokens_used == 100
    for r in placed:
        sched.finished(r)
    placed = [r for r, _ in sched.schedule()]
    assert len(placed) == 2
    for r in placed:
        sched.finished(r)
    assert sched.workers[0].kv_tokens_used == 0 and sched.workers[0].running == 0


def test_head_of_line_blocks_so_long_requests_do_not_starve():
    sched = make(max_concurrency=8, slots=8, kv_tokens=100)
    first = FakeRequest(40, 40)
    sched.add(first)
    sched.schedule()
    big, small = FakeRequest(50, 40), FakeRequest(1, 1)
    sched.add(big)
    sched.add(small)
    assert sched.schedule() == []
    sched.finished(first)
    assert [r for r, _ in sched.schedule()] == [big, small]


def test_equal_workers_get_equal_shares_and_unready_get_none():
    sched = make(queue_size=16, max_concurrency=8, slots=8, workers=3)
    sched.workers[2].ready = False
    for _ in range(8):
        sched.add(FakeRequest(10, 10))
    placed = sched.schedule()
    counts = [sum(1 for _, w in placed if w.index == i) for i in range(3)]
    assert counts == [4, 4, 0]


def test_max_request_tokens_is_the_largest_ready_worker_limit():
    sched = make(workers=2, kv_tokens=1000, max_model_len=512)
    assert sched.max_request_tokens() == 512
    for w in sched.workers:
        w.ready = False
    assert sched.max_request_tokens() == 0

"""Scheduler: the waiting queue and each worker's budget. No sockets, no torch.

``schedule()`` moves requests from *waiting* to *running* on a worker while
that worker has a free slot (``max_concurrency``, capped by the engine's
``max_num_seqs``) and free KV-cache tokens for the request's whole length
(prompt + ``max_tokens``), the way TGI's router admits by token budget. The
queue is FIFO and bounded: ``add()`` refuses at once when it is full, so the
front can answer ``QUEUE_FULL`` without waiting. Placement: the eligible worker
with the lowest KV-cache use (ties to the lowest index), so equal workers get
equal shares.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol


class Schedulable(Protocol):
    """What the scheduler needs to know of a request."""

    num_prompt_tokens: int
    max_tokens: int
    worker: int | None


@dataclass(slots=True)
class WorkerBudget:
    """Capacity and use of one worker, in slots and KV-cache tokens."""

    index: int
    max_num_seqs: int = 0
    max_model_len: int = 0
    kv_cache_tokens: int = 0
    running: int = 0
    kv_tokens_used: int = 0
    ready: bool = False
    served: int = 0

    def fits(self, tokens: int, max_concurrency: int) -> bool:
        """True if one more request of ``tokens`` KV tokens fits now."""
        return (
            self.ready
            and self.running < min(max_concurrency, self.max_num_seqs)
            and self.kv_tokens_used + tokens <= self.kv_cache_tokens
        )


class Scheduler:
    """Bounded FIFO queue plus per-worker budgets; see the module docstring."""

    def __init__(self, queue_size: int, max_concurrency: int) -> None:
        self.queue_size = queue_size
        self.max_concurrency = max_concurrency
        self.waiting: deque[Schedulable] = deque()
        self.workers: list[WorkerBudget] = []

    @staticmethod
    def kv_tokens(req: Schedulable) -> int:
        """KV-cache tokens a request may occupy: prompt plus every token it may generate."""
        return req.num_prompt_tokens + req.max_tokens

    def max_request_tokens(self) -> int:
        """The largest prompt + max_tokens any ready worker could ever hold (0 if none ready)."""
        return max((min(w.max_model_len, w.kv_cache_tokens) for w in self.workers if w.ready), default=0)

    def add(self, req: Schedulable) -> bool:
        """Queue ``req``; False (nothing queued) when ``queue_size`` requests already wait."""
        if len(self.waiting) >= self.queue_size:
            return False
        self.waiting.append(req)
        return True

    def remove(self, req: Schedulable) -> bool:
        """Take a waiting request out of the queue; False if it was not waiting."""
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True

    def schedule(self) -> list[tuple[Schedulable, WorkerBudget]]:
        """Assign waiting requests, oldest first, while some worker has room.

        The head of the queue blocks the rest (FIFO): a long request is never
        overtaken by shorter ones and so cannot starve.
        """
        placed = []
        while self.waiting:
            req = self.waiting[0]
            tokens = self.kv_tokens(req)
            candidates = [w for w in self.workers if w.fits(tokens, self.max_concurrency)]
            if not candidates:
                break
            worker = min(candidates, key=lambda w: (w.kv_tokens_used / max(w.kv_cache_tokens, 1), w.running, w.index))
            self.waiting.popleft()
            worker.running += 1
            worker.kv_tokens_used += tokens
            worker.served += 1
            req.worker = worker.index
            placed.append((req, worker))
        return placed

    def finished(self, req: Schedulable) -> None:
        """Give back the budget of a running request that ended (any reason)."""
        if req.worker is None:
            return
        worker = self.workers[req.worker]
        worker.running -= 1
        worker.kv_tokens_used -= self.kv_tokens(req)
        req.worker = None
        assert worker.running >= 0 and worker.kv_tokens_used >= 0, "scheduler budget went negative"

    @property
    def num_running(self) -> int:
        return sum(w.running for w in self.workers)

"""Scheduler: waiting queue, priorities, per-worker budgets, preemption. No sockets, no torch.

**Order.** Lower ``priority`` is served first (vLLM's convention), FIFO within
a priority. Aging bounds starvation: a request's effective priority is

    effective(t) = priority - aging_rate * (t - arrival)          (levels, seconds)

so no priority-``q`` request arriving more than ``(p - q) / aging_rate``
seconds after a priority-``p`` request overtakes it: under a constant stream of
more urgent work its wait is bounded by that time plus the service of what was
already ahead of it then. All waiting requests age at the same
rate, so their order is that of the time-invariant key
``priority + aging_rate * arrival``: one heap keeps it, with no re-sorting as
time passes (it is rebuilt only when ``aging_rate`` changes).

**Bounds.** ``queue_size`` requests may wait in all, and at most
``priority_limits[p]`` of priority ``p``. A request that does not fit is
refused at once (``QUEUE_FULL``), or, with ``full_policy="evict"`` and when it
is strictly more urgent than the least urgent waiting request, it displaces
that one (Triton's per-level queue policies, TGI's immediate "overloaded").

**Admission.** ``schedule()`` moves the most urgent waiting request to a
worker that has a free slot (``max_concurrency``, capped by the engine's
``max_num_seqs``) and free KV-cache tokens for the tokens the request holds
now (prompt + output so far + the next one). The budget follows the tokens in
use, as the worker's paged KV cache does: a request's charge grows by one per
token streamed (:meth:`grow`) and is released when it ends, so admission no
longer reserves ``max_tokens`` the request may never generate; the part of its
prompt whose blocks were recently placed on the same worker (its prefix
cache holds or shares them) is not charged again. When blocks run
out inside a worker anyway, its engine preempts and resumes on its own. The
head of the queue is never overtaken: a large request cannot starve behind
smaller ones.

**Placement.** Among the workers where it fits, a request goes to the one
whose prefix cache most likely holds its longest prompt prefix (the keys of
the prompts recently placed there, :data:`PREFIX_INDEX_BLOCKS` per worker, the
same chained block hashes the engine uses), unless that worker's load (the
larger of its KV use and its slot use) is more than :data:`PREFIX_LOAD_SLACK`
above the least used one's; otherwise to the least used worker (llm-d's
prefix-aware routing, across GPUs of a host). Workers whose engine has no
prefix cache are placed by KV use alone.

**Preemption.** When the most urgent waiting request is strictly more urgent
(by base priority) than a running one and no capacity is free,
``preempt()`` picks the least urgent, most recently started running request on
a worker where the waiting one would then fit (vLLM's recompute preemption:
the victim's KV is dropped and it re-enters the queue with prompt + tokens so
far, to resume where it stopped). Its budget is released at once so the
urgent request can be assigned in the same pass; the caller re-queues the
victim with :meth:`requeue` once its worker confirmed the abort.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ringstream.daemon.common.prefix_hash import block_hashes
from ringstream.ipc import protocol as P

COMPACT_SLACK = 64
"""Rebuild the heaps when stale entries outnumber live ones by this much."""
PREFIX_LOAD_SLACK = 0.25
"""A worker holding a request's prefix gets it unless its load exceeds the least used worker's by this."""
PREFIX_INDEX_BLOCKS = 4096
"""Most prefix keys remembered per worker (the oldest are forgotten first)."""


class Schedulable(Protocol):
    """What the scheduler needs to know of a request (it sets the ``sched_*`` fields)."""

    priority: int
    arrival: float
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    worker: int | None
    started: float
    served_on: int | None
    """The worker that last counted it as served (so a request resumed there counts once)."""
    sched_token: int
    kv_charge: int
    preemptible: bool
    """False once it is being aborted: its worker is ending it anyway, and a preemption would resume it."""


@dataclass(slots=True)
class WorkerBudget:
    """Capacity and use of one worker, in slots and KV-cache tokens."""

    index: int
    capacity: P.WorkerCapacity = field(default_factory=lambda: P.WorkerCapacity(block_size=0))
    """What the worker holds, from its ``WorkerReady`` (zeros until then)."""
    running: int = 0
    kv_tokens_used: int = 0
    ready: bool = False
    served: int = 0
    preemptions: int = 0
    """Requests preempted here for more urgent ones (counter)."""
    prefix_index: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    """Keys of the prompt blocks recently placed here, oldest first (see Placement)."""

    @property
    def kv_use(self) -> float:
        """Charged KV tokens / capacity."""
        return self.kv_tokens_used / max(self.capacity.kv_cache_tokens, 1)

    def load(self, max_concurrency: int) -> float:
        """The larger of KV use and slot use, 0..1."""
        return max(self.kv_use, self.running / max(min(max_concurrency, self.capacity.max_num_seqs), 1))

    def prefix_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` placed here recently."""
        hits = 0
        for key in hashes:
            if key not in self.prefix_index:
                break
            hits += 1
        return hits

    def remember(self, hashes: list[bytes]) -> None:
        index = self.prefix_index
        for key in hashes:
            index[key] = None
            index.move_to_end(key)
        while len(index) > PREFIX_INDEX_BLOCKS:
            index.popitem(last=False)

    def became_ready(self, capacity: P.WorkerCapacity) -> None:
        """The worker (re)started with this capacity (its ``WorkerReady``); nothing is placed there yet."""
        self.capacity = capacity
        self.prefix_index.clear()
        self.ready = True

    def fits(self, tokens: int, max_concurrency: int, release_tokens: int = 0, release_slots: int = 0) -> bool:
        """True if one more request of ``tokens`` KV tokens fits (after releasing the given use)."""
        return (
            self.ready
            and self.running - release_slots < min(max_concurrency, self.capacity.max_num_seqs)
            and self.kv_tokens_used - release_tokens + tokens <= self.capacity.kv_cache_tokens
        )


@dataclass(slots=True)
class SchedulerPolicy:
    """The scheduler's live settings (all may change while it runs)."""

    queue_size: int = 10_000
    max_concurrency: int = 64
    priority_limits: dict[int, int] = field(default_factory=dict)
    aging_rate: float = 1.0
    full_policy: Literal["reject", "evict"] = "reject"
    preemption: bool = True


class Scheduler:
    """Priority queue with aging plus per-worker budgets; see the module docstring."""

    def __init__(self, policy: SchedulerPolicy | None = None) -> None:
        self.policy = policy or SchedulerPolicy()
        self.workers: list[WorkerBudget] = []
        self.running: set[Schedulable] = set()
        self._heap: list[tuple[float, int, Schedulable]] = []
        self._evict_heap: list[tuple[float, int, Schedulable]] = []
        self._tokens = itertools.count(1)
        self._num_waiting = 0
        self._by_priority: dict[int, int] = {}
        self._preempted_for: Schedulable | None = None

    # ------------------------------------------------------------ queue

    def key(self, req: Schedulable) -> float:
        """Time-invariant urgency key: lower is more urgent (see the aging formula)."""
        return req.priority + self.policy.aging_rate * req.arrival

    @staticmethod
    def kv_tokens(req: Schedulable) -> int:
        """KV-cache tokens a request holds when it starts: prompt, output so far (a resume) and the next token."""
        return req.num_prompt_tokens + req.num_output_tokens + 1

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def waiting_by_priority(self) -> dict[int, int]:
        """Waiting requests per base priority."""
        return {p: n for p, n in sorted(self._by_priority.items()) if n}

    def is_waiting(self, req: Schedulable) -> bool:
        return req.sched_token > 0

    def waiting(self) -> list[Schedulable]:
        """Waiting requests, most urgent first (a copy)."""
        return [req for _, token, req in sorted(self._heap, key=lambda e: (e[0], e[1])) if req.sched_token == token]

    def max_request_tokens(self) -> int:
        """The largest prompt + max_tokens any ready worker could ever hold (0 if none ready)."""
        return max((min(w.capacity.max_model_len, w.capacity.kv_cache_tokens) for w in self.workers if w.ready),
                   default=0)

    def add(self, req: Schedulable) -> tuple[bool, Schedulable | None]:
        """Queue ``req``. Returns ``(accepted, displaced)``.

        Not accepted: the queue (or its priority's share) is full and the
        policy keeps the waiting requests. ``displaced``: a less urgent waiting
        request that was removed to make room (the caller ends it with QUEUE_FULL).
        """
        policy = self.policy
        limit = policy.priority_limits.get(req.priority)
        if limit is not None and self._by_priority.get(req.priority, 0) >= limit:
            return False, None
        displaced = None
        if self._num_waiting >= policy.queue_size:
            if policy.full_policy != "evict":
                return False, None
            victim = self._least_urgent_waiting()
            if victim is None or not self.key(req) < self.key(victim):
                return False, None
            self.remove(victim)
            displaced = victim
        self._push(req)
        return True, displaced

    def requeue(self, req: Schedulable) -> None:
        """Put back a preempted (or orphaned) request; bounds do not apply, it was admitted before."""
        self._push(req)

    def remove(self, req: Schedulable) -> bool:
        """Take a waiting request out of the queue; False if it was not waiting."""
        if req.sched_token <= 0:
            return False
        req.sched_token = 0
        self._num_waiting -= 1
        self._by_priority[req.priority] -= 1
        self._maybe_compact()
        return True

    def _push(self, req: Schedulable) -> None:
        token = next(self._tokens)
        req.sched_token = token
        key = self.key(req)
        heapq.heappush(self._heap, (key, token, req))
        heapq.heappush(self._evict_heap, (-key, -token, req))
        self._num_waiting += 1
        self._by_priority[req.priority] = self._by_priority.get(req.priority, 0) + 1

    def _peek(self) -> Schedulable | None:
        heap = self._heap
        while heap and heap[0][2].sched_token != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _least_urgent_waiting(self) -> Schedulable | None:
        heap = self._evict_heap
        while heap and heap[0][2].sched_token != -heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _maybe_compact(self) -> None:
        # Both heaps: with the reject policy only _peek cleans _heap, and nothing cleans _evict_heap,
        # whose stale entries would otherwise keep every request that ever waited alive.
        if max(len(self._heap), len(self._evict_heap)) > 2 * self._num_waiting + COMPACT_SLACK:
            self._rebuild()

    def _rebuild(self) -> None:
        live = [req for _, token, req in self._heap if req.sched_token == token]
        self._heap = [(self.key(r), r.sched_token, r) for r in live]
        self._evict_heap = [(-k, -t, r) for k, t, r in self._heap]
        heapq.heapify(self._heap)
        heapq.heapify(self._evict_heap)

    def set_aging_rate(self, rate: float) -> None:
        """Change the aging rate (levels per second); re-keys the queue."""
        self.policy.aging_rate = rate
        self._rebuild()

    def set_policy(self, policy: SchedulerPolicy) -> None:
        """Apply new live settings; a new aging rate re-keys the queue."""
        rate, policy.aging_rate = policy.aging_rate, self.policy.aging_rate
        self.policy = policy
        if rate != policy.aging_rate:
            self.set_aging_rate(rate)

    # ------------------------------------------------------------ admission

    def schedule(self, now: float) -> list[tuple[Schedulable, WorkerBudget]]:
        """Assign waiting requests, most urgent first, while the head fits some worker."""
        placed = []
        while (req := self._peek()) is not None:
            place = self._place(req)
            if place is None:
                break
            worker, charge = place
            if req is self._preempted_for:
                self._preempted_for = None
            self.remove(req)
            self._start(req, worker, now, charge)
            placed.append((req, worker))
        return placed

    def _prefix_hashes(self, req: Schedulable) -> list[bytes]:
        """Keys of the prompt's full blocks (within ``len - 1``, as the engine looks them up); computed once."""
        hashes = getattr(req, "prefix_hashes", None)
        if hashes is None:
            block_size = next((w.capacity.block_size for w in self.workers
                               if w.capacity.prefix_caching and w.capacity.block_size), 0)
            hashes = block_hashes(req.prompt_token_ids[:-1], block_size) if block_size else []
            req.prefix_hashes = hashes
        return hashes

    def _place(self, req: Schedulable) -> tuple[WorkerBudget, int] | None:
        """The worker for ``req`` and the KV tokens to charge there (its prefix shared with work placed there is not)."""
        tokens = self.kv_tokens(req)
        limit = self.policy.max_concurrency
        hashes = self._prefix_hashes(req) if any(w.capacity.prefix_caching for w in self.workers) else []
        # A request that preempted another for its slot is placed by slots alone (see preempt).
        overcommit = req is self._preempted_for
        candidates = []
        for w in self.workers:
            shared = w.prefix_blocks(hashes) * w.capacity.block_size if w.capacity.prefix_caching and hashes else 0
            if w.fits(tokens - shared, limit, release_tokens=w.kv_tokens_used if overcommit else 0):
                candidates.append((w, shared))
        if not candidates:
            return None
        least = min(candidates, key=lambda c: (c[0].kv_use, c[0].running, c[0].index))
        if len(candidates) > 1 and hashes:
            best = max(candidates, key=lambda c: (c[1], -c[0].kv_use, -c[0].index))
            gap = best[0].load(limit) - least[0].load(limit)
            if best[1] and gap <= PREFIX_LOAD_SLACK:
                least = best
        worker, shared = least
        if hashes:
            worker.remember(hashes)
        return worker, tokens - shared

    def _start(self, req: Schedulable, worker: WorkerBudget, now: float, charge: int | None = None) -> None:
        req.kv_charge = self.kv_tokens(req) if charge is None else charge
        worker.running += 1
        worker.kv_tokens_used += req.kv_charge
        if req.served_on != worker.index:
            worker.served += 1
            req.served_on = worker.index
        req.worker = worker.index
        req.started = now
        self.running.add(req)

    def grow(self, req: Schedulable, tokens: int = 1) -> None:
        """A running request holds ``tokens`` more KV-cache tokens (one per token streamed)."""
        if req.worker is not None:
            req.kv_charge += tokens
            self.workers[req.worker].kv_tokens_used += tokens

    def finished(self, req: Schedulable) -> None:
        """Give back the budget of a running request that ended or is being preempted."""
        if req.worker is None:
            return
        worker = self.workers[req.worker]
        worker.running -= 1
        worker.kv_tokens_used -= req.kv_charge
        req.kv_charge = 0
        req.worker = None
        self.running.discard(req)
        assert worker.running >= 0 and worker.kv_tokens_used >= 0, "scheduler budget went negative"

    def preempt(self) -> tuple[Schedulable, int] | None:
        """Choose and release one running request so the waiting head can start.

        Returns ``(victim, worker_index)`` or None if no running request
        qualifies. The victim's budget is released and its ``worker`` cleared;
        the caller aborts it on that worker and later calls :meth:`requeue`.
        """
        head = self._peek()
        if head is None or not self.policy.preemption:
            return None
        tokens = self.kv_tokens(head)
        limit = self.policy.max_concurrency
        victims = sorted(
            (r for r in self.running if r.priority > head.priority and r.preemptible),
            key=lambda r: (-r.priority, -r.started),
        )
        for victim in victims:
            worker = self.workers[victim.worker]
            # KV tokens are not the bound here: running requests grow past the charged capacity and the
            # worker's engine preempts by priority itself when its blocks run out. A free slot is.
            if worker.fits(tokens, limit, release_tokens=worker.kv_tokens_used, release_slots=1):
                self.finished(victim)
                self._preempted_for = head
                return victim, worker.index
        return None

    def clear_worker(self, index: int) -> list[Schedulable]:
        """A worker is gone: release and return every request running on it."""
        orphans = [r for r in self.running if r.worker == index]
        for req in orphans:
            self.finished(req)
        budget = self.workers[index]
        budget.ready = False
        return orphans

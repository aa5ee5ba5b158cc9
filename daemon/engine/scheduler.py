"""The engine's step scheduler: which sequences get how many new tokens each step.

:class:`StepScheduler` holds the waiting queue and the running batch of one
:class:`ringstream.daemon.engine.engine.Engine` and the
:class:`ringstream.daemon.engine.block_manager.BlockManager` of its KV pool (vLLM v1's
``vllm/v1/core/sched/scheduler.py``):

* :meth:`StepScheduler.schedule` fills the step's token budget: running
  decodes first (one token each), then prompt chunks of running sequences still
  in prefill, then waiting sequences in order, each admitted when the blocks
  for the part of its tokens not in the prefix cache are free (minus a
  watermark while others run), each taking what is left of the budget (chunked
  prefill). A sequence whose next tokens need a block that is not free
  preempts the least urgent, most recently started running sequence (recompute
  preemption: its blocks are freed and it goes back to the head of the waiting
  queue).
* :meth:`StepScheduler.advance` accounts a step's computed tokens, registers
  full blocks in the prefix cache, appends the sampled tokens, applies the
  finish rule (:mod:`ringstream.daemon.common.finish`) and releases finished
  sequences.

The model side (input tensors, forward, sampling) is the engine's. This module
does not import torch.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ringstream.daemon.common.finish import finish_after_token
from ringstream.daemon.common.grammar import ERROR_CHARS
from ringstream.daemon.common.prefix_hash import block_hashes
from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.interface import EngineRequest, TokenOutput

if TYPE_CHECKING:
    import torch

    from ringstream.daemon.engine.detokenizer import IncrementalDetokenizer
    from ringstream.ipc.wire import TokenLogprob

__all__ = ["MIN_BURST_PROMPTS", "WATERMARK_FRACTION", "SequenceState", "StepScheduler"]

log = logging.getLogger("ringstream.engine")

WATERMARK_FRACTION = 0.01
"""Admission leaves this fraction of the blocks free for running decodes (vLLM v0's watermark)."""
MIN_BURST_PROMPTS = 2
"""Fewest prompts to compute that make a prefill burst beside decoding streams, counting only those the step can
take (running ones in prefill, waiting ones that admission would take now): a burst is a cohort of arrivals, and
a lone long prompt beside a few streams would otherwise stall them for whole token-budget steps."""


@dataclass(slots=True, eq=False)
class SequenceState:
    """Engine-side state of one unfinished request.

    ``token_ids`` are the prompt and the output so far; the first
    ``num_computed`` of them have KV in the pool. A running sequence in decode
    has ``num_computed == len(token_ids) - 1`` (its last sampled token is fed
    at the next step). ``handle`` is None for the engine's internal requests
    (warmup, start check). ``started`` orders running sequences by admission;
    ``hashes`` are the prefix-cache keys of its full blocks so far.

    ``processed``: the request needs the model runner's slow path (penalties,
    ``min_p``, ``min_tokens`` or logprobs; the default path has none of them).
    ``want_prompt_logprobs``: its prompt logprobs are computed during prefill
    into ``prompt_logprobs`` (entry ``i`` for prompt token ``i + 1``), and it
    takes no prefix-cache hit. ``next_logprob`` is the sampled token's
    logprobs, left by the model runner for :meth:`StepScheduler.advance`.
    """

    seq_id: int
    handle: int | None
    request: EngineRequest
    token_ids: list[int]
    num_prompt_tokens: int
    max_output_tokens: int
    stop_token_ids: frozenset[int]
    user_stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    priority: int
    num_computed: int = 0
    started: int = 0
    running: bool = False
    hashes: list[bytes] = field(default_factory=list)
    processed: bool = False
    want_prompt_logprobs: bool = False
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    next_logprob: TokenLogprob | None = None
    matcher: object | None = None
    """The ``llguidance.LLMatcher`` of the request's ``structured_outputs`` (it has consumed the output so far),
    or None (:mod:`ringstream.daemon.engine.structured`)."""


class StepScheduler:
    """Waiting and running sequences of one engine and the choice of each step's new tokens (module docstring).

    Args:
        blocks: the KV pool's block manager; its block size and prefix-caching
            switch are the scheduler's.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most new tokens per step (may be changed
            between steps).

    Attributes:
        waiting: sequences not yet admitted, or preempted, in admission order.
        running: admitted sequences, in admission order.
        by_handle: every unfinished sequence that has a request handle.
        num_preemptions: recompute preemptions so far.
        num_random: running sequences that sample at random (not greedy).
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.enable_prefix_caching = blocks.enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_limit: Callable[[int, int], int] | None = None
        """``(decodes, start) -> prompt tokens`` the step may add beside that many decode rows, for a chunk from
        position ``start`` of its prompt (the engine's time budget,
        :class:`ringstream.daemon.engine.step_budget.StepBudget`); None: the token budget alone."""
        self.burst_ratio = 0.0
        """A step is a prefill burst, its prompt tokens bounded by the token budget alone (not ``chunk_limit``),
        when the prompts still to compute that the batch can take number at least this many times the step's
        decodes (:meth:`_burst`); 0: never (the engine's ``prefill_burst_ratio``)."""
        self.watermark = max(1, int(blocks.num_usable_blocks * WATERMARK_FRACTION))
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.by_handle: dict[int, SequenceState] = {}
        self.num_preemptions = 0
        self.num_random = 0
        self._next_start = 0

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: SequenceState) -> None:
        """Queue ``seq`` last in the waiting queue (the caller checks handle and capacity)."""
        if seq.handle is not None:
            self.by_handle[seq.handle] = seq
        self.waiting.append(seq)

    def abort(self, handle: int) -> bool:
        """Drop the sequence of ``handle``, freeing its blocks at once; True if there was one."""
        seq = self.by_handle.get(handle)
        if seq is None:
            return False
        if seq.running:
            self.release(seq)
        else:
            self.waiting.remove(seq)
            del self.by_handle[handle]
        return True

    def release(self, seq: SequenceState) -> None:
        """Free a running sequence's blocks and forget it."""
        self._stop_running(seq)
        if seq.handle is not None:
            del self.by_handle[seq.handle]

    def _stop_running(self, seq: SequenceState) -> None:
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)
        seq.running = False
        self.num_random -= not seq.greedy

    def preempt(self, seq: SequenceState) -> None:
        """Recompute preemption: drop ``seq``'s KV and put it first in the waiting queue."""
        self._stop_running(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("request %s preempted after %d tokens: KV cache full", seq.handle, len(seq.token_ids))

    # ------------------------------------------------------------ scheduling

    def schedule(self) -> dict[SequenceState, int]:
        """Choose this step's sequences and their new-token counts (decodes, running chunks, then admissions).

        Returns {sequence: number of new tokens}, in the order they were
        chosen; admitted sequences are running, with ``num_computed`` set to
        their prefix-cache hit.
        """
        scheduled: dict[SequenceState, int] = {}
        budget = self.max_num_batched_tokens
        decodes = 0
        timed = self.chunk_limit is not None
        for decode in (True, False):
            if not decode and timed:  # prompt tokens: the time budget's share, unless the step is a burst
                decodes = len(scheduled)
                timed = not self._burst(decodes)
                if timed:
                    budget = min(budget, self.chunk_limit(decodes, self._next_chunk_start()))
            for seq in list(self.running):
                if budget == 0:
                    return scheduled
                remaining = len(seq.token_ids) - seq.num_computed
                if not seq.running or (remaining == 1) != decode:
                    continue
                num_new = min(remaining, budget)
                refund = self._reserve(seq, seq.num_computed + num_new, scheduled)
                budget += refund
                if seq.running:
                    scheduled[seq] = num_new
                    budget -= num_new
        blocks = self.blocks
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_tokens = len(seq.token_ids)
            hashes = self.block_hashes(seq)
            reserve = self.watermark if self.running else 0
            # Prompt logprobs need the logits of every prompt position: no cached prefix (vLLM's rule).
            most_cached = 0 if seq.want_prompt_logprobs and not seq.request.output_token_ids else num_tokens - 1
            if not blocks.can_allocate(num_tokens + reserve * self.block_size, hashes, most_cached):
                break
            seq.num_computed = blocks.allocate(seq.seq_id, num_tokens, hashes, most_cached)
            if timed and seq.num_computed and len(scheduled) == decodes:
                # the step's first chunk starts past a prefix-cache hit: its attention reads that prefix too
                budget = min(budget, self.chunk_limit(decodes, seq.num_computed))
            self.waiting.popleft()
            seq.running = True
            seq.started = self._next_start
            self._next_start += 1
            self.running.append(seq)
            self.num_random += not seq.greedy
            num_new = min(num_tokens - seq.num_computed, budget)
            scheduled[seq] = num_new
            budget -= num_new
        return scheduled

    def _burst(self, decodes: int) -> bool:
        """Whether this step is a prefill burst: the sequences with prompt tokens still to compute that the batch
        can take (running ones in prefill, and the waiting ones that admission would take now: up to
        ``max_num_seqs``, in order, while the KV cache has their blocks) number at least ``burst_ratio`` times
        ``decodes``, the step's decode rows, and at least :data:`MIN_BURST_PROMPTS` where there are decode rows
        (TGI's ``waiting_served_ratio`` test, applied to the size of the step rather than to when a prefill
        starts)."""
        if not self.burst_ratio:
            return False
        prompts = len(self.running) - decodes
        needed = max(MIN_BURST_PROMPTS, self.burst_ratio * decodes) if decodes else 1
        # admission's own test, without prefix-cache hits (fewer counted, never more): each waiting sequence's
        # blocks, in order, from what the watermark leaves free
        free = self.blocks.num_free_blocks - (self.watermark if self.running else 0)
        for seq in itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))):
            if prompts >= needed:
                break
            free -= -(-len(seq.token_ids) // self.block_size)
            if free < 0:
                break
            prompts += 1
        return prompts >= needed

    def _next_chunk_start(self) -> int:
        """Where the step's first prompt chunk starts in its prompt: the first running sequence still in prefill,
        else 0 (a waiting one: its cached prefix is known once it is admitted, and the budget is asked again
        then)."""
        for seq in self.running:
            if len(seq.token_ids) - seq.num_computed > 1:
                return seq.num_computed
        return 0

    def _reserve(self, seq: SequenceState, num_tokens: int, scheduled: dict[SequenceState, int]) -> int:
        """Make ``seq`` hold ``num_tokens`` positions, preempting others while blocks run out.

        Victims: the least urgent (highest ``priority``), most recently started
        running sequence, possibly ``seq`` itself. Returns the budget freed by
        victims that were already scheduled this step.
        """
        refund = 0
        while not self.blocks.append_slots(seq.seq_id, num_tokens):
            victim = max(self.running, key=lambda s: (s.priority, s.started))
            self.preempt(victim)
            refund += scheduled.pop(victim, 0)
            if victim is seq:
                break
        return refund

    def block_hashes(self, seq: SequenceState) -> list[bytes]:
        """Prefix keys of ``seq``'s full blocks (extended as a resumed sequence grows); [] without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        full = len(seq.token_ids) // self.block_size
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += block_hashes(seq.token_ids[:full * self.block_size], self.block_size, len(seq.hashes),
                                       parent)
        return seq.hashes

    # ------------------------------------------------------------ results

    def advance(self, items: list[tuple[SequenceState, int]], tokens: list | None, outputs: list) -> None:
        """Account a step's results: ``items`` are (sequence, new tokens computed), ``tokens`` the sampled
        token of each (None where it sampled none; ``tokens`` empty or None: none sampled).

        Registers full blocks in the prefix cache, appends each sampled token
        (emitting its ``TokenOutput`` to ``outputs``) and releases the
        sequences that finish.
        """
        caching = self.enable_prefix_caching
        for (seq, num_new), token in zip(items, tokens or [None] * len(items)):
            seq.num_computed += num_new
            if caching:
                self.blocks.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            if token is not None:
                self._append_token(seq, token, outputs)

    def _append_token(self, seq: SequenceState, token_id: int, outputs: list) -> None:
        """Record a sampled token, apply the finish rule, emit its ``TokenOutput``.

        The rule (:func:`ringstream.daemon.common.finish.finish_after_token`,
        the synthetic engine's too): EOS / stop token, then stop string, then
        length (``max_tokens`` or the context limit); within ``min_tokens``
        neither stop tokens (the sampler masks them) nor stop strings end the
        request.
        """
        output_ids = seq.request.output_token_ids
        output_ids.append(token_id)
        seq.token_ids.append(token_id)
        num_output = len(output_ids)
        text, finish_reason, stop_reason = finish_after_token(
            seq.detokenizer, token_id, num_output, seq.stop_token_ids, seq.user_stop_token_ids,
            seq.request.params.min_tokens, seq.max_output_tokens)
        matcher = seq.matcher
        if (matcher is not None and finish_reason == "stop" and token_id in seq.stop_token_ids
                and token_id not in seq.user_stop_token_ids and not matcher.is_accepting()):
            # EOS where the constraint cannot end (its mask failed, or a literal of it is the EOS token's text):
            # the output does not meet it, so the stream does not end as if it did
            finish_reason, stop_reason = "error", None
            log.warning("request %s: EOS before its structured output was complete%s", seq.handle,
                        f": {matcher.get_error()[:ERROR_CHARS]}" if matcher.is_error() else "")
        elif matcher is not None and finish_reason in (None, "length"):
            if not matcher.consume_token(token_id) or matcher.is_error():
                finish_reason, stop_reason = "error", None  # a dead end of the constraint: this stream alone
                log.warning("request %s: its structured output reached a dead end: %s", seq.handle,
                            matcher.get_error()[:ERROR_CHARS])
            elif matcher.is_stopped():
                finish_reason, stop_reason = "stop", None  # the constraint is complete
        if seq.processed:
            out = TokenOutput(seq.handle, num_output - 1, token_id, text, logprobs=seq.next_logprob)
            seq.next_logprob = None
            if seq.want_prompt_logprobs and num_output == 1:
                out.prompt_logprobs = seq.prompt_logprobs
        else:
            out = TokenOutput(seq.handle, num_output - 1, token_id, text)
        outputs.append(out)
        if finish_reason is None:
            return
        out.finish_reason, out.stop_reason = finish_reason, stop_reason
        out.num_prompt_tokens, out.num_output_tokens = seq.num_prompt_tokens, num_output
        self.release(seq)

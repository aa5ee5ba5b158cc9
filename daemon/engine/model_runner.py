"""The engine's model side: a step's input tensors, one forward over the paged KV pool, sampling.

:class:`ModelRunner` packs the new tokens of the sequences that
:class:`ringstream.daemon.engine.scheduler.StepScheduler` chose into one row
(decodes first, then prompt chunks), each at its own positions, builds the
attention metadata from their block tables
(:func:`ringstream.daemon.engine.kv_cache.build_metadata`), runs the model with the
engine's paged attention and cache, and samples the next token of every
sequence whose known tokens are then all computed (vLLM v1's GPU model runner,
``vllm/v1/worker/gpu_model_runner.py``).

Requests with penalties, ``min_p``, ``min_tokens`` or logprobs take a second
path (:meth:`ModelRunner._sample_processed`) in vLLM's order: raw logprobs
(``log_softmax`` of the model's logits) of the rows that ask, the
``min_tokens`` mask of EOS and stop token ids, the penalties of the rows
that have them, then :func:`ringstream.daemon.engine.sampler.sample`. A batch with
none of them takes the path it always took. Prompt logprobs: the forward
keeps the logits of every prompt position of a sequence that asks for them
(``logits_to_keep``), chunk by chunk of a chunked prefill.

Device traffic (:mod:`ringstream.daemon.engine.device_io`): a step's inputs go to the
device asynchronously, every decision about which path to take is made on the
host from the requests' parameters, and the step's results (sampled ids, and
the logprobs asked for) come back in one transfer at its end.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch

from ringstream.daemon.engine.attention import STEP
from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.device_io import to_device, to_host
from ringstream.daemon.engine.fused_model import fuse_model
from ringstream.daemon.engine.scheduler import SequenceState
from ringstream.daemon.engine.kv_cache import PagedKVCache, build_metadata
from ringstream.daemon.engine.structured import apply_bitmask, token_bitmask
from ringstream.daemon.engine.sampler import (
    SamplingTensors, apply_penalties, build_logprobs, greedy_tokens, logprob_tensors, mask_tokens, sample,
    token_seed,
)

__all__ = ["ModelRunner", "StepInputs", "StepResult"]

log = logging.getLogger("ringstream.engine")


@dataclass(slots=True, eq=False)
class StepInputs:
    """One step's packed batch on the host, as :meth:`ModelRunner._prepare` builds it.

    Attributes:
        input_ids: ``[T]`` the token each packed row feeds: the decode rows
            first (one per decoding sequence), then each prompt chunk's tokens.
        positions: ``[T]`` each row's position in its sequence.
        decodes: ``(block_table, position)`` per decode row
            (:func:`ringstream.daemon.engine.kv_cache.build_metadata`'s).
        prefills: ``(block_table, first position, number of tokens)`` per chunk.
        rows: the packed rows whose logits the forward keeps
            (``logits_to_keep``): first one per sampled sequence, then every
            prompt-logprob row.
        num_sampled: how many of ``rows`` are sampled rows.
        sampled: the sequences whose known tokens are all computed after the
            step (they get a token), in the order of their rows.
        prompt_rows: ``(sequence, first row, first position, count)``: packed
            rows whose next prompt token's logprobs the step computes.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    decodes: list[tuple[list[int], int]] = field(default_factory=list)
    prefills: list[tuple[list[int], int, int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_sampled: int = 0
    sampled: list[SequenceState] = field(default_factory=list)
    prompt_rows: list[tuple[SequenceState, int, int, int]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class StepResult:
    """The device half of one step's results, as :meth:`ModelRunner._sample` leaves it.

    Attributes:
        tokens: ``[num_sampled]`` int64 sampled token ids on the device; None
            when no sequence was sampled.
        asking: None, or (rows of ``sampled`` that ask for logprobs, their top
            counts, the device tensors of
            :func:`ringstream.daemon.engine.sampler.logprob_tensors`).
        prompt_part: None, or the prompt logprobs' device half
            (:meth:`ModelRunner._prompt_logprobs`).
    """

    tokens: torch.Tensor | None = None
    asking: tuple | None = None
    prompt_part: tuple | None = None


class ModelRunner:
    """Runs scheduled sequences through ``model`` over the paged pool ``cache``.

    Args:
        model: the causal LM, already switched to the engine's paged attention
            (:func:`ringstream.daemon.engine.attention.use_paged_attention`).
        cache: the KV pool the model's attention layers write and read.
        blocks: the block manager whose block tables index ``cache``.
        vocab_size: the model's vocabulary size (``top_k`` at or above it is off).
        device: where index tensors are built.
        seed: seed of the generator of sequences without their own seed.

    Attributes:
        captured: None, or a list that collects each forward's sampled logits
            (``[sampled sequences, vocab]``, a copy) for the start check.
        seen_windows: the sliding windows the attention calls were given,
            recorded while ``captured`` is a list.
    """

    def __init__(self, model, cache: PagedKVCache, blocks: BlockManager, *, vocab_size: int,
                 device: torch.device, seed: int, native=None) -> None:
        self.model = model
        self.native = native
        """``torch.ops.ringstream`` when decode attention takes the native kernel, else None."""
        self.cache = cache
        self._blocks = blocks
        self.block_size = blocks.block_size
        self.vocab_size = vocab_size
        self.device = device
        forward_params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.captured: list[torch.Tensor] | None = None
        self.seen_windows: set = set()
        self.fused = fuse_model(model, native) if native is not None else None
        """The model's step as one loop over its fused layers (:mod:`ringstream.daemon.engine.fused_model`),
        where that is exact; None: the model's own forward."""
        self._fused_usable = True  # as last seen: a change is logged

    def execute(self, items: list[tuple[SequenceState, int]]) -> list[int | None]:
        """One forward over the packed new tokens of ``items`` (sequence, number of new tokens from its
        ``num_computed`` on); the sampled token of each sequence whose known tokens are then all computed,
        None for the others, in the order of ``items``; [] when none completes.

        Phases: :meth:`_prepare` (host-side packing), :meth:`_forward` (the
        model; the one call a CUDA graph runner would stand in for), :meth:`_sample`
        (device-side tokens and logprobs) and :meth:`_fetch` (the step's one
        device-to-host transfer and the host-side bookkeeping).

        Raises whatever the forward or the sampler raises (the KV written so
        far for ``items`` is then not accounted as computed).
        """
        self.cache.clear_blocks(self._blocks.take_fresh_blocks())  # before the forward writes into them
        inputs = self._prepare(items)
        result = self._sample(inputs, self._forward(inputs))
        token_ids = self._fetch(inputs, result)
        if not inputs.sampled:
            return []
        # Keep order with ``items``: map each sampled sequence to its token.
        by_seq = dict(zip(inputs.sampled, token_ids))
        return [by_seq.get(seq) for seq, _ in items]

    def _prepare(self, items: list[tuple[SequenceState, int]]) -> StepInputs:
        """Pack ``items`` into one row of ``T`` new tokens, decodes (one token each) first, then prompt chunks
        (host lists only; nothing goes to the device here)."""
        inputs = StepInputs()
        for seq, num_new in items:
            if num_new == 1:
                self._pack_decode(inputs, seq)
        for seq, num_new in items:
            if num_new > 1:
                self._pack_chunk(inputs, seq, num_new)
        inputs.num_sampled = len(inputs.rows)
        for _, first, _, count in inputs.prompt_rows:
            inputs.rows += range(first, first + count)
        return inputs

    def _pack_decode(self, inputs: StepInputs, seq: SequenceState) -> None:
        """Append ``seq``'s one new token (at position ``num_computed``) as the next decode row."""
        pos = seq.num_computed
        inputs.decodes.append((self._blocks.block_table(seq.seq_id), pos))
        inputs.input_ids.append(seq.token_ids[pos])
        inputs.positions.append(pos)
        row = len(inputs.decodes) - 1
        if seq.want_prompt_logprobs and pos + 1 < seq.num_prompt_tokens:
            inputs.prompt_rows.append((seq, row, pos, 1))
        if pos + 1 == len(seq.token_ids):
            inputs.rows.append(row)
            inputs.sampled.append(seq)

    def _pack_chunk(self, inputs: StepInputs, seq: SequenceState, num_new: int) -> None:
        """Append ``seq``'s ``num_new`` new tokens (positions ``[num_computed, num_computed + num_new)``) as a
        prompt chunk after the rows packed so far (every decode row comes first)."""
        start = seq.num_computed
        row = len(inputs.positions)  # the chunk's first packed row
        inputs.prefills.append((self._blocks.block_table(seq.seq_id), start, num_new))
        inputs.input_ids += seq.token_ids[start:start + num_new]
        inputs.positions += range(start, start + num_new)
        if seq.want_prompt_logprobs and start + 1 < seq.num_prompt_tokens:
            inputs.prompt_rows.append((seq, row, start, min(num_new, seq.num_prompt_tokens - 1 - start)))
        if start + num_new == len(seq.token_ids):
            inputs.rows.append(row + num_new - 1)
            inputs.sampled.append(seq)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the packed row (``input_ids``, ``position_ids``: ``[1, T]``) with the step's attention
        metadata; returns the logits of the kept rows, ``[len(inputs.rows), vocab]``, in ``rows`` order.

        The inputs go to the device here (asynchronously). This is the seam of
        CUDA graphs: for a decode-only step, a graph runner
        (:class:`ringstream.daemon.engine.cuda_graphs.CudaGraphRunner`, fed
        ``input_ids`` and ``decodes``) can stand in for this call, its logits
        of every decode row then taken at ``rows``.
        """
        device = self.device
        meta = build_metadata(inputs.decodes, inputs.prefills, self.block_size, device)
        meta.native = self.native
        meta.scratch = self.cache.scratch(meta.max_gather_blocks)
        if self.captured is not None:
            meta.seen_windows = self.seen_windows
        self.cache.slot_mapping = meta.slot_mapping
        STEP.metadata = meta
        try:
            if self.fused is not None and self._take_fused():
                return self.fused(to_device(inputs.input_ids, torch.long, device),
                                  to_device(inputs.positions, torch.long, device),
                                  to_device(inputs.rows, torch.long, device), meta, self.cache)
            out = self.model(
                input_ids=to_device([inputs.input_ids], torch.long, device),
                position_ids=to_device([inputs.positions], torch.long, device),
                use_cache=True,
                logits_to_keep=to_device(inputs.rows, torch.long, device),
                paged=meta,
                **{self.cache_kwarg: self.cache},
            )
        finally:
            STEP.metadata = None
        return out.logits[0]

    def _take_fused(self) -> bool:
        usable = self.fused.usable()
        if usable != self._fused_usable:
            self._fused_usable = usable
            log.info("steps run %s", "the model's layers as one loop again" if usable else
                     "the model's own forward: a hook or a replaced forward is on the model")
        return usable

    def _sample(self, inputs: StepInputs, logits: torch.Tensor) -> StepResult:
        """The device half of the step's results from the kept rows' ``logits`` (``[len(rows), vocab]``): the
        prompt logprobs of the prompt rows, then the sampled sequences' tokens (``[num_sampled]`` int64) by
        the path their parameters take (module docstring); no token without a sampled sequence."""
        result = StepResult()
        if inputs.prompt_rows:
            result.prompt_part = self._prompt_logprobs(logits[inputs.num_sampled:], inputs.prompt_rows)
            logits = logits[:inputs.num_sampled]
        sampled = inputs.sampled
        if not sampled:
            return result
        if self.captured is not None:
            self.captured.append(logits.detach().clone())
        if any(seq.processed for seq in sampled):
            result.tokens, result.asking = self._sample_processed(logits, sampled)
        elif any(not seq.greedy for seq in sampled):
            result.tokens = sample(logits, self._sampling_tensors(sampled))
        else:
            result.tokens = greedy_tokens(logits)
        return result

    def _fetch(self, inputs: StepInputs, result: StepResult) -> list[int]:
        """Bring ``result`` to the host in the step's one device-to-host transfer (tokens, then the sampled and
        the prompt logprobs asked for), leave the logprobs with their sequences; the sampled token ids, in
        the order of ``inputs.sampled`` ([] when none was sampled)."""
        prompt_part = result.prompt_part
        if result.tokens is None:
            if prompt_part is not None:
                self._keep_prompt_logprobs(inputs.prompt_rows, prompt_part, to_host(prompt_part[2]))
            return []
        asking = result.asking
        asked = asking[2] if asking else []
        prompt_tensors = prompt_part[2] if prompt_part else []
        fetched = to_host([result.tokens, *asked, *prompt_tensors])
        token_ids = fetched[0]
        if asking:
            rows_asking, num_top, _ = asking
            found = build_logprobs([token_ids[i] for i in rows_asking], fetched[1:1 + len(asked)], num_top)
            for i, logprob in zip(rows_asking, found):
                inputs.sampled[i].next_logprob = logprob
        if prompt_part is not None:
            self._keep_prompt_logprobs(inputs.prompt_rows, prompt_part, fetched[1 + len(asked):])
        return token_ids

    def _sample_processed(self, logits: torch.Tensor,
                          batch: list[SequenceState]) -> tuple[torch.Tensor, tuple | None]:
        """Sample ``batch`` (``logits``: ``[len(batch), vocab]``) with raw logprobs, the ``min_tokens`` mask and
        the penalties (module docstring). Returns ``[n]`` int64 tokens and, when some sequence asks for
        logprobs, ``(its rows, their top counts, the device tensors of`` :func:`logprob_tensors` ``)``."""
        params = [seq.request.params for seq in batch]
        device = self.device
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        asking_index = to_device(asking, torch.long, device) if asking else None
        raw = logits[asking_index].float().log_softmax(dim=-1) if asking else None
        work = logits.float().clone()
        mask_rows, mask_ids = [], []
        for i, (seq, p) in enumerate(zip(batch, params)):
            if len(seq.request.output_token_ids) < p.min_tokens:
                mask_rows += [i] * len(seq.stop_token_ids)
                mask_ids += seq.stop_token_ids
        mask_tokens(work, mask_rows, mask_ids)
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            chosen = [params[i] for i in penalized]
            penalized_index = to_device(penalized, torch.long, device)
            work[penalized_index] = apply_penalties(
                work[penalized_index],
                [batch[i].token_ids[:batch[i].num_prompt_tokens] for i in penalized],
                [batch[i].token_ids[batch[i].num_prompt_tokens:] for i in penalized],
                to_device([p.presence_penalty for p in chosen], torch.float32, device),
                to_device([p.frequency_penalty for p in chosen], torch.float32, device),
                to_device([p.repetition_penalty for p in chosen], torch.float32, device),
                any_repetition=any(p.repetition_penalty != 1.0 for p in chosen),
            )
        constrained = [i for i, seq in enumerate(batch) if seq.matcher is not None]
        if constrained:  # structured outputs: only what each constraint allows next
            mask = token_bitmask([batch[i].matcher for i in constrained], work.shape[-1])
            apply_bitmask(work, to_device(constrained, torch.long, device), mask)
        if all(seq.greedy for seq in batch):
            tokens = greedy_tokens(work)
        else:
            tensors = self._sampling_tensors(batch)
            if any(p.min_p > 0.0 for p in params):
                tensors.min_p = to_device([p.min_p for p in params], torch.float32, self.device)
            tokens = sample(work, tensors)
        if not asking:
            return tokens, None
        num_top = [params[i].logprobs for i in asking]
        return tokens, (asking, num_top, logprob_tensors(raw, tokens[asking_index], num_top))

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list) -> tuple[list[int], list[int], list]:
        """The device half of the next prompt token's logprobs at each kept prompt position (``logits``: their
        rows, in order): ``(target ids, top counts, tensors of`` :func:`logprob_tensors` ``)``."""
        targets = []
        for seq, _, first, count in prompt_rows:
            targets += seq.token_ids[first + 1:first + 1 + count]
        logprobs = logits.float().log_softmax(dim=-1)
        num_top = [seq.request.params.prompt_logprobs for seq, _, _, count in prompt_rows for _ in range(count)]
        return targets, num_top, logprob_tensors(logprobs, to_device(targets, torch.long, logits.device), num_top)

    @staticmethod
    def _keep_prompt_logprobs(prompt_rows: list, part: tuple, fetched: list) -> None:
        """Append the step's prompt logprobs (``part`` from :meth:`_prompt_logprobs`, ``fetched`` its tensors on
        the host) to their sequences (positions computed again after a preemption are already there and are
        skipped)."""
        targets, num_top, _ = part
        found = build_logprobs(targets, fetched, num_top)
        at = 0
        for seq, _, first, count in prompt_rows:
            kept = seq.prompt_logprobs
            for offset in range(count):
                if first + offset == len(kept):
                    kept.append(found[at + offset])
            at += count

    def _sampling_tensors(self, batch: list[SequenceState]) -> SamplingTensors:
        device = self.device
        top_k = [seq.top_k for seq in batch]
        top_p = [seq.top_p for seq in batch]
        vocab = self.vocab_size
        return SamplingTensors(
            temperature=to_device([seq.temperature for seq in batch], torch.float32, device),
            greedy=to_device([seq.greedy for seq in batch], torch.bool, device),
            top_k=to_device(top_k, torch.long, device),
            top_p=to_device(top_p, torch.float32, device),
            all_greedy=False,
            any_greedy=any(seq.greedy for seq in batch),
            use_top_k=any(k < vocab for k in top_k),
            use_top_p=any(p < 1.0 for p in top_p),
            max_top_k=max((k for k in top_k if k < vocab), default=0),
            top_p_without_k=any(p < 1.0 and k >= vocab for k, p in zip(top_k, top_p)),
            seeded_rows=[(i, self._seed_generator(seq)) for i, seq in enumerate(batch) if seq.generator is not None],
            generator=self.generator,
        )

    @staticmethod
    def _seed_generator(seq: SequenceState) -> torch.Generator:
        """Seed ``seq``'s generator for its next output token and return it."""
        seq.generator.manual_seed(token_seed(seq.request.params.seed, len(seq.request.output_token_ids)))
        return seq.generator


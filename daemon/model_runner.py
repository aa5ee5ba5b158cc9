"""The engine's model side: a step's input tensors, one forward over the paged KV pool, sampling.

:class:`ModelRunner` packs the new tokens of the sequences that
:class:`ringstream.daemon.engine_scheduler.StepScheduler` chose into one row
(decodes first, then prompt chunks), each at its own positions, builds the
attention metadata from their block tables
(:func:`ringstream.daemon.kv_cache.build_metadata`), runs the model with the
engine's paged attention and cache, and samples the next token of every
sequence whose known tokens are then all computed (vLLM v1's GPU model runner,
``vllm/v1/worker/gpu_model_runner.py``).

Requests with penalties, ``min_p``, ``min_tokens`` or logprobs take a second
path (:meth:`ModelRunner._sample_processed`) in vLLM's order: raw logprobs
(``log_softmax`` of the model's logits) of the rows that ask, the
``min_tokens`` mask of EOS and stop token ids, the penalties of the rows
that have them, then :func:`ringstream.daemon.sampler.sample`. A batch with
none of them takes the path it always took. Prompt logprobs: the forward
keeps the logits of every prompt position of a sequence that asks for them
(``logits_to_keep``), chunk by chunk of a chunked prefill.

Device traffic (:mod:`ringstream.daemon.device_io`): a step's inputs go to the
device asynchronously, every decision about which path to take is made on the
host from the requests' parameters, and the step's results (sampled ids, and
the logprobs asked for) come back in one transfer at its end.
"""

from __future__ import annotations

import inspect

import torch

from ringstream.daemon.block_manager import BlockManager
from ringstream.daemon.device_io import to_device, to_host
from ringstream.daemon.engine_scheduler import SequenceState
from ringstream.daemon.kv_cache import PagedKVCache, build_metadata
from ringstream.daemon.sampler import (
    SamplingTensors, apply_penalties, build_logprobs, logprob_tensors, mask_tokens, sample, token_seed,
)

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs scheduled sequences through ``model`` over the paged pool ``cache``.

    Args:
        model: the causal LM, already switched to the engine's paged attention
            (:func:`ringstream.daemon.attention.use_paged_attention`).
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
                 device: torch.device, seed: int) -> None:
        self.model = model
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

    def execute(self, items: list[tuple[SequenceState, int]]) -> list[int | None]:
        """One forward over the packed new tokens of ``items`` (sequence, number of new tokens from its
        ``num_computed`` on); the sampled token of each sequence whose known tokens are then all computed,
        None for the others, in the order of ``items``; [] when none completes.

        Raises whatever the forward or the sampler raises (the KV written so
        far for ``items`` is then not accounted as computed).
        """
        decodes, prefills, input_ids, positions, rows, sampled = [], [], [], [], [], []
        prompt_rows: list[tuple[SequenceState, int, int, int]] = []  # (seq, first row, first position, count)
        for seq, num_new in items:
            if num_new == 1:
                pos = seq.num_computed
                decodes.append((self._blocks.block_table(seq.seq_id), pos))
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                if seq.want_prompt_logprobs and pos + 1 < seq.num_prompt_tokens:
                    prompt_rows.append((seq, len(decodes) - 1, pos, 1))
                if pos + 1 == len(seq.token_ids):
                    rows.append(len(decodes) - 1)
                    sampled.append(seq)
        row = len(decodes)
        for seq, num_new in items:
            if num_new > 1:
                start = seq.num_computed
                prefills.append((self._blocks.block_table(seq.seq_id), start, num_new))
                input_ids += seq.token_ids[start:start + num_new]
                positions += range(start, start + num_new)
                if seq.want_prompt_logprobs and start + 1 < seq.num_prompt_tokens:
                    prompt_rows.append((seq, row, start, min(num_new, seq.num_prompt_tokens - 1 - start)))
                row += num_new
                if start + num_new == len(seq.token_ids):
                    rows.append(row - 1)
                    sampled.append(seq)
        num_sampled = len(rows)
        for _, first, _, count in prompt_rows:
            rows += range(first, first + count)
        device = self.device
        meta = build_metadata(decodes, prefills, self.block_size, device)
        meta.scratch = self.cache.scratch(meta.max_gather_blocks)
        if self.captured is not None:
            meta.seen_windows = self.seen_windows
        self.cache.slot_mapping = meta.slot_mapping
        out = self.model(
            input_ids=to_device([input_ids], torch.long, device),
            position_ids=to_device([positions], torch.long, device),
            use_cache=True,
            logits_to_keep=to_device(rows, torch.long, device),
            paged=meta,
            **{self.cache_kwarg: self.cache},
        )
        logits = out.logits[0]
        prompt_part = None
        if prompt_rows:
            prompt_part = self._prompt_logprobs(logits[num_sampled:], prompt_rows)
            logits = logits[:num_sampled]
        if not sampled:
            if prompt_rows:
                self._keep_prompt_logprobs(prompt_rows, prompt_part, to_host(prompt_part[2]))
            return []
        if self.captured is not None:
            self.captured.append(logits.detach().clone())
        asking = None
        if any(seq.processed for seq in sampled):
            tokens, asking = self._sample_processed(logits, sampled)
        elif any(not seq.greedy for seq in sampled):
            tokens = sample(logits, self._sampling_tensors(sampled))
        else:
            tokens = logits.argmax(dim=-1)
        # The step's one device-to-host transfer: tokens, then the sampled and the prompt logprobs asked for.
        asked = asking[2] if asking else []
        prompt_tensors = prompt_part[2] if prompt_part else []
        fetched = to_host([tokens, *asked, *prompt_tensors])
        token_ids = fetched[0]
        if asking:
            rows_asking, num_top, _ = asking
            found = build_logprobs([token_ids[i] for i in rows_asking], fetched[1:1 + len(asked)], num_top)
            for i, logprob in zip(rows_asking, found):
                sampled[i].next_logprob = logprob
        if prompt_rows:
            self._keep_prompt_logprobs(prompt_rows, prompt_part, fetched[1 + len(asked):])
        # Keep order with ``items``: map each sampled sequence to its token.
        by_seq = dict(zip(sampled, token_ids))
        return [by_seq.get(seq) for seq, _ in items]

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
        if all(seq.greedy for seq in batch):
            tokens = work.argmax(dim=-1)
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


"""The engine's model side: a step's input tensors, one forward over the paged KV pool, sampling.

:class:`ModelRunner` packs the new tokens of the sequences that
:class:`ringstream.daemon.engine_scheduler.StepScheduler` chose into one row
(decodes first, then prompt chunks), each at its own positions, builds the
attention metadata from their block tables
(:func:`ringstream.daemon.kv_cache.build_metadata`), runs the model with the
engine's paged attention and cache, and samples the next token of every
sequence whose known tokens are then all computed (vLLM v1's GPU model runner,
``vllm/v1/worker/gpu_model_runner.py``).
"""

from __future__ import annotations

import inspect

import torch

from ringstream.daemon.block_manager import BlockManager
from ringstream.daemon.engine_scheduler import SequenceState
from ringstream.daemon.kv_cache import PagedKVCache, build_metadata
from ringstream.daemon.sampler import SamplingTensors, sample, token_seed

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
        for seq, num_new in items:
            if num_new == 1:
                pos = seq.num_computed
                decodes.append((self._blocks.block_table(seq.seq_id), pos))
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
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
                row += num_new
                if start + num_new == len(seq.token_ids):
                    rows.append(row - 1)
                    sampled.append(seq)
        device = self.device
        meta = build_metadata(decodes, prefills, self.block_size, device)
        meta.scratch = self.cache.scratch(meta.max_gather_blocks)
        if self.captured is not None:
            meta.seen_windows = self.seen_windows
        self.cache.slot_mapping = meta.slot_mapping
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            use_cache=True,
            logits_to_keep=torch.tensor(rows, dtype=torch.long, device=device),
            paged=meta,
            **{self.cache_kwarg: self.cache},
        )
        if not sampled:
            return []
        logits = out.logits[0]
        if self.captured is not None:
            self.captured.append(logits.detach().clone())
        if any(not seq.greedy for seq in sampled):
            tokens = sample(logits, self._sampling_tensors(sampled))
        else:
            tokens = logits.argmax(dim=-1)
        # Keep order with ``items``: map each sampled sequence to its token.
        by_seq = dict(zip(sampled, tokens.tolist()))
        return [by_seq.get(seq) for seq, _ in items]

    def _sampling_tensors(self, batch: list[SequenceState]) -> SamplingTensors:
        device = self.device
        top_k = [seq.top_k for seq in batch]
        top_p = [seq.top_p for seq in batch]
        return SamplingTensors(
            temperature=torch.tensor([seq.temperature for seq in batch], dtype=torch.float32, device=device),
            greedy=torch.tensor([seq.greedy for seq in batch], dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            all_greedy=False,
            any_greedy=any(seq.greedy for seq in batch),
            use_top_k=any(k < self.vocab_size for k in top_k),
            use_top_p=any(p < 1.0 for p in top_p),
            seeded_rows=[(i, self._seed_generator(seq)) for i, seq in enumerate(batch) if seq.generator is not None],
            generator=self.generator,
        )

    @staticmethod
    def _seed_generator(seq: SequenceState) -> torch.Generator:
        """Seed ``seq``'s generator for its next output token and return it."""
        seq.generator.manual_seed(token_seed(seq.request.params.seed, len(seq.request.output_token_ids)))
        return seq.generator


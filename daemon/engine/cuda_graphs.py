"""Decode steps over static input buffers, the ground CUDA graphs need: capture buckets, padding, a dummy slot.

A CUDA graph replays fixed kernels over fixed addresses, so a decode step that
is to be replayed must read its inputs from preallocated tensors of a fixed
shape (vLLM's and nano-vllm's scheme): one graph per batch-size *bucket*
(:func:`graph_batch_sizes`), a batch of ``n`` decodes runs in the smallest
bucket ``b >= n`` (:func:`bucket_for`) with rows ``n..b-1`` padded, and
prefill (and any batch above the largest bucket) stays eager.

:class:`DecodeBuffers` holds those tensors, sized for the largest bucket:
token ids, positions, slot mapping, block tables ``[max_bs, max_blocks_per_seq]``,
sequence lengths, and the validity mask the engine's attention reads. Its
:meth:`DecodeBuffers.prepare` copies one step's real decode rows into the
first rows and pads the rest, and :meth:`DecodeBuffers.metadata` describes the
bucket to :func:`ringstream.daemon.engine.attention.paged_attention` as one decode
group over all its rows, each gathering ``max_blocks_per_seq`` blocks. The
forward is the one :class:`ringstream.daemon.engine.model_runner.ModelRunner` runs
(``input_ids [1, b]``, ``position_ids [1, b]``, ``paged=``, the cache), so the
real rows' logits agree with the eager step's: rows are independent of one
another and positions past a row's length are masked. Bit for bit only at
``b == n``: a GEMM over ``b`` rows may round differently from one over ``n``
(measured on CPU in float32: up to 2e-7 in logits and KV).

A padded row must neither write nor read any real sequence's KV.
:meth:`ringstream.daemon.engine.kv_cache.PagedKVCache.update` writes every row's key
and value with ``index_copy_`` at its slot (a negative slot is an error, not
skipped), so a padded row writes slot 0 of a *dummy block*: a block of the pool
the block manager never hands out (the engine builds its
:class:`ringstream.daemon.engine.block_manager.BlockManager` over ``num_blocks - 1``
blocks when graphs are on, so the pool's last block ``num_blocks - 1`` is the
dummy). Not block 0: the null block must stay zero. A padded row is token 0 at
position 0 with sequence length 1, so it reads only the key and value it just
wrote into the dummy slot: finite numbers, whatever the dummy block held.

What this costs: the bucket's attention gathers ``max_blocks_per_seq`` blocks
for every row (the eager step gathers each group's longest), since the gather
width must be fixed for a graph; a paged kernel reading the blocks in place
would not pay it.

:class:`CudaGraphRunner` captures and replays one ``torch.cuda.CUDAGraph`` per
bucket over the buffers; it runs only on CUDA. With ``capture=False`` (any
device) it calls the model eagerly on the buffer views, which is what the CPU
tests check against the engine's eager decode step.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from ringstream.daemon.engine.attention import STEP
from ringstream.daemon.engine.kv_cache import AttentionMetadata, DecodeGroup, PagedKVCache

__all__ = ["CudaGraphRunner", "DecodeBuffers", "DecodeInputs", "bucket_for", "graph_batch_sizes"]

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes a graph is captured for: 1, 2, 4, then the multiples of 8 up to
    ``max_num_seqs``, and ``max_num_seqs`` itself (ascending, no duplicates).

    The scheme of vLLM's ``CompilationConfig.cudagraph_capture_sizes`` default
    (``[1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_graph_size + 1, 16))``
    with ``max_graph_size = min(max_num_seqs * 2, 512)``; the older
    ``_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [8 * i ...]`` of ``vllm/worker/model_runner.py``),
    here in steps of 8 throughout and capped at ``max_num_seqs``: the step
    scheduler never runs more decodes than that, so a larger graph would only
    hold memory.

    Raises:
        ValueError: ``max_num_seqs`` is not a positive int.
    """
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest of ascending ``sizes`` at or above ``batch``; None above the largest (run eager).

    Raises:
        ValueError: ``batch`` is below 1.
    """
    if batch < 1:
        raise ValueError(f"a decode batch has at least one row, got {batch}")
    at = bisect.bisect_left(sizes, batch)
    return sizes[at] if at < len(sizes) else None


@dataclass(slots=True)
class DecodeInputs:
    """One step's decode rows, as :class:`ringstream.daemon.engine.model_runner.ModelRunner` builds them.

    Attributes:
        token_ids: the token each row feeds.
        decodes: ``(block_table, position)`` per row, the list the runner gives
            :func:`ringstream.daemon.engine.kv_cache.build_metadata`.
    """

    token_ids: list[int]
    decodes: list[tuple[list[int], int]]


class DecodeBuffers:
    """Static decode inputs for batches of up to ``max_batch`` rows, on ``device``.

    Args:
        max_batch: rows of the largest bucket.
        max_blocks_per_seq: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per block.
        dummy_block: block id padded rows write and read (module docstring); not 0.
        device: where the buffers live (the model's device).
        cache: when given, the gather scratch is taken from it once, sized for
            the largest bucket, so every step of a bucket uses the same memory.

    Attributes (``[max_batch]`` int64 unless said): ``input_ids``, ``positions``,
    ``slot_mapping``, ``seq_lens``; ``block_tables [max_batch, max_blocks_per_seq]``;
    ``kv_valid [max_batch, 1, 1, max_blocks_per_seq * block_size]`` bool.

    Raises:
        ValueError: a size is below 1, or ``dummy_block`` is the null block.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, dummy_block: int,
                 device: torch.device, cache: PagedKVCache | None = None) -> None:
        if min(max_batch, max_blocks_per_seq, block_size) < 1:
            raise ValueError(f"sizes must be positive: max_batch={max_batch}, "
                             f"max_blocks_per_seq={max_blocks_per_seq}, block_size={block_size}")
        if dummy_block < 1:
            raise ValueError(f"dummy_block must be a reserved block other than the null block 0, got {dummy_block}")
        long = {"dtype": torch.long, "device": device}
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.device = device
        width = max_blocks_per_seq * block_size
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.full((max_batch,), dummy_block * block_size, **long)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), **long)
        self.block_tables[:, 0] = dummy_block
        self.seq_lens = torch.ones(max_batch, **long)
        self.kv_valid = torch.zeros((max_batch, 1, 1, width), dtype=torch.bool, device=device)
        self.kv_valid[..., 0] = True
        self.rows = torch.arange(max_batch, **long)
        self._kv_positions = torch.arange(width, **long)
        self.scratch = None if cache is None else cache.scratch(max_batch * max_blocks_per_seq)
        self._host = self._staging()

    def _staging(self) -> torch.Tensor:
        """One host tensor ``[max_batch, 4 + max_blocks_per_seq]`` the step is assembled in, then copied in one
        blocking transfer (it is reused by the next step)."""
        return torch.zeros((self.max_batch, 4 + self.max_blocks_per_seq), dtype=torch.long)

    def prepare(self, inputs: DecodeInputs, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``inputs`` into rows ``[0, n)`` and padding into rows ``[n, bucket)``.

        Padded row: token 0 at position 0, slot ``dummy_block * block_size``,
        block table ``[dummy_block, 0, ...]``, sequence length 1.

        Returns:
            ``(input_ids [1, bucket], position_ids [1, bucket])``, views of the buffers.

        Raises:
            ValueError: ``bucket`` is outside ``[n, max_batch]``, the rows disagree
                in number, or a row's context exceeds the block-table width.
        """
        n, bs = len(inputs.decodes), self.block_size
        if len(inputs.token_ids) != n:
            raise ValueError(f"{len(inputs.token_ids)} token ids for {n} decode rows")
        if not 1 <= n <= bucket <= self.max_batch:
            raise ValueError(f"bucket {bucket} cannot hold {n} rows (largest bucket {self.max_batch})")
        host = self._host[:bucket]
        host[:, 0:2] = 0  # token id, position
        host[:, 2] = self.dummy_block * bs  # slot
        host[:, 3] = 1  # sequence length
        host[:, 4:] = 0
        host[:, 4] = self.dummy_block
        for i, ((table, pos), token) in enumerate(zip(inputs.decodes, inputs.token_ids)):
            width = pos // bs + 1
            if width > self.max_blocks_per_seq or len(table) < width:
                raise ValueError(f"row {i} at position {pos} needs {width} blocks: table of {len(table)}, "
                                 f"width {self.max_blocks_per_seq}")
            host[i, 0], host[i, 1], host[i, 2], host[i, 3] = token, pos, table[pos // bs] * bs + pos % bs, pos + 1
            host[i, 4:4 + width] = torch.tensor(table[:width])
            host[i, 4 + width:] = 0
        staged = host.to(self.device)
        self.input_ids[:bucket].copy_(staged[:, 0])
        self.positions[:bucket].copy_(staged[:, 1])
        self.slot_mapping[:bucket].copy_(staged[:, 2])
        self.seq_lens[:bucket].copy_(staged[:, 3])
        self.block_tables[:bucket].copy_(staged[:, 4:])
        torch.lt(self._kv_positions.unsqueeze(0), self.seq_lens[:bucket].unsqueeze(1),
                 out=self.kv_valid[:bucket].view(bucket, -1))
        return self.input_ids[:bucket].unsqueeze(0), self.positions[:bucket].unsqueeze(0)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The bucket's attention metadata over the buffers: one decode group of all ``bucket`` rows.

        ``max_context`` is the block-table width, so a sliding window shorter
        than it is always applied as a mask (the same mask the eager step
        builds, or none where no row reaches past the window).
        """
        width = self.max_blocks_per_seq * self.block_size
        group = DecodeGroup(self.rows[:bucket], self.block_tables[:bucket].reshape(-1), self.kv_valid[:bucket],
                            self.seq_lens[:bucket])
        return AttentionMetadata(self.slot_mapping[:bucket], [group], [], bucket, self.block_size, width,
                                 scratch=self.scratch)


class CudaGraphRunner:
    """Decode steps of up to ``max(sizes)`` rows through :class:`DecodeBuffers`, one CUDA graph per bucket.

    Args:
        model: the causal LM on the paged attention, its forward as the model runner calls it.
        cache: the KV pool; its ``slot_mapping`` is pointed at the buffers' for each step.
        buffers: the static inputs, ``max_batch >= max(sizes)``.
        sizes: ascending buckets (:func:`graph_batch_sizes`).
        cache_kwarg: the forward's keyword for the cache (``cache`` or ``past_key_values``).
        capture: capture graphs (CUDA only); False calls the model eagerly on the
            buffer views at each :meth:`run`, on any device.

    Raises:
        ValueError: ``capture`` on a device that is not CUDA, or buffers smaller than the largest bucket.
    """

    def __init__(self, model, cache: PagedKVCache, buffers: DecodeBuffers, sizes: list[int], *,
                 cache_kwarg: str = "cache", capture: bool = True) -> None:
        if capture and buffers.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {buffers.device}")
        if sizes[-1] > buffers.max_batch:
            raise ValueError(f"largest bucket {sizes[-1]} exceeds the buffers' {buffers.max_batch} rows")
        self.model, self.cache, self.buffers, self.sizes = model, cache, buffers, list(sizes)
        self.cache_kwarg = cache_kwarg
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model over the buffers' first ``bucket`` rows (as last prepared): logits ``[bucket, vocab]``."""
        buf = self.buffers
        meta = buf.metadata(bucket)
        self.cache.slot_mapping = meta.slot_mapping
        STEP.metadata = meta  # for layers that do not pass paged= on (attention.STEP)
        try:
            out = self.model(input_ids=buf.input_ids[:bucket].unsqueeze(0),
                             position_ids=buf.positions[:bucket].unsqueeze(0), use_cache=True, logits_to_keep=0,
                             paged=meta, **{self.cache_kwarg: self.cache})
        finally:
            STEP.metadata = None
        return out.logits[0]

    def run(self, inputs: DecodeInputs) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` of the ``n`` decode rows of ``inputs``; None when ``n`` is above every bucket
        (or no graph was captured for its bucket): the caller runs the step eagerly."""
        bucket = bucket_for(len(inputs.decodes), self.sizes)
        if bucket is None or (self.capture and bucket not in self.graphs):
            return None
        self.buffers.prepare(inputs, bucket)
        if not self.capture:
            return self._forward(bucket)[:len(inputs.decodes)]
        graph, logits = self.graphs[bucket]
        self.cache.slot_mapping = self.buffers.slot_mapping[:bucket]
        graph.replay()
        return logits[:len(inputs.decodes)]

    @torch.inference_mode()
    def capture_all(self, warmup: DecodeInputs | None = None) -> bool:
        """Capture one graph per bucket, largest first, sharing one memory pool; log time and memory.

        Every bucket is first run eagerly on a side stream (padded rows only),
        as ``torch.cuda.graphs`` asks, then captured. With ``warmup`` (real
        decode rows whose KV the pool holds; their KV slots are rewritten with
        the same values), the replayed logits are compared with the eager ones;
        a mismatch logs a warning, drops the graphs and returns False (run eager).
        """
        if not self.capture:
            return False
        start, before = time.monotonic(), torch.cuda.memory_allocated(self.buffers.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.buffers.device)
        pad_only = DecodeInputs([0], [([self.buffers.dummy_block], 0)])
        for bucket in reversed(self.sizes):
            self.buffers.prepare(pad_only, bucket)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bucket)
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(self.buffers.device)
        used = torch.cuda.memory_allocated(self.buffers.device) - before
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s, %.1f MiB", len(self.graphs),
                 self.sizes, time.monotonic() - start, used / 2 ** 20)
        if warmup is None:
            return True
        bucket = bucket_for(len(warmup.decodes), self.sizes)
        self.buffers.prepare(warmup, bucket)
        eager = self._forward(bucket)[:len(warmup.decodes)].clone()
        replayed = self.run(warmup)
        if replayed is None or not torch.equal(replayed, eager):
            diff = float("nan") if replayed is None else (replayed.float() - eager.float()).abs().max().item()
            log.warning("decode CUDA graphs disagree with the eager step (largest logit difference %s): "
                        "decoding eagerly", diff)
            self.graphs.clear()
            return False
        return True

"""Paged KV cache of one worker: the pool tensors and the per-step attention metadata.

The pool is, per layer, one key and one value buffer of shape
``[num_kv_heads, num_blocks * block_size, head_dim]``: column ``s`` is the
*slot* ``block_id * block_size + offset`` (vLLM's slot mapping). Heads lead so
that gathering whole blocks yields ``[g, num_kv_heads, T, head_dim]`` with
contiguous ``[T, head_dim]`` matrices, which the attention kernels read
without another copy (measured on CPU: about 1.6x faster than a
slot-major layout for a decode layer). All layers share the
block ids handed out by :class:`ringstream.daemon.engine.block_manager.BlockManager`; block 0 is
the zero-filled null block that padded reads point at.

Each engine step runs one forward over a *packed* batch: the new tokens of
every scheduled sequence side by side, ``input_ids [1, N]``, each with its own
position (decode: one token; prefill: a chunk of its prompt). The engine
describes the batch in an :class:`AttentionMetadata`, handed to the model as
the keyword argument ``paged`` (transformers passes extra keyword arguments
through every layer to its attention function and to ``cache.update``):

* ``slot_mapping [N]``: where each new token's key and value are written;
* decode groups: rows with one query token, grouped by similar context
  length, each with the block ids to gather and a validity mask, so no row is padded to the batch's longest row (padding is
  bounded by the group rule, :data:`DECODE_GROUP_RATIO`);
* prefill chunks: one sequence each, the chunk's queries attending its whole
  context (cached prefix, earlier chunks, the chunk itself, causally).

:class:`PagedKVCache` is passed as ``cache=``; its ``update`` stores the layer's
new keys and values and returns the layer's pool buffers, which the attention
function (:func:`ringstream.daemon.engine.attention.paged_attention`) reads through the metadata.
It is not a ``transformers.Cache`` subclass: mask creation is skipped for the
engine's attention implementation and the metadata carries all there is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ringstream.daemon.engine.device_io import to_device

__all__ = ["AttentionMetadata", "DecodeGroup", "PagedKVCache", "PrefillChunk", "build_metadata"]

DECODE_GROUP_RATIO = 0.5
"""A decode row joins the current group while its context is at least this fraction of the group's
longest: padding then costs at most 2x the tokens attended, with at most log2(longest/shortest) + 1
groups."""
DECODE_GROUP_MIN_TOKENS = 128
"""Rows within this many tokens of the group's longest always join it (a group costs a few kernel calls)."""
MAX_MASK_ELEMENTS = 1 << 24
"""Prefill queries are split so that one mask holds at most this many elements (16 MiB of bools)."""


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, attended in one batched call.

    Attributes:
        rows: ``[g]`` int64, the rows' indices in the packed batch.
        block_index: ``[g * nb]`` int64, each row's first ``nb`` block ids (the null block past its end).
        kv_valid: ``[g, 1, 1, nb * block_size]`` bool, True on real context positions.
    """

    rows: torch.Tensor
    block_index: torch.Tensor
    kv_valid: torch.Tensor
    lengths: torch.Tensor | None = None
    """``[g]`` int64 context length of each row (its query sits at ``length - 1``)."""
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)
    """``kv_valid`` restricted to the last ``w`` positions, per sliding window ``w`` (built on first use)."""

    def valid(self, window: int | None) -> torch.Tensor:
        """The validity mask, restricted to each row's last ``window`` positions when given."""
        if window is None:
            return self.kv_valid
        mask = self.windowed.get(window)
        if mask is None:
            length = self.kv_valid.shape[-1]
            first = (self.lengths - window).view(-1, 1, 1, 1)
            arange = torch.arange(length, device=self.kv_valid.device).view(1, 1, 1, length)
            mask = self.windowed[window] = self.kv_valid & (arange >= first)
        return mask


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of ``num_query`` new tokens, at packed rows ``[start, start + num_query)``.

    Attributes:
        start: first packed row of the chunk.
        num_query: new tokens in the chunk.
        block_index: ``[nb]`` int64, the blocks of the context up to the chunk's last token.
        splits: ``(q_begin, q_end, kv_end, mask)`` pieces of the chunk's queries; ``mask`` is a
            ``[q_end - q_begin, kv_end]`` bool mask, or None where ``is_causal`` alignment is exact
            (the piece starts the sequence).
    """

    start: int
    num_query: int
    block_index: torch.Tensor
    splits: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)
    context_start: int = 0
    """Position of the chunk's first query (the tokens before it are cached context)."""
    windowed: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, split: int, window: int | None) -> torch.Tensor | None:
        """Mask of split ``split``: causal, and within ``window`` positions of each query when given.

        None means plain causal alignment (``is_causal``).
        """
        q_begin, q_end, kv_end, mask = self.splits[split]
        if window is None:
            return mask
        cached = self.windowed.get((split, window))
        if cached is None:
            device = self.block_index.device
            query_pos = torch.arange(self.context_start + q_begin, self.context_start + q_end,
                                     device=device).unsqueeze(1)
            key_pos = torch.arange(kv_end, device=device).unsqueeze(0)
            cached = self.windowed[(split, window)] = (key_pos <= query_pos) & (key_pos > query_pos - window)
        return cached


@dataclass(slots=True)
class AttentionMetadata:
    """How the packed batch of one step maps onto the KV pool; shared by all layers."""

    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup]
    prefill_chunks: list[PrefillChunk]
    num_tokens: int
    block_size: int
    max_context: int = 0
    """Longest context (positions attended) of any sequence in the step."""
    seen_windows: set | None = None
    """When set, the attention functions add each ``sliding_window`` a layer passed (None for full attention)."""
    scratch: torch.Tensor | None = None
    """Reused by every layer for the gathered keys and values (set by the engine from
    :meth:`PagedKVCache.scratch`); None: the attention allocates its own."""
    native: object | None = None
    """``torch.ops.ringstream`` when the native CPU kernel serves this step's decode rows
    (:func:`ringstream.daemon.engine.kernels.native_ops`); None: the pure-torch gather path."""

    @property
    def max_gather_blocks(self) -> int:
        """Most blocks one attention call of this step may gather (per key or value buffer); decode groups count
        even where the native kernel reads them in place, since a layer that takes the eager path gathers them
        (the scratch's pages are only touched when it does)."""
        return max([g.block_index.numel() for g in self.decode_groups]
                   + [c.block_index.numel() for c in self.prefill_chunks])


class PagedKVCache:
    """The KV pool: per layer ``[num_kv_heads, num_blocks * block_size, head_dim]`` keys and values.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        value_head_dim: the values' head size when it differs from the keys'
            (multi-head latent attention stores keys of ``qk_nope + qk_rope``
            and values of ``v_head_dim`` per head); default ``head_dim``.
        num_blocks, block_size: pool size (block 0 included, kept zero).
        dtype, device: of the buffers.

    The buffers start zeroed: attention reads whole blocks and masks the
    positions past a sequence's end, and a masked position still enters the
    probabilities-times-values product with weight 0, where uninitialised
    memory (a NaN) would poison the row. Slots only ever hold keys and values
    a model wrote, or zeros; a block handed to a new sequence is cleared first
    (:meth:`clear_blocks`, from the model runner), so a former owner's NaN or
    inf cannot reach the new owner through its masked tail either.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_head_dim: int | None = None) -> None:
        value_head_dim = value_head_dim or head_dim
        slots = num_blocks * block_size
        self.key_cache = [torch.zeros((num_kv_heads, slots, head_dim), dtype=dtype, device=device)
                          for _ in range(num_layers)]
        self.value_cache = [torch.zeros((num_kv_heads, slots, value_head_dim), dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slot_mapping: torch.Tensor | None = None
        self._block_elements = num_kv_heads * block_size * (head_dim + value_head_dim)
        self._scratch = torch.empty(0, dtype=dtype, device=device)

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero every layer's keys and values of ``block_ids`` (a reused block's former owner's values, which
        a masked position past the new owner's end would otherwise bring into ``0 * value``)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.key_cache[0].device)
        for buffers in (self.key_cache, self.value_cache):
            for buffer in buffers:
                buffer.view(buffer.shape[0], self.num_blocks, -1).index_fill_(1, index, 0)

    def scratch(self, num_blocks: int) -> torch.Tensor:
        """A reusable buffer for the keys and values of ``num_blocks`` gathered blocks (grown, never shrunk).

        Reusing one buffer across layers and steps saves an allocation (and, on
        CPU, its page faults) per gather.
        """
        need = num_blocks * self._block_elements
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=self._scratch.dtype, device=self._scratch.device)
        return self._scratch

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                        value_head_dim: int | None = None) -> int:
        """Bytes one block takes across all layers' keys and values."""
        return num_layers * block_size * num_kv_heads * (head_dim + (value_head_dim or head_dim)) * dtype_bytes

    # What transformers' modeling code asks of a ``Cache`` besides ``update``. A step packs many sequences into
    # one row, so there is no common past length: positions come from ``position_ids`` and the attention reads
    # the step's metadata, not a mask (masks are skipped for an attention with no mask function registered).
    # A model that uses these answers for anything else fails the engine's start check against its own forward.
    is_compileable = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed step has no common past length (positions are passed as ``position_ids``)."""
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0, as :meth:`get_seq_length`."""
        return 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a mask over the step's own rows: ``(query_length, 0)``."""
        length = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return length, 0

    @property
    def nbytes(self) -> int:
        """Bytes held by all key and value buffers."""
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None, **_) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values at the step's slot mapping; return the layer's pool buffers.

        Args:
            key_states, value_states: ``[1, num_kv_heads, N, head_dim]`` (after RoPE; values
                ``value_head_dim``), packed rows.
            layer_idx: decoder layer index.

        Returns:
            ``(keys, values)``: the pool buffers ``[num_kv_heads, slots, head_dim]`` of ``layer_idx``.
        """
        slots = self.slot_mapping
        keys = self.key_cache[layer_idx]
        values = self.value_cache[layer_idx]
        keys.index_copy_(1, slots, key_states[0])
        values.index_copy_(1, slots, value_states[0])
        return keys, values


def build_metadata(
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Describe one step's packed batch: decode rows first, then prefill chunks.

    Args:
        decodes: ``(block_table, position)`` per decode row: the row's one new
            token sits at ``position`` and attends positions ``[0, position]``.
        prefills: ``(block_table, start, num_query)`` per chunk: new tokens at
            positions ``[start, start + num_query)``, attending ``[0, start + num_query)``.
        block_size: tokens per block.
        device: where the index tensors go.

    Returns:
        The step's :class:`AttentionMetadata`; packed row ``i < len(decodes)``
        is decode row ``i``, then each chunk's tokens in order.
    """
    long = {"dtype": torch.long, "device": device}
    slots: list[int] = []
    groups: list[DecodeGroup] = []
    if decodes:
        slots = [table[pos // block_size] * block_size + pos % block_size for table, pos in decodes]
        order = sorted(range(len(decodes)), key=lambda i: -decodes[i][1])
        begin = 0
        while begin < len(order):
            longest = decodes[order[begin]][1] + 1
            end = begin + 1
            while end < len(order):
                length = decodes[order[end]][1] + 1
                if length < longest * DECODE_GROUP_RATIO and longest - length > DECODE_GROUP_MIN_TOKENS:
                    break
                end += 1
            members = order[begin:end]
            width = -(-longest // block_size)
            blocks = []
            for i in members:
                table = decodes[i][0][:width]
                blocks += table
                blocks += [0] * (width - len(table))
            lengths = to_device([decodes[i][1] + 1 for i in members], torch.long, device)
            valid = torch.arange(width * block_size, **long).unsqueeze(0) < lengths.unsqueeze(1)
            groups.append(DecodeGroup(to_device(members, torch.long, device), to_device(blocks, torch.long, device),
                                      valid.view(len(members), 1, 1, width * block_size), lengths))
            begin = end
    chunks: list[PrefillChunk] = []
    row = len(decodes)
    for table, start, num_query in prefills:
        kv_len = start + num_query
        width = -(-kv_len // block_size)
        block_index = to_device(table[:width], torch.long, device)
        for block in range(start // block_size, width):  # the chunk's slots, block by block, on the host
            base = table[block] * block_size
            slots += range(base + max(start - block * block_size, 0), base + min(kv_len - block * block_size,
                                                                                  block_size))
        chunk = PrefillChunk(row, num_query, block_index, context_start=start)
        step = max(1, MAX_MASK_ELEMENTS // kv_len)
        for q_begin in range(0, num_query, step):
            q_end = min(num_query, q_begin + step)
            kv_end = start + q_end
            if start == 0 and q_begin == 0:
                chunk.splits.append((q_begin, q_end, kv_end, None))
                continue
            query_pos = torch.arange(start + q_begin, kv_end, **long).unsqueeze(1)
            mask = torch.arange(kv_end, **long).unsqueeze(0) <= query_pos
            chunk.splits.append((q_begin, q_end, kv_end, mask))
        chunks.append(chunk)
        row += num_query
    max_context = max([pos + 1 for _, pos in decodes] + [start + n for _, start, n in prefills])
    return AttentionMetadata(to_device(slots, torch.long, device), groups, chunks, row, block_size, max_context)

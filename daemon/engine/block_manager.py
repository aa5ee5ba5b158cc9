"""KV-cache block manager: paged blocks, block tables, automatic prefix caching. No torch.

The KV pool of a worker is ``num_blocks`` fixed-size blocks of ``block_size``
token positions each (every layer's key and value buffers share the block ids).
A sequence owns a *block table*: the ids of the blocks holding its positions
``[0, block_size)``, ``[block_size, 2 * block_size)``, ... Blocks are taken as
the sequence grows and returned when it ends (on-demand paging, Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023).

**Prefix caching.** A block whose ``block_size`` positions are all computed is
keyed by a chained hash, ``sha256(parent block's hash || its token ids)``, so
the key names the whole prefix up to and including the block (vLLM v1's
``kv_cache_utils.hash_block_tokens``; SHA-256 rather than Python's ``hash`` so
that one app cannot forge a collision with another app's prefix and read or
poison its cache). Blocks are reference-counted: a new sequence whose leading
blocks' hashes are cached shares those blocks and prefills only the rest. A
block whose last reference goes stays cached on the free list until it is
needed for something else; the free list evicts the least recently freed
cached block first (LRU), and hands out blocks that hold no cached prefix
before any cached one.

Block 0 is the *null block*: never allocated, its KV buffers stay zero, and
attention kernels point padding at it, so a padded gather never reads
uninitialised memory (vLLM's ``null_block``).

Anchors: vLLM v1 ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``;
nano-vllm ``nanovllm/engine/block_manager.py``. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ringstream.daemon.common.prefix_hash import block_hashes

__all__ = ["BlockManager", "BlocksCleared", "BlocksRemoved", "BlocksStored", "NoFreeBlocks", "NULL_BLOCK"]

NULL_BLOCK = 0
"""Block id of the zero-filled null block that padding points at; never allocated."""
DEFAULT_BLOCK_SIZE = 16
"""Token positions per block (vLLM's default on CUDA)."""


class NoFreeBlocks(Exception):
    """Not enough free blocks for an allocation; nothing was changed."""


@dataclass(slots=True)
class BlocksStored:
    """Full blocks that entered the prefix cache, in prefix order (one sequence's, consecutive)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    """Key of the block before the first one; None when the first is the sequence's first block."""
    token_ids: list[int]
    """The blocks' token ids, ``block_size`` per block."""


@dataclass(slots=True)
class BlocksRemoved:
    """Cached blocks evicted (their keys no longer name KV in the pool)."""

    block_hashes: list[bytes]


@dataclass(slots=True)
class BlocksCleared:
    """Every cached prefix forgotten (:meth:`BlockManager.reset_prefix_cache`)."""


@dataclass(slots=True, eq=False)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    handed_out: bool = False  # ever given to a sequence: its KV may hold a former owner's values


@dataclass(slots=True)
class _Table:
    """One sequence's blocks and the keys of its leading full, computed blocks."""

    blocks: list[_Block] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class BlockManager:
    """Allocates KV-cache blocks to sequences; see the module docstring.

    Args:
        num_blocks: blocks in the pool, the null block included (>= 2).
        block_size: token positions per block (>= 1).
        enable_prefix_caching: share and keep blocks by their prefix key.

    Raises:
        ValueError: a size out of range.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks}: need the null block and at least one more")
        if block_size < 1:
            raise ValueError(f"block_size = {block_size}: must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[_Block] = deque(self._blocks[1:])
        self._free_cached: OrderedDict[int, _Block] = OrderedDict()  # LRU first
        self._cached: dict[bytes, _Block] = {}
        self._tables: dict[int, _Table] = {}
        self._fresh: list[int] = []  # reused blocks handed out since take_fresh_blocks() last ran
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache (counter)."""
        self.prefix_hits = 0
        """Prompt tokens found there (counter)."""
        self._events: list[BlocksStored | BlocksRemoved | BlocksCleared] | None = None

    # ------------------------------------------------------------ cache events

    def record_events(self, enabled: bool = True) -> None:
        """Start (or stop) recording what enters and leaves the prefix cache, for :meth:`take_events`."""
        self._events = [] if enabled else None

    def take_events(self) -> list[BlocksStored | BlocksRemoved | BlocksCleared]:
        """The prefix-cache changes since the last call, in order (empty when not recording).

        A key listed as stored names KV in the pool until a later removed or cleared event lists it; the
        sequence of events replayed from the start gives exactly :attr:`num_cached_blocks` live keys.
        """
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ figures

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` positions occupy."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ sequences

    def block_table(self, seq_id: int) -> list[int]:
        """Block ids of ``seq_id``, in position order (a copy). Raises KeyError for an unknown id."""
        return [block.block_id for block in self._tables[seq_id].blocks]

    def num_blocks_of(self, seq_id: int) -> int:
        """Blocks held by ``seq_id`` (0 for an unknown id)."""
        table = self._tables.get(seq_id)
        return len(table.blocks) if table is not None else 0

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def cached_prefix(self, hashes: Sequence[bytes], max_tokens: int) -> int:
        """Blocks at the head of ``hashes`` that are cached, covering at most ``max_tokens`` positions.

        Changes nothing; see :meth:`allocate`.
        """
        if not self.enable_prefix_caching or max_tokens < self.block_size:
            return 0
        hits = 0
        for key in hashes[:max_tokens // self.block_size]:
            if key not in self._cached:
                break
            hits += 1
        return hits

    def can_allocate(self, num_tokens: int, hashes: Sequence[bytes] = (), max_cached_tokens: int = 0) -> bool:
        """Whether :meth:`allocate` with these arguments would succeed now."""
        if num_tokens < 1:
            return False
        _, new, revived = self._new_blocks_needed(num_tokens, hashes, max_cached_tokens)
        return new + revived <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int, hashes: Sequence[bytes] = (),
                 max_cached_tokens: int = 0) -> int:
        """Give a new sequence blocks for its first ``num_tokens`` positions, sharing its cached prefix.

        Args:
            seq_id: the sequence, not yet known to the manager.
            num_tokens: positions to hold (>= 1).
            hashes: keys of the sequence's leading full blocks (:func:`block_hashes`).
            max_cached_tokens: most positions the cached prefix may cover. The
                last token of a prompt must be computed to give logits, so the
                caller passes ``len(tokens) - 1``.

        Returns:
            Positions covered by cached blocks (a multiple of ``block_size``):
            their KV is already in the pool, prefill starts after them.

        Raises:
            ValueError: ``seq_id`` already holds blocks, or ``num_tokens < 1``.
            NoFreeBlocks: not enough free blocks (nothing changed).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if num_tokens < 1:
            raise ValueError(f"num_tokens = {num_tokens}: must be >= 1")
        hits, new, revived = self._new_blocks_needed(num_tokens, hashes, max_cached_tokens)
        if new + revived > self.num_free_blocks:
            raise NoFreeBlocks(f"{new + revived} blocks needed, {self.num_free_blocks} free")
        table = self._tables[seq_id] = _Table()
        for key in hashes[:hits]:
            block = self._cached[key]
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1
            table.blocks.append(block)
            table.hashes.append(key)
        for _ in range(new):
            table.blocks.append(self._take_free())
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += hits * self.block_size
        return hits * self.block_size

    def append_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow ``seq_id`` to hold ``num_tokens`` positions in all; False (nothing changed) if blocks run out."""
        table = self._tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table.blocks)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.blocks.append(self._take_free())
        return True

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first ``num_computed`` positions of ``seq_id`` in the prefix cache.

        ``token_ids`` are the sequence's tokens (at least ``num_computed``).
        Call after each step that computed KV for the sequence. A block whose
        key already names another block (two sequences computed the same
        prefix at once) stays private and is freed as uncached.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        full = min(num_computed // self.block_size, len(table.blocks))
        if len(table.hashes) >= full:
            return
        parent = table.hashes[-1] if table.hashes else None
        stored: BlocksStored | None = None
        for key in block_hashes(token_ids[:full * self.block_size], self.block_size, len(table.hashes), parent):
            index = len(table.hashes)
            block = table.blocks[index]
            table.hashes.append(key)
            if block.block_hash is None and key not in self._cached:
                block.block_hash = key
                self._cached[key] = block
                if self._events is not None:
                    if stored is None:
                        stored = BlocksStored([], table.hashes[index - 1] if index else None, [])
                        self._events.append(stored)
                    stored.block_hashes.append(key)
                    stored.token_ids.extend(token_ids[index * self.block_size:(index + 1) * self.block_size])
            else:
                stored = None  # a run of stored blocks is consecutive: the next one starts a new event

    def free(self, seq_id: int) -> None:
        """Return every block of ``seq_id``; cached ones stay reusable until evicted. Unknown ids are ignored.

        Blocks are released tail first, so the LRU evicts a sequence's last
        blocks before its first ones (a shared prefix outlives its suffixes).
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_uncached.appendleft(block)
                else:
                    self._free_cached[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        if self._events is not None:
            self._events.append(BlocksCleared())
        for block in self._free_cached.values():
            block.block_hash = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    # ------------------------------------------------------------ internals

    def _new_blocks_needed(self, num_tokens: int, hashes: Sequence[bytes],
                           max_cached_tokens: int) -> tuple[int, int, int]:
        """``(cached blocks reused, new blocks, reused blocks taken off the free list)`` for an allocation."""
        hits = self.cached_prefix(hashes, min(max_cached_tokens, num_tokens))
        revived = sum(1 for key in hashes[:hits] if self._cached[key].ref_cnt == 0)
        return hits, self.blocks_for(num_tokens) - hits, revived

    def take_fresh_blocks(self) -> list[int]:
        """Ids of the used blocks handed out again from the free list since the last call (not prefix hits; a
        block never handed out before is still zero and is not listed), oldest first.

        Such a block still holds its former owner's keys and values; positions past the new owner's end are
        read by a block-granular gather (and masked), where a stale NaN or inf would survive the mask as
        ``0 * NaN``. The caller clears these blocks before the step's forward writes into them.
        """
        fresh, self._fresh = self._fresh, []
        return fresh

    def _take_free(self) -> _Block:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            _, block = self._free_cached.popitem(last=False)
            del self._cached[block.block_hash]
            if self._events is not None:
                if self._events and isinstance(self._events[-1], BlocksRemoved):
                    self._events[-1].block_hashes.append(block.block_hash)
                else:
                    self._events.append(BlocksRemoved([block.block_hash]))
            block.block_hash = None
        block.ref_cnt = 1
        if block.handed_out:  # a never-used block is still zero
            self._fresh.append(block.block_id)
        block.handed_out = True
        return block

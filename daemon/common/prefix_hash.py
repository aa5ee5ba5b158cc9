"""The prefix-cache block key: a chained SHA-256 over full blocks of token ids. No torch.

Shared by the engine's block manager (which caches blocks under these keys) and
the front's scheduler (which routes a prompt to the worker holding its prefix):
both must compute the same key for the same tokens.

Source: vLLM v1 ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``);
SHA-256 rather than Python's ``hash`` so that one app cannot forge a collision
with another app's prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["block_hashes", "hash_block_tokens"]


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of one full block: SHA-256 over the parent block's key and the block's token ids.

    Args:
        parent: key of the previous block of the sequence, None for the first block.
        token_ids: the block's ``block_size`` token ids (each in ``[0, 2**63)``).

    Returns:
        A 32-byte digest; equal digests mean equal prefixes (up to SHA-256 collisions).
    """
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0,
                 parent: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` from block ``start`` on.

    ``parent`` must be the key of block ``start - 1`` (None when ``start`` is 0).
    A trailing partial block gets no key.
    """
    keys = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[begin:begin + block_size])
        keys.append(parent)
    return keys

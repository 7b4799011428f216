"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and extra keys (adapter id,
cache_salt), so equal hashes mean equal prefixes. (Scheme as in vLLM's automatic prefix caching.)
sha256 keeps hashes stable across processes, which the disk tier needs.
"""
from __future__ import annotations

import hashlib
import struct

ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: list[int], extra_keys: tuple = ()) -> int:
    """Hash one full block: (parent_hash, token_ids, extra_keys) -> 64-bit int, stable across processes."""
    h = hashlib.sha256()
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:8], "little")


def extend_block_hashes(
    block_hashes: list[int], token_ids: list[int], block_size: int, extra_keys: tuple = ()
) -> None:
    """Append hashes for every full block of ``token_ids`` not yet hashed (in place, O(new blocks))."""
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for i in range(len(block_hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        block_hashes.append(parent)

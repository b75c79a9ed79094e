"""The pool of KV-cache blocks: reference counts, prefix-cache hashes and LRU eviction.

Every block is in exactly one of two states:

    in use     ref_count > 0, held by one or more requests (shared prefix blocks count each holder)
    free       ref_count == 0, in `free_queue`; it may still carry a hash, and then it is a cached
               block that a new request can take back (a prefix hit) until it is evicted

`free_queue` is ordered oldest first: allocation takes from the front (evicting that block's hash),
freeing appends at the back. A full block's hash chains its parent's hash with its token ids, so a
hash names the whole prefix up to and including that block:

    hash(block i) = hash((hash(block i-1), tokens of block i))     hash(block -1) = salt's

where the salt's hash is None for a request without a cache salt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def salt_hash(salt: str | None) -> int | None:
    """The root of a request's hash chain (the parent of its first block): None without a
    salt, else a hash of the salt, so salted prompts name other blocks than unsalted ones."""
    if salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int | None = None, start_block: int = 0
) -> list[int]:
    """Hash chain of the full blocks of token_ids from block `start_block` on."""
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, count: int) -> list[Block]:
        """The `count` oldest free blocks, in ascending id order: which blocks is the LRU's
        choice, their order is free, and ascending ids make long runs for the KV data planes,
        which read one region per run of blocks consecutive on both sides."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        allocated = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return sorted(allocated, key=lambda block: block.block_id)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the queue in the order given, so
        pass the ones to evict first first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: int) -> None:
        """Record that `block` holds the full prefix named by `block_hash`."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # another block already holds the same tokens
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

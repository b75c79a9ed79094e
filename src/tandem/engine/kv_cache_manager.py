"""Which blocks each request holds, prefix-cache matching, and slot allocation.

A request's blocks cover its computed tokens plus the tokens scheduled this step:

    tokens:  |<---- num_computed_tokens ---->|<-- num_new_tokens -->|
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]   (ceil((computed + new) / block_size) of them)

Prefix matching only considers full blocks and never the request's last token, so a request that
hits entirely still computes one token and gets logits to sample from.
"""

from __future__ import annotations

from tandem.engine.block_pool import Block, BlockPool, hash_full_blocks, salt_hash
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The KV cache slot (block id * block_size + offset) that holds token `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same blocks' ids, kept alongside
        self.req_hashes: dict[str, list[int]] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: read it, do not change it)."""
        return self.req_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """Cached blocks matching the longest prefix of the request (full blocks only, leaving at
        least the last token to compute)."""
        if not self.enable_prefix_caching:
            return []
        token_ids = request.all_token_ids[: request.num_tokens - 1]
        root = salt_hash(request.sampling_params.cache_salt)
        hits: list[Block] = []
        for block_hash in hash_full_blocks(token_ids, self.block_size, root):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens (after computed_blocks, which are prefix hits
        taken now). False, with nothing changed, when there are not enough free blocks."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = cdiv(num_tokens, self.block_size) - len(held) - len(computed_blocks)
        num_revived = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(max(num_needed, 0))
        self.req_blocks.setdefault(request.request_id, []).extend(new_blocks)
        ids = self.req_block_ids.setdefault(request.request_id, [])
        ids.extend(block.block_id for block in new_blocks)
        if computed_blocks:
            self.req_hashes[request.request_id] = [b.block_hash for b in computed_blocks]
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else salt_hash(request.sampling_params.cache_salt)
        token_ids = request.all_token_ids[: num_full * self.block_size]
        new_hashes = hash_full_blocks(token_ids, self.block_size, parent, start_block=len(hashes))
        blocks = self.req_blocks[request.request_id]
        for index, block_hash in enumerate(new_hashes, start=len(hashes)):
            self.pool.cache(blocks[index], block_hash)
        hashes.extend(new_hashes)

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks; its tail goes to the free queue first, so it is
        evicted before the shared prefix."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_block_ids.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        self.pool.free(reversed(blocks))

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

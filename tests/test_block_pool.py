"""BlockPool and KVCacheManager without a model: ref counts, the prefix hash chain, LRU eviction.

Block ids and counts are computed by hand from the documented rules: the pool hands out the
oldest free block first (initially ids 0, 1, 2, ...), freed blocks join the back of the queue, a
request needs ceil(tokens / block_size) blocks, and prefix matching covers full blocks only,
never the request's last token.
"""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool, hash_block_tokens, hash_full_blocks
from tandem.engine.kv_cache_manager import KVCacheManager, cdiv
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=8, cache_salt=cache_salt))


def run_prompt(kv: KVCacheManager, request: Request) -> tuple[int, list[int]]:
    """Schedule the whole uncomputed prompt as a first step would (prefix hits, then slots for the
    rest), mark it computed and cache its full blocks. Returns (tokens hit, block ids)."""
    hits = kv.get_computed_blocks(request)
    num_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return num_hit, kv.block_ids(request.request_id)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (100, 16, 7), (0, 8, 0)],
)
def test_cdiv_counts_blocks(num_tokens, block_size, expected):
    assert cdiv(num_tokens, block_size) == expected


def test_hash_chain_names_the_whole_prefix():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    assert len(hashes) == 2  # 10 tokens hold two full blocks of 4
    first = hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    # The same second block after a different first block hashes differently.
    other = hash_full_blocks([9, 1, 2, 3, 4, 5, 6, 7], BLOCK_SIZE)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    # Continuing a chain from block 1 gives the same tail.
    assert hash_full_blocks(tokens, BLOCK_SIZE, hashes[0], start_block=1) == hashes[1:]


def test_allocate_and_free_track_ref_counts():
    pool = BlockPool(6)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.block_id for b in second] == [2, 3, 4]
    assert pool.num_used_blocks == 5 and pool.num_free_blocks == 1
    pool.touch(first)  # a second holder
    assert [b.ref_count for b in first] == [2, 2]
    pool.free(first)
    assert pool.num_used_blocks == 5  # still held once
    pool.free(first)
    assert pool.num_used_blocks == 3
    # Freed blocks join the back of the queue: 5 (never used), then 0, 1; handed out by id.
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 5]
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)


def test_allocation_takes_the_oldest_free_blocks_in_ascending_ids():
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    pool.free([blocks[i] for i in (6, 2, 7, 3, 5, 4, 1, 0)])  # freed in this order
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 6, 7]  # the four freed first
    assert [b.block_id for b in pool.allocate(4)] == [0, 1, 4, 5]


def test_freeing_more_than_allocated_raises():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free([block])
    assert pool.num_free_blocks == 2


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_request_block_count_follows_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(100, 110)))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(request, 10)
    assert kv.block_ids("r") == [0, 1, 2]
    request.num_computed_tokens = 10
    request.output_token_ids.append(7)
    assert kv.allocate_slots(request, 1)  # token 11 still fits block 2
    assert kv.block_ids("r") == [0, 1, 2]
    request.num_computed_tokens = 11
    request.output_token_ids.append(7)
    assert kv.allocate_slots(request, 1)  # token 12
    request.num_computed_tokens = 12
    request.output_token_ids.append(7)
    assert kv.allocate_slots(request, 1)  # token 13 opens block 3
    assert kv.block_ids("r") == [0, 1, 2, 3]
    kv.free("r")
    assert kv.num_used_blocks == 0


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(13)))  # 13 tokens need 4 blocks
    assert not kv.allocate_slots(request, 13)
    assert kv.block_ids("r") == [] and kv.num_used_blocks == 0
    assert kv.allocate_slots(request, 12)  # a chunk of 12 fits in 3
    assert kv.block_ids("r") == [0, 1, 2]


def test_same_prefix_gets_the_same_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(1, 11))  # 10 tokens: full blocks [1..4] [5..8], partial [9, 10]
    num_hit, first_ids = run_prompt(kv, make_request("a", prompt))
    assert num_hit == 0 and first_ids == [0, 1, 2]

    num_hit, second_ids = run_prompt(kv, make_request("b", prompt))
    assert num_hit == 8  # two full blocks; the partial third is recomputed
    assert second_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.num_prefix_hits == 8 and kv.num_prefix_queries == 20
    assert kv.prefix_hit_rate == pytest.approx(8 / 20)

    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """Prompts of one salt hit each other's blocks (two full ones here), never those of
    another salt nor of unsalted prompts, whose blocks stay theirs."""
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(1, 11))
    hits = [
        run_prompt(kv, make_request(str(index), prompt, salt))[0]
        for index, salt in enumerate(["tenant a", "tenant a", "tenant b", None, None, "tenant b"])
    ]
    assert hits == [0, 8, 0, 0, 8, 8]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_different_block_in_the_middle_breaks_the_chain():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(1, 14))  # 13 tokens, three full blocks
    run_prompt(kv, make_request("a", prompt))
    changed = list(prompt)
    changed[5] = 99  # inside block 1
    num_hit, ids = run_prompt(kv, make_request("b", changed))
    assert num_hit == 4  # block 0 only: block 2 has equal tokens but a different parent
    assert ids == [0, 4, 5, 6]


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    for length, expected_hit in [(9, 8), (8, 4), (4, 0), (1, 0)]:
        prompt = [length * 100 + i for i in range(length)]
        run_prompt(kv, make_request(f"first-{length}", prompt))
        again = make_request(f"again-{length}", prompt)
        hits = kv.get_computed_blocks(again)
        assert len(hits) * BLOCK_SIZE == expected_hit
        assert again.num_tokens - len(hits) * BLOCK_SIZE >= 1


def test_free_cached_blocks_are_taken_back_by_a_prefix_hit():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(1, 10))  # 9 tokens -> blocks 0, 1, 2
    run_prompt(kv, make_request("a", prompt))
    kv.free("a")
    assert kv.num_used_blocks == 0
    # All 4 blocks are free, 0 and 1 still cached; the hit revives them, 2 new tokens need one
    # more block, taken from the front of the queue: 3 (never used) before the freed ones.
    num_hit, ids = run_prompt(kv, make_request("b", prompt))
    assert num_hit == 8 and ids == [0, 1, 3]
    assert kv.num_used_blocks == 3


def test_hit_plus_new_blocks_must_fit_together():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    run_prompt(kv, make_request("a", list(range(1, 10))))  # blocks 0, 1, 2
    kv.free("a")
    other = make_request("b", list(range(1, 9)) + list(range(50, 58)))  # 16 tokens, 4 blocks
    hits = kv.get_computed_blocks(other)
    assert [b.block_id for b in hits] == [0, 1]
    assert not kv.allocate_slots(other, 8, hits)  # 2 revived + 2 new > 3 free
    assert kv.num_used_blocks == 0
    assert [b.ref_count for b in hits] == [0, 0]


def test_lru_evicts_the_oldest_free_block_first():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    old = list(range(1, 5)) + [0]  # 5 tokens: one full block + one partial
    new = list(range(11, 15)) + [0]
    run_prompt(kv, make_request("old", old))  # blocks 0, 1
    run_prompt(kv, make_request("new", new))  # blocks 2, 3
    kv.free("old")  # queue: 1, 0
    kv.free("new")  # queue: 1, 0, 3, 2
    (taken,) = kv.pool.allocate(1)
    assert taken.block_id == 1  # the partial block of "old" (it carries no hash)
    (taken,) = kv.pool.allocate(1)
    assert taken.block_id == 0  # old's cached prefix goes next
    assert kv.get_computed_blocks(make_request("x", old)) == []  # evicted: a miss
    assert [b.block_id for b in kv.get_computed_blocks(make_request("y", new))] == [2]


def test_tail_is_evicted_before_the_shared_prefix():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    shared = list(range(1, 9))  # two full blocks
    run_prompt(kv, make_request("a", shared + [21, 22, 23, 24, 25]))  # 0, 1, 2, 3
    _, b_ids = run_prompt(kv, make_request("b", shared + [31, 32, 33, 34, 35]))
    assert b_ids == [0, 1, 4, 5]
    kv.free("a")  # 3, 2 join the queue; 1 and 0 are still held by b
    kv.free("b")  # then 5, 4, 1, 0
    assert list(kv.pool.free_queue) == [3, 2, 5, 4, 1, 0]
    taken = [b.block_id for b in kv.pool.allocate(4)]
    assert taken == [2, 3, 4, 5]  # the four tails, by id
    # The shared prefix survived every tail.
    probe = make_request("c", shared + [0])
    assert [b.block_id for b in kv.get_computed_blocks(probe)] == [0, 1]
    kv.pool.allocate(1)  # evicts block 1: the chain now ends after block 0
    assert [b.block_id for b in kv.get_computed_blocks(probe)] == [0]


def test_touch_revives_a_free_cached_block():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    prompt = list(range(1, 6))
    run_prompt(kv, make_request("a", prompt))  # blocks 0 (cached), 1
    kv.free("a")
    (cached,) = kv.get_computed_blocks(make_request("probe", prompt))
    assert cached.block_id == 0 and cached.ref_count == 0
    kv.pool.touch([cached])
    assert cached.ref_count == 1 and 0 not in kv.pool.free_queue
    assert sorted(b.block_id for b in kv.pool.allocate(2)) == [1, 2]  # block 0 is not handed out
    assert kv.pool.lookup(cached.block_hash) is cached
    kv.pool.free([cached])
    assert list(kv.pool.free_queue) == [0]


def test_reset_prefix_cache_forgets_every_hash():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(1, 10))
    run_prompt(kv, make_request("a", prompt))
    kv.free("a")
    kv.pool.reset_prefix_cache()
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", prompt)) == []


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    run_prompt(kv, make_request("a", prompt))
    num_hit, ids = run_prompt(kv, make_request("b", prompt))
    assert num_hit == 0 and ids == [3, 4, 5]
    assert kv.pool.cached == {}


def test_duplicate_content_is_cached_once():
    """Two requests computing the same prompt at once: the first to finish its blocks owns the
    hash, the other's copies stay unnamed and are never returned by a lookup."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(1, 10))
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert kv.allocate_slots(a, 9) and kv.allocate_slots(b, 9)  # nothing cached yet: no hits
    for request in (a, b):
        request.num_computed_tokens = 9
        kv.cache_computed_blocks(request)
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == [3, 4, 5]
    hits = kv.get_computed_blocks(make_request("c", prompt))
    assert [block.block_id for block in hits] == [0, 1]
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0
    assert sorted(kv.pool.cached.values(), key=lambda block: block.block_id) == hits

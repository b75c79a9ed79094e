"""How a decoder is split over the ranks of a tensor-parallel group, and which sizes can be.

    query heads        num_heads / size per rank, rank r's from r * that
    KV heads           num_kv_heads >= size: num_kv_heads / size per rank, rank r's from r * that
                       num_kv_heads <  size: one per rank, each held by size / num_kv_heads ranks
                       (vLLM's replication): rank r holds head r // (size / num_kv_heads)
    MLP rows           intermediate_size / size per rank
    vocabulary rows    ceil(vocab_size / size) per rank, the last rank's padded (zero rows)
    experts            each expert's MLP rows / size per rank, every rank holding every expert;
                       with expert parallelism whole experts instead: num_experts / size per
                       rank, rank r's from r * that

    size 2, 4 query heads, 1 KV head:   rank 0: q heads 0-1, kv head 0
                                        rank 1: q heads 2-3, kv head 0 (a replica)

`check_tensor_parallel` refuses a model that cannot be split so, in one sentence.
"""

from __future__ import annotations

from typing import NamedTuple

from tandem.models.config import ModelConfig


class HeadRange(NamedTuple):
    """Items [start, start + count) of a split dimension (heads, rows)."""

    start: int
    count: int


def even_part(total: int, rank: int, size: int) -> HeadRange:
    """Rank `rank`'s part of `total` items split evenly (total divisible by size)."""
    count = total // size
    return HeadRange(rank * count, count)


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> HeadRange:
    if num_kv_heads >= size:
        return even_part(num_kv_heads, rank, size)
    return HeadRange(rank // (size // num_kv_heads), 1)


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def check_tensor_parallel(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError, in one sentence, when the model cannot be split over `size` ranks (its
    experts whole, with `expert_parallel`)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, not {size}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's {heads} attention "
            "heads: use a size that does"
        )
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {size} neither divides the model's {kv_heads} KV heads nor "
            "is a multiple of them: use a size that does either"
        )
    if config.has_dense_mlp and config.intermediate_size % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's MLP size "
            f"{config.intermediate_size}: use a size that does"
        )
    moe = config.moe
    if moe is None:
        return
    if expert_parallel and moe.num_experts % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's {moe.num_experts} "
            "experts, which --enable-expert-parallel places whole on the ranks: use a size "
            "that does"
        )
    if not expert_parallel and moe.intermediate_size % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the model's expert MLP size "
            f"{moe.intermediate_size}: use a size that does, or --enable-expert-parallel"
        )

"""The Triton attention backend against the torch reference backend.

CPU: the kernels run under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is imported. So that the switch never leaks into other test modules, one subprocess
runs this file as a script: it runs every case in INTERPRETER_CASES and prints one JSON object of
results, and the parametrised tests below assert on it. Interpreter shapes are tiny and tiles are
16 wide so that every case spans several query tiles, key tiles and decode splits. The
interpreter computes bfloat16 dots wrongly (it multiplies the raw bits), so bfloat16 runs only in
the CUDA tests; the interpreter covers float32 and float16.

CUDA (marker `cuda`, skipped without a GPU): bfloat16 at real model shapes (Qwen3-0.6B 16/8 heads,
Llama-3.1-8B 32/8 heads, head_dim 128), compared with the torch backend run in float32 on the same
inputs, sequence by sequence and in query chunks to bound its memory.

Every case draws random block tables (shuffled, non-contiguous block ids, partial last blocks)
and poisons the blocks no sequence owns with NaN, so a read outside a sequence's context shows.
Error measure: ||out - ref|| / ||ref|| over the whole output, and the worst per-(token, head) row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tandem.attention.base import AttentionMetadata, get_backend
from tandem.attention.torch_backend import TorchAttentionBackend

store_kv = TorchAttentionBackend().store_kv  # the reference cache store
SRC_DIR = Path(__file__).resolve().parents[1] / "src"
FP32_TOLERANCE = 1e-4  # interpreter dots are exact fp32 products: observed errors are ~1e-7
HALF_TOLERANCE = 1e-2  # interpreter cases in float16 / bfloat16 against the same-dtype reference
BF16_TOLERANCE = 2e-2  # CUDA, bf16 kernel against the fp32 reference (whole output)
BF16_ROW_TOLERANCE = 5e-2  # CUDA, worst single (token, head) row
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One batch: for each sequence, `cached` tokens already in the cache and `new` query tokens."""

    cached: tuple[int, ...]
    new: tuple[int, ...]
    num_kv_heads: int
    group: int  # query heads per kv head
    head_dim: int
    block_size: int
    dtype: str = "float32"
    fused_qkv: bool = False  # q, k, v as strided views of one [T, (H + 2 KVH) * D] tensor
    dropped_slots: int = 0  # new tokens whose slot is -1 (not stored)
    launch_max_seq_len: int = 0  # metadata.max_seq_len above every context, as a CUDA graph has
    config: tuple[tuple[str, int], ...] = ()  # TritonAttentionConfig overrides


SMALL_TILES = (("prefill_block_m", 16), ("prefill_block_n", 16), ("decode_block_n", 16))
FORCE_SPLITS = SMALL_TILES + (("decode_min_keys_per_split", 16),)

INTERPRETER_CASES = {
    "prefill_with_prefix_gqa3": Case(
        cached=(27, 0, 48), new=(13, 80, 9), num_kv_heads=2, group=3, head_dim=64,
        block_size=16, config=SMALL_TILES,
    ),
    "mixed_gqa4_block32_dropped_slot": Case(
        cached=(29, 0, 54, 16, 6), new=(1, 17, 1, 16, 1), num_kv_heads=2, group=4, head_dim=32,
        block_size=32, dropped_slots=2, config=SMALL_TILES,
    ),
    "prefill_gqa1_tiles_span_pages_fused_qkv": Case(
        cached=(40, 3), new=(20, 5), num_kv_heads=3, group=1, head_dim=64, block_size=16,
        fused_qkv=True, config=(("prefill_block_m", 32), ("prefill_block_n", 32)),
    ),
    "decode_split_gqa4": Case(
        cached=(69, 4, 32, 127), new=(1, 1, 1, 1), num_kv_heads=2, group=4, head_dim=64,
        block_size=16, config=FORCE_SPLITS,
    ),
    "decode_split_gqa3_fused_qkv": Case(
        cached=(50, 17), new=(1, 1), num_kv_heads=1, group=3, head_dim=32, block_size=32,
        fused_qkv=True, config=FORCE_SPLITS,
    ),
    "decode_one_split_gqa1": Case(
        cached=(33, 8, 15), new=(1, 1, 1), num_kv_heads=2, group=1, head_dim=64, block_size=16,
        config=SMALL_TILES,
    ),
    "decode_short_contexts_long_launch": Case(
        cached=(3, 40, 100), new=(1, 1, 1), num_kv_heads=2, group=4, head_dim=32, block_size=16,
        launch_max_seq_len=4096, config=SMALL_TILES,
    ),
    "prefill_float16": Case(
        cached=(20, 0), new=(11, 6), num_kv_heads=2, group=2, head_dim=32, block_size=16,
        dtype="float16", config=SMALL_TILES,
    ),
    "decode_float16": Case(
        cached=(40, 9), new=(1, 1), num_kv_heads=2, group=2, head_dim=32, block_size=16,
        dtype="float16", config=FORCE_SPLITS,
    ),
}  # fmt: skip


def make_batch(case: Case, device: str | torch.device, seed: int) -> tuple:
    """Random q, k, v, caches and metadata for `case`; blocks no sequence owns hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    block_size = case.block_size
    seq_lens = [c + n for c, n in zip(case.cached, case.new, strict=True)]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # block 0 pads the tables; 3 spare blocks
    free_block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, query_start_loc = [], [0]
    for seq, (cached, new) in enumerate(zip(case.cached, case.new, strict=True)):
        block_ids = [free_block_ids.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(block_ids)] = torch.tensor(block_ids)
        positions = range(cached, cached + new)
        slots += [block_ids[p // block_size] * block_size + p % block_size for p in positions]
        query_start_loc.append(query_start_loc[-1] + new)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    if case.dropped_slots:
        dropped = torch.randperm(len(slots), generator=generator)[: case.dropped_slots]
        slot_mapping[dropped] = -1

    cache_shape = (num_blocks, block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(cache_shape, generator=generator)
    v_cache = torch.randn(cache_shape, generator=generator)
    k_cache[free_block_ids] = float("nan")
    v_cache[free_block_ids] = float("nan")

    num_tokens = query_start_loc[-1]
    num_heads = case.num_kv_heads * case.group
    q_size, kv_size = num_heads * case.head_dim, case.num_kv_heads * case.head_dim
    if case.fused_qkv:
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator)
        q, k, v = qkv.to(device=device, dtype=dtype).split([q_size, kv_size, kv_size], dim=-1)
    else:
        q, k, v = (
            torch.randn(num_tokens, size, generator=generator).to(device=device, dtype=dtype)
            for size in (q_size, kv_size, kv_size)
        )
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(case.new),
        max_seq_len=max(case.launch_max_seq_len, *seq_lens),
    )
    return (
        q.view(num_tokens, num_heads, case.head_dim),
        k.view(num_tokens, case.num_kv_heads, case.head_dim),
        v.view(num_tokens, case.num_kv_heads, case.head_dim),
        k_cache.to(device=device, dtype=dtype),
        v_cache.to(device=device, dtype=dtype),
        metadata,
    )


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """||out - ref|| / ||ref|| over everything, and the worst over (token, head) rows."""
    diff, ref = (out.float() - ref.float()), ref.float()
    whole = (diff.norm() / ref.norm()).item()
    rows = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()
    return whole, rows


def run_interpreter_case(case: Case, seed: int) -> dict:
    """Both backends on copies of one random batch; runs only in the interpreter subprocess."""
    from tandem.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    q, k, v, k_cache, v_cache, metadata = make_batch(case, "cpu", seed)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    backend = TritonAttentionBackend(TritonAttentionConfig(**dict(case.config)))
    scale = case.head_dim**-0.5
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, scale)
    again = backend.attend(q, k_cache, v_cache, metadata, scale)
    exact = replace(metadata, max_seq_len=int(metadata.seq_lens.max()))  # the reference's bound
    ref = TorchAttentionBackend().forward(q, k, v, ref_k_cache, ref_v_cache, exact, scale)
    whole, rows = relative_errors(out, ref)
    splits = backend.num_decode_splits(metadata, case.num_kv_heads, q.device)
    return {
        "error": whole,
        "row_error": rows,
        "finite": bool(out.isfinite().all()),
        "k_cache_equal": torch.equal(k_cache.nan_to_num(), ref_k_cache.nan_to_num()),
        "v_cache_equal": torch.equal(v_cache.nan_to_num(), ref_v_cache.nan_to_num()),
        "decode_splits": splits if metadata.is_decode_only else 0,
        "repeatable": split_counters_reset(backend, q.device) and torch.equal(out, again),
    }


def split_counters_reset(backend, device) -> bool:
    """The decode kernel's split counters are all back at 0 (the next launch counts from 0)."""
    return not bool(backend._split_counters(0, device).any())


def _run_interpreter_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from triton_interpreter import patch_interpreter_index

    patch_interpreter_index()
    cases = enumerate(INTERPRETER_CASES.items())
    results = {name: run_interpreter_case(case, seed) for seed, (name, case) in cases}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--interpreter-cases"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", INTERPRETER_CASES)
def test_interpreter_matches_torch_reference(interpreter_results: dict, name: str) -> None:
    case, result = INTERPRETER_CASES[name], interpreter_results[name]
    tolerance = FP32_TOLERANCE if case.dtype == "float32" else HALF_TOLERANCE
    assert result["finite"], result
    assert result["error"] < tolerance, result
    assert result["row_error"] < 10 * tolerance, result
    assert result["k_cache_equal"] and result["v_cache_equal"], result
    assert result["repeatable"], result


def test_interpreter_cases_cover_split_and_single_split_decode(interpreter_results: dict) -> None:
    assert interpreter_results["decode_split_gqa4"]["decode_splits"] >= 4
    assert interpreter_results["decode_split_gqa3_fused_qkv"]["decode_splits"] >= 2
    assert interpreter_results["decode_one_split_gqa1"]["decode_splits"] == 1
    assert interpreter_results["decode_short_contexts_long_launch"]["decode_splits"] >= 4


def test_registry_returns_triton_backend() -> None:
    pytest.importorskip("triton")
    backend = get_backend("triton")
    assert backend.name == "triton"


@pytest.mark.parametrize("head_dim", [48, 8, 512])
def test_rejects_unsupported_head_dim(head_dim: int) -> None:
    pytest.importorskip("triton")
    q = torch.zeros(1, 2, head_dim)
    k = torch.zeros(1, 2, head_dim)
    cache = torch.zeros(2, 16, 2, head_dim)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
    )
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        get_backend("triton").forward(q, k, k, cache, cache.clone(), metadata, 1.0)


# ---------------------------------------------------------------------------------------------
# CUDA: bf16 at real shapes.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QWEN3_0_6B = {"num_kv_heads": 8, "group": 2, "head_dim": 128}  # 16 heads / 8 kv heads
LLAMA_3_1_8B = {"num_kv_heads": 8, "group": 4, "head_dim": 128}  # 32 heads / 8 kv heads
SMOLLM2_135M = {"num_kv_heads": 3, "group": 3, "head_dim": 64}  # 9 heads / 3 kv heads
MODEL_SHAPES = pytest.mark.parametrize(
    "shape", [QWEN3_0_6B, LLAMA_3_1_8B], ids=["qwen3-0.6b", "llama-3.1-8b"]
)


def float32_reference(q, k, v, k_cache, v_cache, metadata, scale, max_chunk: int = 1024):
    """The torch backend in float32, one sequence and at most `max_chunk` queries at a time.

    A chunk of queries [i0, i1) of sequence b is itself a valid batch: the same block table row,
    seq_len truncated to the chunk's last position + 1, nothing to store (the float32 caches get
    every new token first).
    """
    ref_k_cache, ref_v_cache = k_cache.float(), v_cache.float()
    store_kv(k.float(), v.float(), ref_k_cache, ref_v_cache, metadata.slot_mapping)
    backend = TorchAttentionBackend()
    out = torch.empty_like(q, dtype=torch.float32)
    starts = metadata.query_start_loc.tolist()
    for seq, seq_len in enumerate(metadata.seq_lens.tolist()):
        query_len = starts[seq + 1] - starts[seq]
        for first in range(0, query_len, max_chunk):
            last = min(first + max_chunk, query_len)
            tokens = slice(starts[seq] + first, starts[seq] + last)
            chunk_seq_len = seq_len - query_len + last
            chunk = AttentionMetadata(
                slot_mapping=torch.full((last - first,), -1, device=q.device),
                query_start_loc=torch.tensor([0, last - first], dtype=torch.int32, device=q.device),
                seq_lens=torch.tensor([chunk_seq_len], dtype=torch.int32, device=q.device),
                block_tables=metadata.block_tables[seq : seq + 1],
                max_query_len=last - first,
                max_seq_len=chunk_seq_len,
            )
            out[tokens] = backend.forward(
                q[tokens].float(), k[tokens].float(), v[tokens].float(),
                ref_k_cache, ref_v_cache, chunk, scale,
            )  # fmt: skip
    return out


def check_on_cuda(case: Case, seed: int = 0, **config: int) -> int:
    """Run `case` with the Triton backend on the GPU and assert it matches the float32 reference
    and the reference's cache store; returns the number of decode splits it used."""
    from tandem.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    q, k, v, k_cache, v_cache, metadata = make_batch(case, "cuda", seed)
    scale = case.head_dim**-0.5
    ref_out = float32_reference(q, k, v, k_cache, v_cache, metadata, scale)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k_cache, ref_v_cache, metadata.slot_mapping)
    backend = TritonAttentionBackend(TritonAttentionConfig(**config))
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, scale)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and out.shape == q.shape
    assert bool(out.isfinite().all()), "non-finite output: a read outside the context?"
    whole, rows = relative_errors(out, ref_out)
    exact = case.dtype == "float32"
    assert whole < (10 * FP32_TOLERANCE if exact else BF16_TOLERANCE), (whole, rows)
    assert rows < (100 * FP32_TOLERANCE if exact else BF16_ROW_TOLERANCE), (whole, rows)
    assert torch.equal(k_cache.nan_to_num(), ref_k_cache.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), ref_v_cache.nan_to_num())
    assert torch.equal(backend.attend(q, k_cache, v_cache, metadata, scale), out)
    assert split_counters_reset(backend, q.device)
    return backend.num_decode_splits(metadata, case.num_kv_heads, q.device)


def random_lengths(count: int, low: int, high: int, seed: int) -> tuple[int, ...]:
    """`count` lengths uniform in [low, high], the first one exactly `high`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    lengths[0] = high
    return tuple(lengths)


@pytest.mark.cuda
@needs_cuda
@MODEL_SHAPES
@pytest.mark.parametrize("block_size", [16, 64])
def test_cuda_decode_batch64_contexts_up_to_8k(shape: dict, block_size: int) -> None:
    cached = random_lengths(64, 0, 8191, seed=block_size)
    check_on_cuda(Case(cached, (1,) * 64, block_size=block_size, dtype="bfloat16", **shape))


@pytest.mark.cuda
@needs_cuda
@MODEL_SHAPES
def test_cuda_decode_few_long_contexts_use_splits(shape: dict) -> None:
    case = Case((8191, 3000, 17, 6000), (1,) * 4, block_size=16, dtype="bfloat16", **shape)
    assert check_on_cuda(case) > 1


@pytest.mark.cuda
@needs_cuda
@MODEL_SHAPES
@pytest.mark.parametrize("prefix", [0, 3000], ids=["no-prefix", "prefix-3000"])
def test_cuda_prefill_8192_tokens(shape: dict, prefix: int) -> None:
    check_on_cuda(Case((prefix,), (8192,), block_size=16, dtype="bfloat16", **shape))


@pytest.mark.cuda
@needs_cuda
@MODEL_SHAPES
def test_cuda_mixed_prefill_chunks_prefix_hits_and_decodes(shape: dict) -> None:
    decodes = random_lengths(32, 1, 4000, seed=1)
    case = Case(
        cached=(0, 1000, 5000, 200) + decodes,
        new=(700, 300, 513, 2048) + (1,) * 32,
        block_size=16,
        dtype="bfloat16",
        dropped_slots=3,
        **shape,
    )
    check_on_cuda(case)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "shape",
    [SMOLLM2_135M, {"num_kv_heads": 2, "group": 4, "head_dim": 256}],
    ids=["smollm2-135m", "head-dim-256"],
)
def test_cuda_other_dtypes_and_head_dims(dtype: str, shape: dict) -> None:
    prefill = Case((0, 300, 40), (600, 129, 1), block_size=32, dtype=dtype, fused_qkv=True, **shape)
    check_on_cuda(prefill)
    decode = Case((2000, 50, 999), (1, 1, 1), block_size=32, dtype=dtype, fused_qkv=True, **shape)
    assert check_on_cuda(decode) > 1


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-cases"]:
    _run_interpreter_cases()

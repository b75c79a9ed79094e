"""The Triton kernel of MLA's absorbed decode (`tandem.attention.triton_mla`) against the torch
path (`latent_attention` over the gathered latents).

* CPU, through Triton's interpreter (one subprocess, float32): 1 and 5 sequences of 1 to 300
  tokens in scattered 16-token blocks, 1, 4 and 16 heads, a 64 + 16 latent (and one 512 + 64
  case), with one split, the default count and more splits than the context fills; the output
  is poisoned first, so a row the kernel leaves unwritten fails.
* GPU (cuda): the same cases in float32; DeepSeek-V2-Lite's shape (16 heads, 512 + 64) in
  bfloat16 against the torch path in float32 on the same bfloat16 values (so the tolerance
  covers the kernel's rounding alone), contexts up to 5000 tokens, which the default launch
  splits; and tiny DeepSeek checkpoints' greedy decode on CUDA (the kernel in every decode
  step) equal to the CPU engine's tokens.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from triton_interpreter import run_in_interpreter

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tandem.attention.base import AttentionMetadata
    from tandem.attention.triton_mla import mla_decode, num_splits
    from tandem.models.layers.mla import gather_latents, latent_attention

    def decode_batch(context_lens, block_size, generator, device):
        '''One query token per sequence; every sequence's blocks drawn at random from a pool
        twice the size needed (tables padded with 0, as the engine's are).'''
        blocks = [-(-n // block_size) for n in context_lens]
        pool = torch.randperm(2 * sum(blocks) + 1, generator=generator)
        tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32)
        taken = 0
        for seq, count in enumerate(blocks):
            tables[seq, :count] = pool[taken : taken + count]
            taken += count
        metadata = AttentionMetadata(
            slot_mapping=torch.zeros(len(context_lens), dtype=torch.int64, device=device),
            query_start_loc=torch.arange(len(context_lens) + 1, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            max_query_len=1,
            max_seq_len=max(context_lens),
        )
        return metadata, len(pool)

    @torch.inference_mode()
    def check(context_lens, heads, latent, rope, splits, device, dtype, atol):
        generator = torch.Generator().manual_seed(len(context_lens) * 1000 + heads + latent)
        metadata, num_blocks = decode_batch(context_lens, 16, generator, device)
        width = latent + rope
        cache = torch.randn(2, num_blocks, 16, 1, width // 2, generator=generator).to(device, dtype)
        q = torch.randn(len(context_lens), heads, width, generator=generator).to(device, dtype)
        scale = 0.3
        out = torch.full((len(context_lens), heads, latent), float("nan"), device=device,
                         dtype=dtype)
        mla_decode(q, cache, metadata, scale, latent, splits=splits, out=out)
        latents = gather_latents(cache.float(), metadata)  # the torch path in float32
        expected = latent_attention(q.float(), latents, metadata, scale, latent).to(dtype)
        case = (context_lens, heads, latent, rope, splits)
        torch.testing.assert_close(out, expected, atol=atol, rtol=atol,
                                   msg=lambda message: f"{case}: {message}")
        return num_splits(metadata, heads, q.device)

    def check_store(device, dtype):
        '''store_latents' kernel against the torch store: latents of 300 tokens into scattered
        slots, a third of them -1 (stored nowhere), into a poisoned cache.'''
        from tandem.attention.triton_mla import store_latents as store_kernel
        from tandem.models.layers.mla import store_latents

        generator = torch.Generator().manual_seed(5)
        for width in (80, 576):
            slots = torch.randperm(64 * 16, generator=generator)[:300]
            slots[torch.rand(300, generator=generator) < 0.33] = -1
            latents = torch.randn(300, width, generator=generator).to(device, dtype)
            cache = torch.randn(2, 64, 16, 1, width // 2, generator=generator).to(device, dtype)
            expected = cache.clone()
            store_latents(expected, latents, slots.to(device))
            store_kernel(cache, latents, slots.to(device))
            assert torch.equal(cache, expected), width

    def run(device, dtype, atol):
        check_store(device, dtype)
        for heads in (1, 4, 16):
            for lens in ([1], [15], [16], [17], [100], [17, 1, 100, 16, 15]):
                for splits in (1, 4):
                    check(lens, heads, 64, 16, splits, device, dtype, atol)
            assert check([300, 40], heads, 64, 16, None, device, dtype, atol) > 1
        check([20, 3], 2, 512, 64, None, device, dtype, atol)
        check([20, 3], 2, 512, 64, 2, device, dtype, atol)
    """
)


def test_mla_decode_kernel_matches_torch_in_the_interpreter():
    result = run_in_interpreter(CHECK + "\nrun('cpu', torch.float32, 1e-5)\n")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
def test_mla_decode_kernel_matches_torch_on_gpu():
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["run"]("cuda", torch.float32, 1e-5)
    check = namespace["check"]
    for lens in ([1], [4096], [1000, 17, 4096, 1, 300, 2048, 64, 5000]):
        check(lens, 16, 512, 64, None, "cuda", torch.bfloat16, 2e-2)  # DeepSeek-V2-Lite


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["deepseek-v2-lite", "deepseek-v3"])
def test_greedy_decode_on_cuda_matches_the_cpu_engine(shape, tmp_path):
    from tandem import LLM, SamplingParams
    from tandem.models.layers.mla import paged_kernels
    from tiny_models import make_checkpoint, varied_prompts

    assert paged_kernels() is not None
    directory = str(make_checkpoint(shape, tmp_path / shape))
    prompts = varied_prompts(seed=41)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(directory, device=device, dtype="float32", num_kv_blocks=512, block_size=8)
        try:
            if device == "cuda":  # the fused kernels, decode steps replayed from CUDA graphs
                assert llm.core.executor.runner.decode_graphs is not None
            outputs = llm.generate(prompts, greedy)
            tokens[device] = [output.outputs[0].token_ids for output in outputs]
        finally:
            llm.core.shutdown()
    assert tokens["cuda"] == tokens["cpu"]

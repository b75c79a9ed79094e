"""The fused Triton kernels against the model's torch reference: on CPU through Triton's
interpreter (in a subprocess, so the setting does not leak), and on a GPU in bfloat16."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from triton_interpreter import run_in_interpreter

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tandem.models import triton_ops as T
    from tandem.models.config import ModelConfig
    from tandem.attention.torch_backend import TorchAttentionBackend
    from tandem.models.layers.norm import RMSNorm
    from tandem.models.layers.rotary import RotaryEmbedding, apply_rotary

    @torch.inference_mode()
    def run(device, dtype, atol):
        torch.manual_seed(0)
        x = torch.randn(7, 96, device=device, dtype=dtype)
        residual = torch.randn_like(x)
        norm = RMSNorm(96, 1e-6).to(device=device, dtype=dtype)
        norm.weight.data.normal_()
        torch.testing.assert_close(T.rms_norm(x, norm.weight, 1e-6), norm(x), atol=atol, rtol=atol)
        updated = residual.clone()
        out = T.add_rms_norm(x, updated, norm.weight, 1e-6)
        expected_out, expected_residual = norm.add_forward(x, residual.clone())
        torch.testing.assert_close(updated, expected_residual, atol=atol, rtol=atol)
        torch.testing.assert_close(out, expected_out, atol=atol, rtol=atol)

        config = ModelConfig.from_hf(dict(
            vocab_size=8, hidden_size=96, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0))
        rotary = RotaryEmbedding(config).to(device)
        positions = torch.tensor([0, 1, 5, 17, 100, 1000, 4095], device=device)
        slots = torch.tensor([3, 0, -1, 9, 14, 4, 7], device=device)  # -1: not stored
        q_norm, k_norm = RMSNorm(16, 1e-6).to(device, dtype), RMSNorm(16, 1e-6).to(device, dtype)
        q_norm.weight.data.normal_()
        k_norm.weight.data.normal_()
        for with_norm in (False, True):
            qkv = torch.randn(7, (6 + 2 + 2) * 16, device=device, dtype=dtype)
            q, k, v = (part.reshape(7, -1, 16) for part in qkv.split([96, 32, 32], dim=-1))
            if with_norm:
                q, k = q_norm(q), k_norm(k)
            cos_sin = rotary.cos_sin(positions)
            expected_q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
            caches = torch.randn(2, 4, 4, 2, 16, device=device, dtype=dtype)  # 4 blocks of 4
            expected_caches = caches.clone()
            TorchAttentionBackend().store_kv(k, v, expected_caches[0], expected_caches[1], slots)
            norm = (q_norm.weight, k_norm.weight, 1e-6) if with_norm else None
            out = T.qk_norm_rotary_store(
                qkv, 6, 2, positions, rotary.inv_freq, norm, caches[0], caches[1], slots)
            torch.testing.assert_close(out, expected_q, atol=atol, rtol=atol)
            assert out.data_ptr() == qkv.data_ptr()  # rotated in place
            torch.testing.assert_close(caches, expected_caches, atol=atol, rtol=atol)

        for rows, n, k, bias in ((1, 64, 512, False), (3, 50, 300, True), (4, 36, 2048, True)):
            x = torch.randn(rows, k, device=device, dtype=dtype)
            weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            b = torch.randn(n, device=device, dtype=dtype) if bias else None
            expected = torch.nn.functional.linear(x.float(), weight.float(),
                                                  None if b is None else b.float()).to(dtype)
            torch.testing.assert_close(T.small_batch_linear(x, weight, b), expected,
                                       atol=atol, rtol=atol)

        gate_up = torch.randn(7, 2 * 3000, device=device, dtype=dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(T.silu_and_mul(gate_up), expected, atol=atol, rtol=atol)
    """
)


def test_fused_kernels_match_torch_in_the_interpreter():
    result = run_in_interpreter(CHECK + "\nrun('cpu', torch.float32, 1e-5)\n")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
def test_fused_kernels_match_torch_on_gpu():
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["run"]("cuda", torch.float32, 1e-5)
    namespace["run"]("cuda", torch.bfloat16, 2e-2)


FUSED_SUM_RANKS = textwrap.dedent(
    """
    import multiprocessing
    import torch
    torch.set_num_threads(1)  # before the fork: no thread pool for the children to inherit
    from tandem.distributed import fused_all_reduce as F
    from tandem.models.triton_ops import add_rms_norm

    PROGRAMS = 8  # the engine's 128 take longer in the interpreter and run the same code
    WIDTH, MOST_ROWS = 64, 2 * PROGRAMS + 5
    # up to three rows a program, one row, none, two for the first program: both slot sets twice
    ROWS = [MOST_ROWS, 1, 0, PROGRAMS + 1]
    _, BITS, EMPTY = F.BITS[2]

    def inputs(rank, call, rows, first=-0.0):
        # a rank's rows, the first element `first` (negative zero is EMPTY's bits: it goes as a
        # positive zero), and the residual, the same on every rank. The rows are eighths up to
        # 4, so that their sum over four ranks is a bf16 number: the interpreter rounds fp32 to
        # bf16 otherwise than torch, and the kernel's rounding of the sum is the GPU test's
        generator = torch.Generator().manual_seed(100 * call + rank)
        x = torch.randint(-32, 33, (rows, WIDTH), generator=generator) / 8
        residual = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(call))
        x = x.bfloat16()
        if rows:
            x[0, 0] = first
        return x, residual.bfloat16()

    def run_rank(rank, size, buffers, weight, results):
        calls = torch.zeros(PROGRAMS, dtype=torch.int64)
        got = []
        for call, rows in enumerate(ROWS):
            x, residual = inputs(rank, call, rows)
            out = torch.empty_like(x)
            F._all_reduce_add_rms_norm_kernel[(PROGRAMS,)](
                buffers, calls, x, residual, weight, out, rows, WIDTH, WIDTH, WIDTH, 1e-5, rank,
                MOST_ROWS * WIDTH, RANKS=size, RANKS_POW2=size, PROGRAMS=PROGRAMS, BITS=BITS,
                EMPTY=EMPTY, BLOCK=WIDTH, USE_PDL=False)
            got.append((out.float().numpy(), residual.float().numpy()))
        results.put((rank, got, calls.tolist()))

    for size in (2, 4):
        # every rank's buffer in one block of shared memory that the forked ranks map at the
        # same address, so the addresses of each rank's buffer hold in all of them
        shared = torch.full((size, 2 * size * MOST_ROWS * WIDTH), EMPTY, dtype=torch.int16)
        shared.share_memory_()
        buffers = torch.tensor([part.data_ptr() for part in shared], dtype=torch.int64)
        weight = torch.rand(WIDTH, generator=torch.Generator().manual_seed(7)).bfloat16()
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        # daemons: a rank left waiting on a failed peer ends with this script
        ranks = [context.Process(target=run_rank, args=(rank, size, buffers, weight, results),
                                 daemon=True) for rank in range(size)]
        for process in ranks:
            process.start()
        by_rank = {rank: (got, calls) for rank, got, calls in
                   (results.get(timeout=240) for _ in ranks)}
        for process in ranks:
            process.join(30)
            assert process.exitcode == 0, (size, process.exitcode)
        for call, rows in enumerate(ROWS):
            parts = [inputs(rank, call, rows, first=0.0)[0] for rank in range(size)]
            summed = torch.stack(parts).float().sum(0).bfloat16()  # exact: eighths
            expected_residual = inputs(0, call, rows)[1]
            expected = add_rms_norm(summed, expected_residual, weight, 1e-5)
            for rank, (got, _) in by_rank.items():
                out, residual = (torch.from_numpy(t).bfloat16() for t in got[call])
                assert torch.equal(residual, expected_residual), (size, rank, call)
                assert torch.equal(out, expected), (size, rank, call)
        for rank, (_, calls) in by_rank.items():
            assert calls == [len(ROWS)] * PROGRAMS, (size, rank)
        assert (shared == EMPTY).all(), size  # every slot read was emptied
    """
)


def test_fused_sum_kernel_on_two_and_four_ranks_in_the_interpreter():
    """The fused sum, add and norm's kernel on two and then four ranks, each a process running
    it in the interpreter, the ranks' buffers in shared host memory: every rank gets the numbers
    of add_rms_norm on the inputs' sum (exact here; the interpreter's rounding of the residual
    add on both sides), a negative zero sent as a zero, programs with several rows, one and
    none, both slot sets twice, and every slot EMPTY again at the end. The interpreter runs a
    rank's programs one after another, so this cannot show why two slot sets are needed (a
    peer's next rows landing before a slot was emptied); on GPUs over peer memory, with the sum
    rounded once in rank order: test_tensor_parallel_cuda.py."""
    result = run_in_interpreter(FUSED_SUM_RANKS)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_fused_sums_call_count_is_one_atomic_for_the_whole_program():
    """Compiled for an H100/H200 (sm_90, no GPU needed): the program's call count, whose parity
    picks the slot set, is raised by one atomic whose value every warp then reads from shared
    memory. It was a load by every thread and a store by one: a warp that loaded after the
    store took the other slot set for its part of the row, and the ranks waited on each other
    for ever (seen on four H200s: half of a row in each set, docs/benchmarks.md). The
    interpreter runs a program as one thread, so only the compiled code shows this."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from tandem.distributed import fused_all_reduce as F

    kernel = F._all_reduce_add_rms_norm_kernel
    pointers = {"buffers_ptr": "*i64", "calls_ptr": "*i64", "x_ptr": "*bf16",
                "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip
    _, bits, empty = F.BITS[2]
    constants = {"RANKS": 4, "RANKS_POW2": 4, "PROGRAMS": F.PROGRAMS, "BITS": bits,
                 "EMPTY": empty, "BLOCK": 4096, "USE_PDL": True}  # fmt: skip
    signature = {
        name: pointers.get(name) or ("constexpr" if name in constants else "fp32" if name == "eps"
                                     else "i32")
        for name in kernel.arg_names
    }  # fmt: skip
    source = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()},
    )  # fmt: skip
    ptx = compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    atomics = re.findall(r"^\s*(@%p\d+ )?atom\.global\.[\w.]*add\.u64 ", ptx, re.MULTILINE)
    assert len(atomics) == 1, atomics
    assert atomics[0], "every thread makes the atomic, not one"
    assert "st.global.b64" not in ptx  # the count is not stored apart from the atomic

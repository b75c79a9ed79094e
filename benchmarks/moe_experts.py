"""The experts of one mixture-of-experts layer on a GPU: the Triton grouped GEMM
(`tandem.models.fused_moe`) against the torch path (`experts_reference`, one product per
expert), in real shapes with random weights and routing, against the rooflines.

    python benchmarks/moe_experts.py [--tokens 1 64 512 8192] [--shapes qwen3-30b-a3b mixtral-8x7b]

Per shape and token count: both paths' time (CUDA events, median of 20 after warm-up), the
largest difference between them, the bytes of the active experts' weights over the time (the
decode roofline: each active expert's weights read once) and the matrix rate (2 * pairs *
hidden * 3 * rows FLOP over the time).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tandem.models import fused_moe
from tandem.models.layers.moe import experts_reference

# name -> (experts, top-k, hidden, expert rows); Mixtral's 8 experts of 14336 rows take 2.8 GB
# a layer in bfloat16, Qwen3-30B-A3B's 128 of 768 rows 1.2 GB
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of fn() on the GPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print("| shape | tokens | torch path (ms) | Triton (ms) | speed-up | max abs diff "
          "| weight GB/s | TFLOP/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        num_experts, top_k, hidden, rows = SHAPES[name]
        generator = torch.Generator(device).manual_seed(0)
        gate_up = torch.randn(num_experts, 2 * rows, hidden, device=device, dtype=dtype,
                              generator=generator) * hidden**-0.5  # fmt: skip
        down = torch.randn(num_experts, hidden, rows, device=device, dtype=dtype,
                           generator=generator) * rows**-0.5  # fmt: skip
        for num_tokens in args.tokens:
            x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, generator=generator)
            logits = torch.randn(num_tokens, num_experts, device=device, generator=generator)
            weights, expert_ids = logits.softmax(-1).topk(top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)

            inputs = (x, gate_up, down, weights, expert_ids, 0)

            def reference(inputs=inputs):
                return experts_reference(*inputs)

            def fused(inputs=inputs):
                return fused_moe.fused_experts(*inputs, all_experts_local=True)

            diff = (reference().float() - fused().float()).abs().max().item()
            torch_s, fused_s = timed(reference), timed(fused)
            active = expert_ids.unique().numel()
            weight_bytes = active * 3 * rows * hidden * gate_up.element_size()
            flops = 2 * num_tokens * top_k * hidden * 3 * rows
            print(f"| {name} | {num_tokens} | {torch_s * 1e3:.3f} | {fused_s * 1e3:.3f} | "
                  f"{torch_s / fused_s:.1f}x | {diff:.2e} | {weight_bytes / fused_s / 1e9:.0f} | "
                  f"{flops / fused_s / 1e12:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""Mixture-of-experts models on one GPU: the decode step against the bytes it must read, the
prompt against the matrix rate. DeepSeek-V2-Lite shape (latent attention, 64 experts, 6 per
token, 2 shared) and Qwen3-30B-A3B shape (128 experts, 8 per token), dummy weights, bf16.

    python benchmarks/moe_models.py --out moe.json [--models deepseek-v2-lite qwen3-30b-a3b]

Each model runs in a process of its own. Measured (medians after warm-up, host clock around
`EngineCore.step`, decode CUDA graphs on): one 8192-token prefill step; the decode step at batch
1 and 64 (prompts of 128 tokens, steps 10 onwards, contexts 138 to 288).

    decode roofline   bytes read per step / the device's copy rate (1 GiB copy, read + write):
                      every weight but the embedding table, the routed experts only for the
                      experts the batch is expected to touch (E * (1 - (1 - k/E) ** batch) per
                      layer, uniform routing: dummy weights route near uniformly), and the
                      batch's KV (latent + rope per token for MLA)
    prefill rate      the step's matrix FLOPs (`gpu_suite.prefill_flops`: 2 x the weights a
                      token uses, k routed experts and the shared ones, x 8192 tokens, + causal
                      attention's two products, + the LM head for the last token) per second,
                      over a measured 8192^3 bf16 matmul's rate
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from gpu_suite import (  # this script's folder is on sys.path when it runs
    ceilings,
    end_child,
    measure_in_children,
    prefill_flops,
    prefill_step_s,
    random_requests,
    step_times_until_done,
    weight_bytes,
)

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore

MODELS = ["deepseek-v2-lite", "qwen3-30b-a3b"]
PROMPT, DECODE_PROMPT, DECODE_TOKENS, BATCHES = 8192, 128, 160, (1, 64)


def measure(model: str) -> dict:
    limits = ceilings()
    core = EngineCore(
        EngineConfig(
            model=model,
            load_format="dummy",
            device="cuda:0",
            max_num_batched_tokens=PROMPT,
            max_num_seqs=max(BATCHES),
            max_model_len=PROMPT + 256,
            gpu_memory_utilization=0.85,
        )
    )
    request = random_requests(core)
    prefill_s = prefill_step_s(core, request, PROMPT)
    result = {
        "ceilings": limits,
        "prefill_8192_ms": prefill_s * 1e3,
        "prefill_TFLOPs": prefill_flops(core, PROMPT) / prefill_s / 1e12,
    }
    result["prefill_matrix_fraction"] = result["prefill_TFLOPs"] / limits["matmul_bf16_TFLOPs"]
    moe = core.model_config.moe
    for batch in BATCHES:
        for index in range(batch):
            core.add_request(request(f"decode-{batch}-{index}", DECODE_PROMPT, DECODE_TOKENS))
        core.step()  # every prompt in one step (batch x 128 tokens <= 8192)
        step_s = statistics.median(step_times_until_done(core)[10 : DECODE_TOKENS - 10])
        touched = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
        context = DECODE_PROMPT + DECODE_TOKENS // 2
        weights = weight_bytes(core, decode=True, expert_share=touched / moe.num_experts)
        read = weights + batch * context * core.kv_spec.bytes_per_token
        roofline_s = read / (limits["copy_GBps"] * 1e9)
        result[f"decode_b{batch}"] = {
            "step_ms": step_s * 1e3,
            "experts_touched_per_layer": touched,
            "bytes_read_GB": read / 1e9,
            "roofline_ms": roofline_s * 1e3,
            "roofline_fraction": roofline_s / step_s,
        }
    core.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        end_child(measure(args.child))
    results = measure_in_children(__file__, args.models)
    print("| model | prefill 8192 ms | TFLOP/s (fraction of matmul) | decode b1 ms (roofline "
          "fraction) | decode b64 ms (roofline fraction) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for model, row in results.items():
        b1, b64 = row["decode_b1"], row["decode_b64"]
        print(
            f"| {model} | {row['prefill_8192_ms']:.1f} | {row['prefill_TFLOPs']:.0f} "
            f"({row['prefill_matrix_fraction']:.2f}) | {b1['step_ms']:.2f} "
            f"({b1['roofline_fraction']:.2f}) | {b64['step_ms']:.2f} "
            f"({b64['roofline_fraction']:.2f}) |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

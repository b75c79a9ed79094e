"""The engine's decode step alone on a GPU: EngineCore.step() with a batch of requests decoding.

Qwen3-0.6B shape (random weights), one GPU, `--batch` requests of 1024 random prompt tokens and
400 new tokens each (`ignore_eos`); after 20 steps (the prompts and the graphs' warm-up), 300
steps are timed one by one on the host clock (with the engine's defaults: on CUDA it schedules
asynchronously, so a step's time is its share of the wall time, the next step's GPU work
queued before it returns). Prints one JSON line: the label, the batch and the step's p10 / p50 /
mean in ms. It uses only EngineCore's public calls, so the same file times an older checkout:

    PYTHONPATH=src python benchmarks/engine_step.py --label after --batch 32
    (cd OLD && PYTHONPATH=src python NEW/benchmarks/engine_step.py --label before --batch 32)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

PROMPT_TOKENS, NEW_TOKENS, WARM_STEPS, TIMED_STEPS = 1024, 400, 20, 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="step")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    config = EngineConfig(model="qwen3-0.6b", load_format="dummy", device="cuda:0",
                          max_num_seqs=max(64, args.batch), max_num_batched_tokens=16384,
                          max_model_len=4096, gpu_memory_utilization=0.5)  # fmt: skip
    core = EngineCore(config)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for index in range(args.batch):
        prompt = torch.randint(0, core.model_config.vocab_size, (PROMPT_TOKENS,),
                               generator=generator).tolist()  # fmt: skip
        core.add_request(Request(f"r{index}", prompt, params, max_total_tokens=core.max_model_len))
    for _ in range(WARM_STEPS):
        core.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_STEPS):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    times.sort()
    result = {
        "label": args.label,
        "batch": args.batch,
        "p10_ms": times[len(times) // 10] * 1e3,
        "p50_ms": statistics.median(times) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
    }
    print(json.dumps(result))  # fmt: skip
    core.shutdown()


if __name__ == "__main__":
    main()

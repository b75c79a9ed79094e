"""Piecewise and whole-pass CUDA graphs for prompts, A/B/C on one GPU: the same engine with
graphs off (`piecewise_cuda_graph_max_tokens=0`, prompts in the eager forward pass), with the
piecewise graphs only (its whole-pass graphs dropped after start-up: attention eager between
the pieces) and as it starts (a prompt alone replays one graph for its whole pass), one after
the other; one prompt of each length at a time, one token out (a prefill step and its
sampling), median of 15 after 3 warm-ups. Also prints the sizes each engine captured.

    python benchmarks/piecewise_graphs.py [--models qwen3-0.6b llama-3.1-8b]
                                          [--lengths 16 128 256 512 1024 2048]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.engine.config import EngineConfig

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
GRAPH_CAP = EngineConfig.piecewise_cuda_graph_max_tokens
MODES = {"eager": 0, "piecewise": GRAPH_CAP, "whole": GRAPH_CAP}  # mode -> graphs' token cap


def prompt_times(llm: LLM, length: int, rng: random.Random) -> float:
    """Median milliseconds of a one-token generation for fresh prompts of `length` tokens."""
    vocab = llm.core.model_config.vocab_size
    times = []
    for repeat in range(18):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt, ONE_TOKEN)
        if repeat >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 256, 512, 1024, 2048])
    args = parser.parse_args()
    rng = random.Random(0)
    for model in args.models:
        medians = {}
        for mode, max_tokens in MODES.items():
            llm = LLM(
                model,
                load_format="dummy",
                device="cuda",
                gpu_memory_utilization=0.5,
                max_num_batched_tokens=8192,
                max_model_len=16384,
                piecewise_cuda_graph_max_tokens=max_tokens,
            )
            graphs = llm.core.executor.runner.piecewise_graphs
            if mode == "piecewise":
                graphs.whole_graphs.clear()
            print(f"{model} {mode}: sizes {graphs.sizes if graphs else []}", flush=True)
            medians[mode] = {n: prompt_times(llm, n, rng) for n in args.lengths}
            del llm, graphs
            gc.collect()
            torch.cuda.empty_cache()
        print(f"\n{model}, {torch.cuda.get_device_name()}: one-token generation, median ms")
        print(
            f"{'tokens':>7} {'eager':>8} {'piecewise':>10} {'whole':>8} {'piecewise / whole':>18}"
        )
        for n in args.lengths:
            eager, piecewise, whole = (medians[mode][n] for mode in MODES)
            print(f"{n:7d} {eager:8.2f} {piecewise:10.2f} {whole:8.2f} {piecewise / whole:18.2f}")
        print()


if __name__ == "__main__":
    main()

"""`tandem generate`: run the offline engine on one prompt from the command line."""

from __future__ import annotations

import argparse

from tandem import DEFAULT_MODEL


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine settings every engine-running sub-command takes."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF dir")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-waiting", type=int, default=1024)
    group.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="priority: waiting requests go by their `priority` (lower first), and the least "
        "urgent running request is preempted first; fcfs: arrival order",
    )
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=2048,
        help="batches of up to this many tokens that decode graphs do not take (prompts, "
        "prefill chunks, mixed batches) run in piecewise CUDA graphs, their attention eager "
        "(0: never; capped at --max-num-batched-tokens)",
    )
    group.add_argument(
        "--busy-poll-s",
        type=float,
        default=None,
        help="seconds the engine loop (and a worker's HTTP server loop) keeps polling without "
        "sleeping after its last work, so that the next request finds its CPU core awake "
        "(default: 2 on CUDA, 0 on CPU)",
    )
    group.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace):
    from tandem.engine.config import EngineConfig

    memory = args.kv_cache_memory
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=None if memory is None else int(memory * (1 << 30)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        busy_poll_s=args.busy_poll_s,
        seed=args.seed,
    )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    llm = LLM(config.model, **settings)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
    )
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0

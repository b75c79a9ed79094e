"""`tandem generate`: run the offline engine on one prompt from the command line; and the engine
flags every engine-running sub-command declares.

The flags follow vLLM's names and values: the model comes positionally (`tandem worker MODEL`,
as `vllm serve MODEL`) or as `--model`; the shared engine settings (`add_engine_arguments`) are
those every worker of a cluster takes alike, so `tandem serve` passes them on. Imports only
argparse at import time.
"""

from __future__ import annotations

import argparse

from tandem import DEFAULT_MODEL

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's KV cache dtypes; tandem keeps its KV cache in the model's dtype (auto)
KV_CACHE_DTYPES = ("auto",)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def add_model_arguments(parser: argparse.ArgumentParser, default_help: str) -> None:
    """The model, positionally (vLLM's `vllm serve MODEL`) or as --model; `model_of` reads it."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"the model, as --model (given first, before flags that take several values); "
        f"{default_help}",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model name, .gguf file, Hugging Face directory or shipped config (with "
        f"--load-format dummy); {default_help}",
    )


def model_of(args: argparse.Namespace, command: str) -> str | None:
    """The model given positionally or by --model (None: neither); both, differing, is refused."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit(
            f"tandem {command}: the model is given twice, {args.model_tag!r} positionally and "
            f"{args.model!r} by --model: give it once"
        )
    return args.model_tag or args.model


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")


def kv_cache_dtype(text: str) -> str:
    """--kv-cache-dtype's value: vLLM's fp8 caches are refused with the value tandem takes."""
    if text in FP8_KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text}: tandem keeps the KV cache in the model's dtype (--dtype) and has no fp8 "
            "KV cache; use --kv-cache-dtype auto"
        )
    return text


def add_engine_arguments(parser: argparse._ActionsContainer) -> None:
    """The engine settings every engine-running sub-command takes, alike on every worker of a
    cluster (the model and the device aside)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on GPU"
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        metavar="TOKENIZER",
        help="the tokenizer to use instead of the model's: a Hugging Face directory, or a model "
        "whose tokenizer is taken (a .gguf file, smollm2-135m-instruct); with --load-format "
        "dummy in a shipped config's shape, text in and out",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a Hugging Face tokenizer run its own code; tandem never runs a model's code, "
        "so a model of an architecture it does not implement is refused",
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights in the model's shape",
    )
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "torch", "triton"),
        help="auto: triton on GPU, torch on CPU",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks (default: what --kv-cache-memory or the GPU's free memory allows)",
    )
    group.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB")
    group.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtype,
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype (tandem has no fp8 KV cache)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the fraction of GPU memory the engine may use",
    )
    group.add_argument("--max-num-seqs", type=int, default=128, help="sequences in one batch")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens in one step"
    )
    group.add_argument(
        "--max-model-len", type=int, default=None, help="the context length (default: the model's)"
    )
    group.add_argument(
        "--max-waiting", type=int, default=1024, help="sequences the engine's queue holds"
    )
    group.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="priority: waiting requests go by their `priority` (lower first), and the least "
        "urgent running request is preempted first; fcfs: arrival order",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of earlier requests' identical prompt blocks",
    )
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule each step while the GPU runs the one before, its sampled tokens read "
        "on the GPU (the host's scheduling and output handling hidden behind the forward pass; "
        "a step with a structured output or penalties still waits for its tokens); default: on "
        "CUDA, off on the CPU",
    )
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
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the sampling of requests that bring no seed of their own (one generator, "
        "drawn in the order requests are sampled, so a server started with the same seed "
        "answers the same requests alike), and dummy weights (default: 0, vLLM's)",
    )
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, one process each (on CUDA, N GPUs from --device "
        "on; on the CPU, gloo): attention heads, MLP and vocabulary split, KV heads split or "
        "replicated when fewer than N. N must divide the attention heads, and divide or be a "
        "multiple of the KV heads. In PD (roles prefill, decode, pd, auto) a prefill and a decode "
        "of any two such sizes pair, over any --kv-transport (tcp through rank 0; cuda-ipc, "
        "nixl and mooncake rank by rank)",
    )
    parallel.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="place a mixture-of-experts model's experts whole on the tensor-parallel ranks "
        "(N must divide the experts) instead of splitting every expert over them",
    )
    parallel.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="on CUDA, sum every tensor-parallel all-reduce through NCCL; by default sums of "
        "up to 1 MiB (a decode step's) read each GPU's copy over NVLink in one kernel",
    )


def engine_config_from_args(args: argparse.Namespace, command: str):
    from tandem.engine.config import EngineConfig

    memory = args.kv_cache_memory
    return EngineConfig(
        model=model_of(args, command) or DEFAULT_MODEL,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
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
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        busy_poll_s=args.busy_poll_s,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
    )


def refuse_unknown_architecture(config, command: str) -> None:
    """With --trust-remote-code, a model whose architecture tandem does not implement is
    refused at once, with a sentence: vLLM would run the model's own code, tandem never does."""
    if not config.trust_remote_code:
        return
    from tandem.models.config import SUPPORTED_MODEL_TYPES
    from tandem.models.source import ModelNotFoundError, resolve_model

    try:
        hf_config = resolve_model(config.model).hf_config
    except ModelNotFoundError:
        return  # the engine names the problem as it does without the flag
    model_type = hf_config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = ", ".join(hf_config.get("architectures") or []) or "no architectures"
        raise SystemExit(
            f"tandem {command}: {config.model} is a {model_type!r} model ({architectures}); "
            "--trust-remote-code would run its own code in vLLM, but tandem never runs a "
            "model's code, only its own implementations of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}: serve a model of one of those"
        )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, offline")
    add_model_arguments(parser, f"default: {DEFAULT_MODEL}")
    add_device_argument(parser)
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

    config = engine_config_from_args(args, "generate")
    refuse_unknown_architecture(config, "generate")
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

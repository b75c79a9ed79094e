"""The GPU benchmark suite: BENCHMARKS.md workloads 1, 2, 4 and 5 in one run.

    python benchmarks/gpu_suite.py --out results.json [--sections ceilings,roofline,...]

Sections (each prints its table; all results go into one JSON file):
  ceilings   measured device copy bandwidth, bf16 matrix rate, GPU0 -> GPU1 copy rate
  roofline   (5) Llama-3.1-8B shape: one decode step at batch 1 against
             (weight + KV bytes) / copy bandwidth; an 8192-token prefill against the matrix rate
  offline    (2) Qwen3-0.6B shape, 256 sequences, input and output uniform in [100, 1024]:
             tokens/s and the decode steps' roofline fraction
  structured (2) with every sequence held to a JSON schema, against the same batch without
             (only with --tokenizer; not in the default sections)
  transfer   (4) a 10k-token Qwen3-0.6B KV over CUDA IPC (GPU0 -> GPU1), against the copy rate
  latency    (1) input 128 / 1024 / 8192, output 128, one request at a time: `both` on GPU 0
             against 1 prefill (GPU 0) + 1 decode (GPU 1) behind tandem's router, with the
             handoff flow and (a second router, --no-handoff) vLLM's, and `both` behind a
             third router (the colocated system as served, a router in front); TTFT, time to
             second token, TPOT; greedy output of PD identical to colocated; and the legs
             timed direct from the client (no router), to split PD's extra time between the
             router, the prefill worker's KV bookkeeping and the decode leg; and one server
             over a prefill engine (GPU 0) and a decode engine (GPU 1), `--role pd`

Random weights in real shapes (load_format dummy); timings after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import torch

from tandem.engine.config import BUSY_POLL_CUDA_S, EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput

ROOT = Path(__file__).resolve().parent.parent


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, timed with CUDA events after one warm-up."""
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


def replay_ms(graph: torch.cuda.CUDAGraph, warmups: int, replays: int) -> float:
    """Milliseconds a replay of a captured CUDA graph takes: `warmups` replays, then `replays`
    back to back between two CUDA events."""
    for _ in range(warmups):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def ceilings(peer_copy: bool = True) -> dict:
    """GPU 0's copy rate and bf16 matrix rate; with `peer_copy`, GPU 0 -> GPU 1's copy rate too
    (when there are two GPUs)."""
    device = torch.device("cuda:0")
    source = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dest = torch.empty_like(source)
    copy_s = cuda_time(lambda: dest.copy_(source), 10)
    result = {"copy_GBps": 2 * source.numel() / copy_s / 1e9}  # read + write
    source = dest = None
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    matmul_s = cuda_time(lambda: a @ b, 10)
    result["matmul_bf16_TFLOPs"] = 2 * 8192**3 / matmul_s / 1e12
    if peer_copy and torch.cuda.device_count() > 1:
        source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dest = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:1")
        p2p_s = cuda_time(lambda: dest.copy_(source), 10)
        result["gpu0_to_gpu1_GBps"] = source.numel() / p2p_s / 1e9
    torch.cuda.empty_cache()
    return result


def expert_parameter(name: str) -> bool:
    """A mixture-of-experts layer's stacked routed experts."""
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def first_rank(core: EngineCore):
    """What holds the model and runner of rank 0: the executor, or its rank under TP."""
    executor = core.executor
    return executor.rank if hasattr(executor, "rank") else executor


def weight_bytes(core: EngineCore, decode: bool, expert_share: float = 1.0) -> int:
    """Bytes of weights one forward pass reads on rank 0, its shard under TP (decode reads one
    embedding row, not the table; of the routed experts, `expert_share` of them)."""
    total = 0.0
    for name, param in first_rank(core).model.named_parameters():
        tied = core.model_config.tie_word_embeddings
        if decode and name.endswith("embed_tokens.weight") and not tied:
            continue
        total += (
            param.numel() * param.element_size() * (expert_share if expert_parameter(name) else 1)
        )
    return int(total)


def prefill_flops(core: EngineCore, tokens: int) -> float:
    """Matrix FLOPs of one causal prompt of `tokens` on rank 0 (its shard under TP): the weights
    a token uses (of the routed experts, k of E), attention's scores and values over half the
    square (causal), and the LM head for the last token only (the one whose logits are made)."""
    config, moe = core.model_config, core.model_config.moe
    model = first_rank(core).model
    per_token = 0.0
    for name, param in model.named_parameters():
        if param.dim() < 2 or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue
        per_token += param.numel() * (moe.top_k / moe.num_experts if expert_parameter(name) else 1)
    if config.mla is not None:
        qk = config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim
        v = config.mla.v_head_dim
    else:
        qk = v = config.head_dim
    heads = config.num_heads // core.config.tensor_parallel_size
    attention = config.num_layers * heads * (qk + v) * tokens * (tokens + 1) / 2
    return 2 * (per_token * tokens + attention + model.lm_head.weight.numel())


def run_steps_until_done(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def random_requests(core: EngineCore, seed: int = 0) -> Callable[[str, int, int], Request]:
    """request(request_id, prompt length, max_tokens): greedy, EOS ignored, the prompt's token
    ids drawn from one generator seeded once."""
    generator = torch.Generator().manual_seed(seed)

    def request(request_id: str, length: int, max_tokens: int) -> Request:
        ids = torch.randint(0, core.model_config.vocab_size, (length,), generator=generator)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return Request(request_id, ids.tolist(), params, max_total_tokens=core.max_model_len)

    return request


def prefill_step_s(core: EngineCore, request, length: int, rounds: int = 4) -> float:
    """Median host seconds of the step that prefills a `length`-token prompt (until its token is
    out: under async scheduling, the next step's call takes it), over `rounds` prompts after the
    first (a warm-up), each run to its end before the next."""
    times = []
    for index in range(rounds):
        request_id = f"prefill-{index}"
        core.add_request(request(request_id, length, 1))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while not any(output.request_id == request_id for output in core.step()):
            pass
        times.append(time.perf_counter() - start)
        run_steps_until_done(core)
    return statistics.median(times[1:])


def measure_in_children(script: str, names: Iterable[str]) -> dict[str, dict]:
    """`script --child NAME` for each name, each in a process of its own (so each starts on
    empty GPUs): its last line of output, JSON, also printed (stderr) as it comes, so a run cut
    short keeps what finished; a child that fails is printed and left out."""
    results = {}
    for name in names:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, script, "--child", name], capture_output=True, text=True
        )
        if done.returncode != 0:
            print(f"{name} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        elapsed = time.perf_counter() - started
        print(f"{name} ({elapsed:.0f} s): {json.dumps(results[name])}", file=sys.stderr, flush=True)
    return results


def end_child(result: dict) -> NoReturn:
    """A child of `measure_in_children`: print its result and end the process at once. A
    tensor-parallel engine's process otherwise waits at the interpreter's exit, in NCCL's
    communicator abort (`~ProcessGroupNCCL`: over a minute on 2 x H200, torch 2.11), and its
    parent waits on the pipe meanwhile."""
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def step_times_until_done(core: EngineCore) -> list[float]:
    """Seconds from each step's return to the next's until the engine has no work (the device
    synchronised before the first): a step's share of the wall time, whether the engine waits
    for each step (then the device is idle when the next starts) or schedules asynchronously."""
    torch.cuda.synchronize()
    times = []
    last = time.perf_counter()
    while core.has_work():
        core.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def roofline(limits: dict) -> dict:
    core = EngineCore(
        EngineConfig(
            model="llama-3.1-8b",
            load_format="dummy",
            device="cuda:0",
            max_num_batched_tokens=8192,
            max_num_seqs=8,
            max_model_len=16384,
            gpu_memory_utilization=0.85,
        )
    )
    request = random_requests(core)

    # prefill of 8192 tokens: one step
    num_prompt = 8192
    prefill_s = prefill_step_s(core, request, num_prompt)
    prefill_tflops = prefill_flops(core, num_prompt) / prefill_s / 1e12

    # decode at batch 1 with a 128-token context
    core.add_request(request("decode", 128, 160))
    core.step()
    decode_s = statistics.median(step_times_until_done(core)[10:])
    graph = core.executor.runner.decode_graphs.graphs[
        1
    ]  # GPU time alone: forward + logits, batch 1
    graph_s = cuda_time(graph.replay, 20)
    context = 128 + 80
    decode_bytes = weight_bytes(core, decode=True) + context * core.kv_spec.bytes_per_token
    roofline_s = decode_bytes / (limits["copy_GBps"] * 1e9)
    result = {
        "prefill_8192_ms": prefill_s * 1e3,
        "prefill_TFLOPs": prefill_tflops,
        "prefill_fraction_of_matmul": prefill_tflops / limits["matmul_bf16_TFLOPs"],
        "decode_step_b1_ms": decode_s * 1e3,
        "decode_graph_gpu_ms": graph_s * 1e3,
        "decode_roofline_ms": roofline_s * 1e3,
        "decode_over_roofline": decode_s / roofline_s,
    }
    core.shutdown()
    return result


def offline_core(**settings) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model="qwen3-0.6b",
            load_format="dummy",
            device="cuda:0",
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            max_model_len=4096,
            gpu_memory_utilization=0.85,
            **settings,
        )
    )


def offline_workload(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: 256 prompts of random token ids, input and output lengths in [100, 1024]."""
    generator = torch.Generator().manual_seed(0)
    num_seqs = 256
    input_lens = torch.randint(100, 1025, (num_seqs,), generator=generator).tolist()
    output_lens = torch.randint(100, 1025, (num_seqs,), generator=generator).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in input_lens]
    return prompts, output_lens


def run_offline(
    core: EngineCore,
    limits: dict,
    prompts: list[list[int]],
    output_lens: list[int],
    structured_output: StructuredOutput | None = None,
    label: str = "seq",
) -> dict:
    """Runs the batch to the end once (request ids `{label}-{index}`); tokens/s counts the
    tokens actually produced."""
    warm = Request("warm", [1] * 64, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    core.add_request(warm)
    run_steps_until_done(core)
    for index, (ids, n_out) in enumerate(zip(prompts, output_lens, strict=True)):
        params = SamplingParams(
            temperature=0, max_tokens=n_out, ignore_eos=True, structured_output=structured_output
        )
        request = Request(f"{label}-{index}", ids, params, max_total_tokens=core.max_model_len)
        core.add_request(request)
    weights = weight_bytes(core, decode=True)
    fractions = []
    produced: dict[str, int] = {}
    start = time.perf_counter()
    while core.has_work():
        scheduled = core.scheduler.schedule()
        step_start = time.perf_counter()
        runner_output = core.executor.runner.launch(scheduled)()
        step_s = time.perf_counter() - step_start
        core.scheduler.update_from_output(scheduled, runner_output)
        for request_id in runner_output.sampled_token_ids:
            produced[request_id] = produced.get(request_id, 0) + 1
        items = scheduled.requests
        if items and all(len(item.token_ids) == 1 for item in items):
            context = sum(item.start_position + 1 for item in items)
            ideal = (weights + context * core.kv_spec.bytes_per_token) / (limits["copy_GBps"] * 1e9)
            fractions.append(ideal / step_s)
    elapsed = time.perf_counter() - start
    num_output = sum(produced.values())
    return {
        "num_seqs": len(prompts),
        "elapsed_s": elapsed,
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_output + sum(len(p) for p in prompts)) / elapsed,
        "decode_steps": len(fractions),
        "decode_roofline_fraction_median": statistics.median(fractions) if fractions else None,
        "num_preemptions": core.scheduler.num_preemptions,
        "output_lens": [produced[f"{label}-{i}"] for i in range(len(prompts))],
    }


def offline(limits: dict) -> dict:
    core = offline_core()
    prompts, output_lens = offline_workload(core.model_config.vocab_size)
    result = run_offline(core, limits, prompts, output_lens)
    del result["output_lens"]
    core.shutdown()
    return result


# Any JSON object: a random model keeps writing inside it, so every step of every sequence
# computes a mask.
STRUCTURED_SCHEMA = {"type": "object"}


def structured(limits: dict, tokenizer_path: Path) -> dict:
    """Workload 2 with every sequence held to a JSON schema, then the same batch with the
    output lengths the grammar allowed and no grammar: the cost of the masks. The tokenizer
    (a tokenizer.json) gives the grammar its tokens; the model's ids past it are masked."""
    core = offline_core(enable_prefix_caching=False)  # the second pass reuses the prompts
    core.set_tokenizer(tokenizer_path.read_text(), core.model_config.eos_token_ids[:1])
    prompts, output_lens = offline_workload(core.model_config.vocab_size)
    grammar = StructuredOutput(json=STRUCTURED_SCHEMA)
    held = run_offline(core, limits, prompts, output_lens, grammar, label="grammar")
    free = run_offline(core, limits, prompts, held["output_lens"], label="plain")
    core.shutdown()
    return {
        "grammar_output_tokens": held["output_tokens"],
        "grammar_output_tokens_per_s": held["output_tokens_per_s"],
        "plain_output_tokens": free["output_tokens"],
        "plain_output_tokens_per_s": free["output_tokens_per_s"],
        "grammar_over_plain": held["output_tokens_per_s"] / free["output_tokens_per_s"],
    }


TRANSFER_PRODUCER = """
import sys, torch
from tandem.kv.data.cuda_ipc import export_handle
shape = [int(x) for x in sys.argv[1].split(",")]
cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda:0")
print(export_handle(cache), flush=True)
sys.stdin.readline()
"""


def transfer_child(method: str) -> None:
    """One copy method in its own process (a fault there cannot take the suite down); prints
    its median seconds and whether the bytes arrived intact, as JSON."""
    from tandem.kv.data.cuda_ipc import BlockCopier, open_handle

    shape = (TRANSFER_LAYERS, 2, 2 * TRANSFER_BLOCKS, 16, 8, 128)
    producer = subprocess.Popen(
        [sys.executable, "-c", TRANSFER_PRODUCER, ",".join(map(str, shape))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        remote = open_handle(producer.stdout.readline().strip(), torch.device("cuda:1"))
        local = torch.zeros(shape, dtype=torch.bfloat16, device="cuda:1")
        remote_ids = torch.randperm(2 * TRANSFER_BLOCKS)[:TRANSFER_BLOCKS].tolist()
        local_ids = torch.randperm(2 * TRANSFER_BLOCKS)[:TRANSFER_BLOCKS].tolist()
        stream = torch.cuda.Stream("cuda:1")
        use_kernel = method == "kernel"
        copier = BlockCopier(local)

        def copy() -> None:  # queued as the decode worker queues it, then waited for
            with torch.cuda.stream(stream):
                _, done = copier.launch(remote, remote_ids, local_ids, use_kernel)
            done.synchronize()

        copy()
        ok = torch.equal(local[:, :, local_ids].cpu(), remote[:, :, remote_ids].cpu())
        times = []
        for _ in range(10):
            start = time.perf_counter()
            copy()
            times.append(time.perf_counter() - start)
        result = {"seconds": statistics.median(times), "ok": ok}
        if use_kernel:  # the kernel alone, by launch shape, with the index tensors uploaded
            from tandem.kv.data.cuda_ipc import copy_blocks_kernel

            remote_index = torch.tensor(remote_ids, dtype=torch.int32, device="cuda:1")
            local_index = torch.tensor(local_ids, dtype=torch.int32, device="cuda:1")
            with torch.cuda.device("cuda:1"):
                for chunk, warps in ((4096, 4), (8192, 8), (16384, 8), (16384, 16)):
                    result[f"chunk{chunk}_warps{warps}_s"] = cuda_time(
                        lambda c=chunk, w=warps: copy_blocks_kernel(
                            remote, remote_index, local, local_index, c, w
                        ),
                        10,
                    )
        print(json.dumps(result))
    finally:
        producer.stdin.write("\n")
        producer.stdin.flush()
        producer.wait(30)


TRANSFER_LAYERS, TRANSFER_BLOCKS = 28, 640  # Qwen3-0.6B shape, 10,240 tokens in 16-token blocks


def transfer(limits: dict) -> dict:
    """A 10k-token KV of the Qwen3-0.6B shape: producer process on GPU 0, copy into GPU 1."""
    num_bytes = TRANSFER_BLOCKS * 16 * TRANSFER_LAYERS * 2 * 8 * 128 * 2
    summary: dict = {"bytes": num_bytes}
    for method in ("kernel", "gather"):
        child = subprocess.run(
            [sys.executable, __file__, "--out", "-", "--transfer-child", method],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = child.stdout.strip().splitlines()
        if child.returncode != 0 or not lines:
            summary[f"{method}_error"] = child.stderr.strip().splitlines()[-3:]
            continue
        measured = json.loads(lines[-1])
        for key, seconds in measured.items():
            if key.startswith("chunk"):
                summary[key.replace("_s", "_GBps")] = num_bytes / seconds / 1e9
        rate = num_bytes / measured["seconds"] / 1e9
        summary[f"{method}_ms"] = measured["seconds"] * 1e3
        summary[f"{method}_GBps"] = rate
        summary[f"{method}_fraction_of_p2p"] = rate / limits["gpu0_to_gpu1_GBps"]
        summary[f"{method}_bytes_identical"] = measured["ok"]
    return summary


def start_process(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def stop_processes(processes: Iterable[subprocess.Popen]) -> None:
    """SIGTERM to each process group, SIGKILL to those still there after 20 s."""
    processes = list(processes)
    for process in processes:
        try:
            os.killpg(process.pid, 15)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def token_chunk_times(client, url: str, body: dict) -> tuple[float, list[float], int]:
    """Streams a completion: when it was sent, the arrival times of the chunks that carry a
    token (its text or its id), and the completion tokens the usage chunk counts (0 if none)."""
    times, num_tokens = [], 0
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", [])):
                times.append(now)
    return start, times, num_tokens


def stream_once(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT, time to second token and TPOT. The client is created
    once, outside the timing (building an HTTP client costs tens of milliseconds)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start, times, num_tokens = token_chunk_times(client, url, body)
    return {
        "ttft_ms": (times[0] - start) * 1e3,
        "ttst_ms": (times[1] - start) * 1e3,
        "tpot_ms": (times[-1] - times[0]) / (num_tokens - 1) * 1e3,
    }


def greedy_token_ids(client, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    answer = client.post(f"{url}/v1/completions", json=dict(body, return_token_ids=True)).json()
    return answer["choices"][0]["token_ids"]


def metric_totals(client, url: str, names: Iterable[str]) -> dict[str, float]:
    """Metric samples of a worker or router, each summed over its labels (e.g. the decode
    worker's tandem_kv_transfer_seconds_sum: time spent loading remote KV)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


WORKER_TTFT = "tandem_time_to_first_token_seconds_sum"
# What each path's servers record of one request (seconds, summed): the worker's own TTFT (from
# its HTTP handler's start to the first token out of its engine), the router's TTFT and the time
# it adds itself (waiting on workers excluded), the decode worker's KV load.
ROUTER_TIMES = {
    "tandem_router_ttft_seconds_sum": "router_ttft_ms",
    "tandem_router_added_seconds_sum": "router_added_ms",
}
SERVER_TIMES = {
    "both": {"both": {WORKER_TTFT: "worker_ttft_ms"}},
    "both_routed": {"both_routed": ROUTER_TIMES, "both": {WORKER_TTFT: "worker_ttft_ms"}},
    **{
        path: {
            path: ROUTER_TIMES,
            "prefill": {WORKER_TTFT: "prefill_worker_ttft_ms"},
            "decode": {
                WORKER_TTFT: "decode_worker_ttft_ms",
                "tandem_kv_transfer_seconds_sum": "kv_transfer_ms",
            },
        }
        for path in ("pd", "pd_in_sequence")
    },
    "pd_server": {
        "pd_server": {
            WORKER_TTFT: "worker_ttft_ms",
            "tandem_kv_transfer_seconds_sum": "kv_transfer_ms",
        }
    },
}


def server_times(client, urls: dict[str, str], path: str) -> dict[str, float]:
    """The totals SERVER_TIMES names for `path`, read from each server's /metrics."""
    times = {}
    for server, names in SERVER_TIMES[path].items():
        totals = metric_totals(client, urls[server], names)
        times.update({label: totals[name] for name, label in names.items()})
    return times


def direct_legs(client, urls: dict[str, str], prompt: list[int]) -> dict:
    """The PD legs without the router, each timed from the client: `both` answering one token
    (the colocated engine's path without KV bookkeeping), the prefill leg (one token and a KV
    lease), then the decode leg streamed with that lease: its first chunk (the prefill's token,
    sent on admission) and its second token (after the KV load and one step)."""
    from tandem.router.classify import prefill_leg_body

    one_token = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    client.post(f"{urls['both']}/v1/completions", json=one_token).raise_for_status()
    both_one_token = time.perf_counter() - start
    start = time.perf_counter()
    answer = client.post(
        f"{urls['prefill']}/v1/completions", json=prefill_leg_body(one_token)
    ).json()
    prefill_leg = time.perf_counter() - start
    decode_body = dict(
        one_token,
        max_tokens=2,
        stream=True,
        return_token_ids=True,
        kv_transfer_params=answer["kv_transfer_params"],
    )
    start, times, _ = token_chunk_times(client, urls["decode"], decode_body)
    return {
        "both_one_token_ms": both_one_token * 1e3,
        "prefill_leg_ms": prefill_leg * 1e3,
        "decode_leg_first_chunk_ms": (times[0] - start) * 1e3,
        "decode_leg_second_token_ms": (times[1] - start) * 1e3,
    }


# Every worker of the latency section (benchmarks/trace_latency.py starts its own with these).
LATENCY_WORKER_ARGS = [
    "--model", "qwen3-0.6b", "--load-format", "dummy", "--host", "127.0.0.1",
    "--gpu-memory-utilization", "0.4", "--max-model-len", "16384",
    "--max-num-batched-tokens", "8192", "--max-num-seqs", "64",
]  # fmt: skip
LATENCY_REPEATS = 30  # measured requests per input length and path, after 2 warm-ups


def pair_ttft_ratios(runs: dict[str, list[dict]], path: str) -> list[float]:
    """Each request's TTFT on `path` over that of the `both` request run back to back with it
    on the same prompt."""
    return [
        timed["ttft_ms"] / both["ttft_ms"]
        for timed, both in zip(runs[path], runs["both"], strict=True)
    ]


def latency(limits: dict, log_dir: Path) -> dict:
    import httpx

    common = LATENCY_WORKER_ARGS
    ipc = ["--kv-transport", "cuda-ipc"]
    processes = {
        "both": start_process(["worker", *common, "--port", "8301", "--device", "cuda:0"],
                              log_dir / "both.log"),
        "prefill": start_process(["worker", *common, "--port", "8302", "--device", "cuda:0",
                                  "--role", "prefill", *ipc], log_dir / "prefill.log"),
        "decode": start_process(["worker", *common, "--port", "8303", "--device", "cuda:1",
                                 "--role", "decode", *ipc], log_dir / "decode.log"),
        # one server over a prefill engine on GPU 0 and a decode engine on GPU 1
        "pd_server": start_process(["worker", *common, "--port", "8306", "--device", "cuda:0",
                                    "--role", "pd", "--decode-device", "cuda:1",
                                    "--gpu-memory-utilization", "0.1"],
                                   log_dir / "pd-server.log"),
    }  # fmt: skip
    decode_url = "http://127.0.0.1:8303"
    urls = {
        "both": "http://127.0.0.1:8301",
        "pd": "http://127.0.0.1:8300",
        "pd_in_sequence": "http://127.0.0.1:8304",
        "both_routed": "http://127.0.0.1:8305",
        "pd_server": "http://127.0.0.1:8306",
        "prefill": "http://127.0.0.1:8302",
        "decode": decode_url,
    }
    try:
        workers = (("both", 8301), ("prefill", 8302), ("decode", 8303), ("pd_server", 8306))
        for name, port in workers:
            wait_healthy(f"http://127.0.0.1:{port}", processes[name])
        # The routers keep their loop awake between requests, as `tandem serve` starts them
        # in front of CUDA workers (whose loops do so by default).
        busy_poll = ["--busy-poll-s", str(BUSY_POLL_CUDA_S)]
        pair = ["--prefill", "http://127.0.0.1:8302", "--decode", decode_url, *busy_poll]
        processes["router"] = start_process(
            ["router", "--port", "8300", *pair], log_dir / "router.log"
        )
        processes["router_in_sequence"] = start_process(
            ["router", "--port", "8304", "--no-handoff", *pair], log_dir / "router-seq.log"
        )  # vLLM's flow, for comparison
        processes["router_both"] = start_process(
            ["router", "--port", "8305", "--worker", urls["both"], *busy_poll],
            log_dir / "router-both.log",
        )  # the colocated baseline behind a router, as PD is
        wait_healthy(urls["pd"], processes["router"])
        wait_healthy(urls["pd_in_sequence"], processes["router_in_sequence"])
        wait_healthy(urls["both_routed"], processes["router_both"])
        generator = torch.Generator().manual_seed(0)
        results = {}
        with httpx.Client(timeout=300) as client:
            for num_input in (128, 1024, 8192):
                paths = ("both", "pd", "pd_in_sequence", "both_routed", "pd_server")
                runs: dict[str, list[dict]] = {name: [] for name in (*paths, "legs")}
                for repeat in range(2 + LATENCY_REPEATS):
                    # `both`, the handoff path and the pd server share a prompt, vLLM's flow and
                    # the routed `both` another: no path finds another's prompt in its workers'
                    # caches.
                    prompts = [
                        torch.randint(0, 151000, (num_input,), generator=generator).tolist()
                        for _ in range(2)
                    ]
                    shift = repeat % len(paths)  # rotate which path goes first
                    for name in paths[shift:] + paths[:shift]:
                        prompt = prompts[name in ("pd_in_sequence", "both_routed")]
                        before = server_times(client, urls, name)
                        run = stream_once(client, urls[name], prompt, 128)
                        after = server_times(client, urls, name)
                        run.update({key: (after[key] - before[key]) * 1e3 for key in after})
                        if repeat >= 2:  # the first two are warm-ups
                            runs[name].append(run)
                    prompt = torch.randint(0, 151000, (num_input,), generator=generator).tolist()
                    legs = direct_legs(client, urls, prompt)
                    if repeat >= 2:
                        runs["legs"].append(legs)
                row = {
                    name: {key: statistics.median(r[key] for r in measured) for key in measured[0]}
                    for name, measured in runs.items()
                }
                row["ttft_ratio"] = row["pd"]["ttft_ms"] / row["both"]["ttft_ms"]
                ratios = pair_ttft_ratios(runs, "pd")
                row["ttft_ratio_min_max"] = [min(ratios), max(ratios)]
                row["ttft_ratio_median_of_pairs"] = statistics.median(ratios)
                for name in ("pd", "pd_in_sequence", "pd_server"):
                    row[f"ttst_{name}_minus_both_ms"] = (
                        row[name]["ttst_ms"] - row["both"]["ttst_ms"]
                    )
                row["ttft_ratio_in_sequence"] = (
                    row["pd_in_sequence"]["ttft_ms"] / row["both"]["ttft_ms"]
                )
                row["ttft_ratio_vs_both_routed"] = (
                    row["pd"]["ttft_ms"] / row["both_routed"]["ttft_ms"]
                )
                row["ttst_pd_minus_both_routed_ms"] = (
                    row["pd"]["ttst_ms"] - row["both_routed"]["ttst_ms"]
                )
                row["ttft_ratio_pd_server"] = row["pd_server"]["ttft_ms"] / row["both"]["ttft_ms"]
                row["ttft_ratio_pd_server_median_of_pairs"] = statistics.median(
                    pair_ttft_ratios(runs, "pd_server")
                )
                prompt = torch.randint(0, 151000, (num_input,), generator=generator).tolist()
                colocated = greedy_token_ids(client, urls["both"], prompt, 64)
                disaggregated = greedy_token_ids(client, urls["pd"], prompt, 64)
                row["pd_identical_to_both"] = colocated == disaggregated
                one_server = greedy_token_ids(client, urls["pd_server"], prompt, 64)
                row["pd_server_identical_to_both"] = colocated == one_server
                results[str(num_input)] = row
            # streamed PD requests that went through the handoff flow
            handoffs = "tandem_router_handoffs_total"
            results["router_handoffs"] = metric_totals(client, urls["pd"], [handoffs])[handoffs]
        return results
    finally:
        stop_processes(processes.values())


def print_table(title: str, rows: dict) -> None:
    print(f"\n== {title}")
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        print(f"  {key:40s} {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--transfer-child", choices=("kernel", "gather"), help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="ceilings,roofline,offline,transfer,latency")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument(
        "--tokenizer", type=Path, help="a tokenizer.json for the structured section"
    )
    args = parser.parse_args()
    if args.transfer_child:
        transfer_child(args.transfer_child)
        return
    sections = args.sections.split(",")
    results: dict = {
        "device": torch.cuda.get_device_name(0),
        "num_gpus": torch.cuda.device_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    results["ceilings"] = ceilings()
    print_table("ceilings", results["ceilings"])
    limits = results["ceilings"]
    two_gpus = torch.cuda.device_count() > 1
    for name, fn in (("roofline", roofline), ("offline", offline), ("transfer", transfer)):
        if name in sections and (name != "transfer" or two_gpus):
            try:
                results[name] = fn(limits)
            except Exception as exc:  # keep the other sections' numbers
                results[name] = {"error": repr(exc)}
            print_table(name, results[name])
            gc.collect()
            torch.cuda.empty_cache()
            args.out.write_text(json.dumps(results, indent=2))
    if "structured" in sections and args.tokenizer is not None:
        try:
            results["structured"] = structured(limits, args.tokenizer)
        except Exception as exc:
            results["structured"] = {"error": repr(exc)}
        print_table("structured", results["structured"])
        args.out.write_text(json.dumps(results, indent=2))
    if "latency" in sections and two_gpus:
        try:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            results["latency"] = latency(limits, args.log_dir)
        except Exception as exc:
            results["latency"] = {"error": repr(exc)}
        print("\n== latency (ms)")
        for key, row in results["latency"].items():
            print(f"  {'input ' + key if key.isdigit() else key}: {json.dumps(row)}")
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The engine on a CUDA GPU: Triton attention, CUDA graphs and the GPU-direct KV transport,
checked against transformers and against the colocated worker. Skipped without a GPU."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pd_fixtures import assert_nothing_held, metric, post, run_direct, with_defaults
from tandem import LLM, SamplingParams
from tiny_models import SHAPES
from worker_fixtures import running_worker, start_tandem, wait_for_metric

pytestmark = pytest.mark.cuda

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
DECODE_DEVICES = ["cuda:0", pytest.param("cuda:1", marks=TWO_GPUS)]  # beside the prefill or not


def make_prompts(count: int = 32) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 300, (count,), generator=generator).tolist()
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in lengths]


PROMPTS = make_prompts()


def hf_greedy(directory, prompts, dtype) -> tuple[list[list[int]], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).cuda().eval()
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs, model


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_fp32_on_gpu_matches_transformers(shape, tiny_checkpoints):
    """float32 on the GPU (exact fp32 dots in the Triton kernels): identical greedy tokens for 32
    prompts, with CUDA graphs for decode."""
    expected, _ = hf_greedy(tiny_checkpoints[shape], PROMPTS, torch.float32)
    llm = LLM(str(tiny_checkpoints[shape]), device="cuda", dtype="float32", num_kv_blocks=2048)
    assert llm.core.executor.runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert llm.core.kv_manager.num_used_blocks == 0


def test_cuda_graphs_match_eager(tiny_checkpoints):
    directory = str(tiny_checkpoints["qwen3-qknorm"])
    graphs = LLM(directory, device="cuda", dtype="float32", num_kv_blocks=2048)
    eager = LLM(directory, device="cuda", dtype="float32", num_kv_blocks=2048, enforce_eager=True)
    assert eager.core.executor.runner.decode_graphs is None
    assert [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, GREEDY)] == [
        o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]


def record_padded_sizes(graphs) -> list[int]:
    """The padded size of every batch the piecewise graphs run from now on."""
    sizes, run = [], graphs.run

    def recording_run(token_inputs, *args):
        sizes.append(token_inputs.shape[1])
        return run(token_inputs, *args)

    graphs.run = recording_run
    return sizes


def test_piecewise_graphs_match_eager(tiny_checkpoints):
    """Prompts in piecewise CUDA graphs (padded to the ladder, attention eager between the
    pieces): the same greedy tokens as the eager forward pass, whole prompts batched, and cut in
    chunks of 48 tokens beside decode rows, then again with their prefixes from the cache."""
    directory = str(tiny_checkpoints["qwen3-qknorm"])
    common = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 2048}
    eager = LLM(directory, piecewise_cuda_graph_max_tokens=0, **common)
    assert eager.core.executor.runner.piecewise_graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)]
    for max_batched in (2048, 48):
        llm = LLM(directory, max_num_batched_tokens=max_batched, **common)
        graphs = llm.core.executor.runner.piecewise_graphs
        assert graphs.sizes  # a small model's batches are bound by the host: graphs pay
        padded_sizes = record_padded_sizes(graphs)
        for _ in range(2):  # the second time, every prompt's full blocks are cached
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert padded_sizes and set(padded_sizes) <= set(graphs.sizes)
        if max_batched == 2048:  # batches of whole prompts: several padded sizes
            assert len(set(padded_sizes)) > 1
        assert llm.core.kv_manager.num_used_blocks == 0


class CountedGraph:
    """A captured graph that counts its replays."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


def test_whole_pass_graphs_match_eager(tiny_checkpoints):
    """Prompts alone (batches of one sequence) replay one graph for the whole pass, attention
    included: the same greedy tokens as the eager forward pass, whole and in chunks of 48
    tokens, then again with their full blocks from the cache (a context longer than the query)."""
    directory = str(tiny_checkpoints["qwen3-qknorm"])
    common = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 2048}
    prompts = PROMPTS[:12]
    eager = LLM(directory, piecewise_cuda_graph_max_tokens=0, **common)
    expected = [eager.generate(prompt, GREEDY)[0].outputs[0].token_ids for prompt in prompts]
    for max_batched in (2048, 48):
        llm = LLM(directory, max_num_batched_tokens=max_batched, **common)
        graphs = llm.core.executor.runner.piecewise_graphs
        assert sorted(graphs.whole_graphs) == graphs.sizes
        graphs.whole_graphs = {size: CountedGraph(g) for size, g in graphs.whole_graphs.items()}
        for _ in range(2):  # the second time, every prompt's full blocks are cached
            got = [llm.generate(prompt, GREEDY)[0].outputs[0].token_ids for prompt in prompts]
            assert got == expected
        # every prompt the first time; the second, those with more than one token left
        assert sum(graph.replays for graph in graphs.whole_graphs.values()) > len(prompts)
        assert llm.core.kv_manager.num_used_blocks == 0


def test_prompt_logprobs_on_gpu_match_transformers(tiny_checkpoints):
    """Prompt logprobs from the piecewise graphs' hidden states, in one batch and in chunks of
    48 tokens, against transformers' float32 forward on the GPU."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoints["qwen3-qknorm"]
    prompts = [p for p in PROMPTS if len(p) > 1][:6]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    for max_batched in (2048, 48):
        llm = LLM(str(directory), device="cuda", dtype="float32", num_kv_blocks=2048,
                  max_num_batched_tokens=max_batched)  # fmt: skip
        for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
            with torch.no_grad():
                logits = reference(torch.tensor([prompt], device="cuda")).logits[0]
            expected = torch.log_softmax(logits.double(), dim=-1)
            got = [entry.logprob for entry in output.prompt_logprobs[1:]]
            want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            assert got == pytest.approx(want.tolist(), abs=2e-3)
        assert llm.core.kv_manager.num_used_blocks == 0


BF16_TIE_GAP = 0.125  # two bf16 steps at the logits' magnitude (~8 to 16)


def test_greedy_bf16_divergence_only_at_near_ties(tiny_checkpoints):
    """In bfloat16 the two implementations round differently; greedy outputs may part where the
    two best logits are (nearly) tied. Every divergence must be such a tie in transformers' own
    logits."""
    directory = tiny_checkpoints["llama-gqa"]
    expected, model = hf_greedy(directory, PROMPTS, torch.bfloat16)
    llm = LLM(str(directory), device="cuda", num_kv_blocks=2048)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    divergences = []
    for prompt, ours, theirs in zip(PROMPTS, got, expected, strict=True):
        if ours == theirs:
            continue
        position = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        with torch.no_grad():
            context = torch.tensor([prompt + ours[:position]], device="cuda")
            logits = model(context).logits[0, -1].float()
        top2 = logits.topk(2).values
        divergences.append((position, float(top2[0] - top2[1])))
    print(f"bf16: {len(PROMPTS) - len(divergences)}/{len(PROMPTS)} identical; {divergences}")
    # A random tiny model's logits are flat, so bf16 ties are common; each divergence must be one.
    assert all(gap <= BF16_TIE_GAP for _, gap in divergences), divergences


def test_pd_over_tcp_on_one_gpu_matches_colocated(tmp_path, tiny_checkpoints):
    """The TCP transport from a CUDA prefill worker (each layer's blocks gathered on a copy
    stream between the piecewise graphs' pieces): the same greedy tokens as a colocated worker,
    and no block held afterwards."""
    model = str(tiny_checkpoints["llama-gqa"])
    common = ("--device", "cuda:0", "--dtype", "float32", "--num-kv-blocks", "2048")
    tcp = ("--kv-transport", "tcp")
    with (
        running_worker(tmp_path, *common, model=model) as both,
        running_worker(tmp_path, "--role", "prefill", *tcp, *common, model=model) as prefill,
        running_worker(tmp_path, "--role", "decode", *tcp, *common, model=model) as decode,
    ):
        assert_pd_matches_colocated(both, prefill, decode, "tcp")
        assert_handoffs_match_colocated(tmp_path, both, prefill, decode)


def greedy_body(prompt: list[int]) -> dict:
    """A completions body for NEW_TOKENS greedy tokens, with their ids in the answer."""
    return {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def assert_pd_matches_colocated(both, prefill, decode, transport: str) -> None:
    for prompt in PROMPTS[:16]:
        body = greedy_body(prompt)
        colocated = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60).json()
        first = httpx.post(
            f"{prefill.url}/v1/completions",
            json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
            timeout=60,
        ).json()
        params = first["kv_transfer_params"]
        assert params["kv_transport"] == transport
        answer = httpx.post(
            f"{decode.url}/v1/completions",
            json=dict(body, kv_transfer_params=params),
            timeout=60,
        ).json()
        assert answer["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
    for worker in (prefill, decode):
        assert wait_for_metric(worker.url, "tandem_kv_cache_blocks_used", 0.0) == 0.0


def assert_handoffs_match_colocated(tmp_path, both, prefill, decode) -> None:
    """The same prompts streamed through a router, which hands each off (the decode leg waits
    for the prefill's announcement): the colocated worker's tokens, and nothing held after."""
    router = start_tandem(tmp_path, "router", "--prefill", prefill.url, "--decode", decode.url)
    prompts = PROMPTS[:16]
    try:
        router.wait_healthy()
        with httpx.Client(timeout=60) as client:
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
                body = with_defaults(dict(body, ignore_eos=True, stream=True))
                completion = post(client, f"{router.url}/v1/completions", body)
                assert completion == run_direct(client, both.url, "/v1/completions", body)
        assert metric(router, "tandem_router_handoffs_total") == len(prompts)
    finally:
        router.stop()
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize(
    ("decode_device", "decode_flags"),
    [
        ("cuda:0", ()),
        pytest.param("cuda:1", (), marks=TWO_GPUS),
        pytest.param("cuda:1", ("--no-async-scheduling",), marks=TWO_GPUS, id="cuda:1-sync"),
    ],
)
def test_pd_over_cuda_ipc_matches_colocated(
    tmp_path, tiny_checkpoints, decode_device, decode_flags
):
    """Prefill on GPU 0, decode on GPU 0 or 1 (scheduling asynchronously, CUDA's default, or
    not), KV copied out of the mapped prefill cache under a hold on its lease (asked for in
    sequence, carried by the announcement in a handoff): the same greedy tokens as a colocated
    worker scheduling synchronously, and no block held afterwards (the confirmations after the
    copies freed the prefill's)."""
    model = str(tiny_checkpoints["qwen2-bias"])
    common = ("--dtype", "float32", "--num-kv-blocks", "2048")
    ipc = ("--kv-transport", "cuda-ipc")
    with (
        running_worker(
            tmp_path, "--device", "cuda:0", "--no-async-scheduling", *common, model=model
        ) as both,
        running_worker(
            tmp_path, "--device", "cuda:0", "--role", "prefill", *ipc, *common, model=model
        ) as prefill,
        running_worker(
            tmp_path,
            "--device",
            decode_device,
            "--role",
            "decode",
            *ipc,
            *common,
            *decode_flags,
            model=model,
        ) as decode,
    ):
        assert_pd_matches_colocated(both, prefill, decode, "cuda-ipc")
        assert_handoffs_match_colocated(tmp_path, both, prefill, decode)
        assert_waiting_handoffs_match_colocated(both, prefill, decode)


def assert_waiting_handoffs_match_colocated(both, prefill, decode) -> None:
    """Handoffs whose decode leg waits on the prefill's KV server before the prefill leg is
    sent: the announcement reaches the waiting decode with the lease held, and the copy
    follows: the colocated worker's tokens, also when the first token ends the request at
    prefill; nothing held."""
    kv = httpx.get(f"{prefill.url}/health", timeout=10).json()["kv"]
    prompts = PROMPTS[16:20]
    for index, prompt in enumerate([*prompts, prompts[0]]):
        body = greedy_body(prompt)
        if index == len(prompts):  # the first token is a stop token: the prefill ends there
            first = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60).json()
            body["stop_token_ids"] = first["choices"][0]["token_ids"][:1]
        colocated = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60).json()
        handoff_id = f"waiting-{index}"
        decode_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "handoff_id": handoff_id,
            "remote_host": kv["host"],
            "remote_port": kv["port"],
            "kv_transport": "cuda-ipc",
        }
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post,
                f"{decode.url}/v1/completions",
                json=dict(body, kv_transfer_params=decode_params),
                timeout=60,
            )
            time.sleep(1.0)  # the decode leg reaches the prefill's KV server and waits there
            prefill_params = {"do_remote_decode": True, "handoff_id": handoff_id}
            httpx.post(
                f"{prefill.url}/v1/completions",
                json=dict(body, max_tokens=1, kv_transfer_params=prefill_params),
                timeout=60,
            ).raise_for_status()
            tokens = answer.result().json()["choices"][0]["token_ids"]
        assert tokens == colocated["choices"][0]["token_ids"]
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("decode_device", DECODE_DEVICES)
def test_pd_server_matches_colocated(tmp_path, tiny_checkpoints, decode_device):
    """Role pd: the prefill engine on GPU 0, the decode engine on GPU 0 (each with half the
    memory) or GPU 1, the KV over cuda-ipc inside one server: every request handed over, the
    colocated worker's greedy tokens (collected and streamed), nothing held afterwards."""
    model = str(tiny_checkpoints["qwen2-bias"])
    common = ("--dtype", "float32", "--num-kv-blocks", "2048", "--device", "cuda:0")
    prompts = PROMPTS[:16]
    with (
        running_worker(tmp_path, *common, model=model) as both,
        running_worker(
            tmp_path, *common, "--role", "pd", "--decode-device", decode_device, model=model
        ) as pd_server,
        httpx.Client(timeout=60) as client,
    ):
        for index, prompt in enumerate(prompts):
            body = with_defaults(dict(greedy_body(prompt), stream=index % 2 == 0))
            completion = post(client, f"{pd_server.url}/v1/completions", body)
            assert completion == run_direct(client, both.url, "/v1/completions", body)
        assert metric(pd_server, "tandem_kv_transfer_seconds_count") == len(prompts)
        assert metric(pd_server, "tandem_kv_transfer_failures_total") == 0
        assert_nothing_held(pd_server)
        assert_bursts_match_colocated(client, both.url, pd_server.url)


def burst(client: httpx.Client, url: str, bodies: list[dict]) -> list[list[int]]:
    """The completions' token ids, every body sent at once."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        completions = pool.map(lambda body: post(client, f"{url}/v1/completions", body), bodies)
        return [completion.token_ids for completion in completions]


def assert_bursts_match_colocated(client, both_url: str, pd_url: str) -> None:
    """Bursts of 48 short prompts sent at once, many handoffs in flight together: the colocated
    worker's greedy tokens for every prompt, nothing held afterwards."""
    generator = torch.Generator().manual_seed(23)
    for _ in range(2):
        lengths = torch.randint(4, 40, (48,), generator=generator).tolist()
        prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in lengths]
        bodies = [with_defaults(greedy_body(prompt)) for prompt in prompts]
        assert burst(client, pd_url, bodies) == burst(client, both_url, bodies)
    assert metric(pd_url, "tandem_kv_transfer_failures_total") == 0
    assert_nothing_held(pd_url)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pd_server_matches_colocated_on_long_prompts(tmp_path):
    """Role pd on Qwen3-0.6B's shape (random weights) with 1024-token prompts, prefill on GPU 0
    and decode on GPU 1: the colocated worker's greedy tokens and logprobs, also when the first
    token ends the request at prefill; nothing held afterwards."""
    common = ("--load-format", "dummy", "--device", "cuda:0", "--max-model-len", "4096")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 151000, (1024,), generator=generator).tolist() for _ in range(6)]
    with (
        running_worker(tmp_path, *common, "--gpu-memory-utilization", "0.3", model="qwen3-0.6b")
        as both,
        running_worker(
            tmp_path, *common, "--role", "pd", "--decode-device", "cuda:1",
            "--gpu-memory-utilization", "0.2", model="qwen3-0.6b",
        ) as pd_server,
        httpx.Client(timeout=60) as client,
    ):  # fmt: skip
        for index, prompt in enumerate(prompts):
            body = dict(greedy_body(prompt), max_tokens=16, logprobs=2, stream=index % 2 == 0)
            if index == len(prompts) - 1:  # its first token is a stop token
                first = run_direct(client, both.url, "/v1/completions", dict(body, max_tokens=1))
                body["stop_token_ids"] = first.token_ids
            body = with_defaults(body)
            completion = post(client, f"{pd_server.url}/v1/completions", body)
            assert completion == run_direct(client, both.url, "/v1/completions", body)
        assert_nothing_held(pd_server)

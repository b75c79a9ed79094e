"""Async scheduling (`--async-scheduling`) on the CPU: each step scheduled while the one before
runs, its decoding requests' input the token that step samples, taken on the device. Against
independent references: transformers' greedy continuation, and the same engine scheduling
synchronously, token for token.

* On by default on CUDA, off on the CPU; `--async-scheduling` / `--no-async-scheduling` say so.

* Greedy, 16 prompts (chunked prefill, prefix-cache hits), requests ending at max_tokens and at
  stop tokens (so steps run on for requests already finished): identical to transformers and to
  the synchronous engine; no block held after.
* Seeded sampling, min_tokens, logprobs, prompt logprobs, and penalties (whose steps are taken at
  once): identical to the synchronous engine.
* A KV cache too small for the batch: requests preempted with a token in flight keep it, and the
  output is still transformers'.
* An abort and a failing step while a step is in flight: the failed requests end with an error,
  the others as without them, and no block is held.
* Two tensor-parallel ranks (gloo): rank 0 broadcasts its samples; identical to one rank.
* On GPUs (`cuda`): with decode CUDA graphs, pinned copies and NCCL's broadcast, identical to the
  synchronous engine on one GPU and at TP=2 on two.

The scheduler's side, step by step against a model-free reference (preemption, aborts, prefix
hits and chunks at random), is test_scheduler.py's random mix under async scheduling.
"""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.request import Request
from tiny_models import assert_same_generations, mixed_sampling, varied_prompts

MODEL = "llama-gqa"
PROMPTS = varied_prompts(seed=5)
NEW_TOKENS = 10
ENGINE = dict(device="cpu", num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """(synchronous engine, async engine), the same settings."""
    model = str(tiny_checkpoints[MODEL])
    return LLM(model, **ENGINE, async_scheduling=False), LLM(model, **ENGINE, async_scheduling=True)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> list[list[int]]:
    """transformers' greedy continuation of every prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[MODEL], dtype=torch.float32)
    result = []
    for prompt in PROMPTS:
        generated = model.eval().generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        result.append(generated[0, len(prompt) :].tolist())
    return result


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_on_by_default_on_cuda_and_off_on_the_cpu(monkeypatch):
    from tandem.cli import build_parser
    from tandem.engine import config
    from tandem.engine.cli import engine_config_from_args
    from tandem.engine.config import EngineConfig

    parser = build_parser()
    flags = {(): None, ("--async-scheduling",): True, ("--no-async-scheduling",): False}
    for given, expected in flags.items():
        args = parser.parse_args(["worker", *given])
        assert engine_config_from_args(args, "worker").async_scheduling is expected
    assert EngineConfig(device="cpu").resolved().async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).resolved().async_scheduling is True
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    assert EngineConfig(device="cuda:0").resolved().async_scheduling is True
    on_cuda = EngineConfig(device="cuda:0", async_scheduling=False).resolved()
    assert on_cuda.async_scheduling is False


def test_greedy_matches_transformers_and_synchronous_scheduling(engines, reference):
    sync, async_ = engines
    assert token_ids(async_.generate(PROMPTS, GREEDY)) == reference
    # Requests that end early, at a length or at a token, while the others go on: the step
    # after their last runs for them too, and its token is dropped.
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=1 + index % NEW_TOKENS,
            stop_token_ids=[expected[index % 4]] if index % 3 == 0 else None,
            ignore_eos=True,
        )
        for index, expected in enumerate(reference)
    ]
    got = async_.generate(PROMPTS, params)
    assert token_ids(got) == token_ids(sync.generate(PROMPTS, params))
    assert [o.outputs[0].finish_reason for o in got].count("stop") > 0
    kv = async_.core.kv_manager
    assert kv.num_prefix_hits > 0 and kv.num_used_blocks == 0
    assert not async_.core.has_work()


def test_sampling_logprobs_and_penalties_match_synchronous_scheduling(engines):
    """Seeded sampling draws by (seed, output index), which the scheduler counts ahead past the
    token in flight; penalties read the tokens so far, so their steps are not left in flight."""
    params = mixed_sampling(NEW_TOKENS, seeded=True)
    sync, async_ = engines
    got = async_.generate(PROMPTS, params)
    assert_same_generations(got, sync.generate(PROMPTS, params), tolerance=1e-5)
    assert len(got[-1].prompt_logprobs) == len(PROMPTS[-1])
    assert async_.core.kv_manager.num_used_blocks == 0


def test_preempted_requests_keep_their_token_in_flight(tiny_checkpoints, reference):
    tight = LLM(
        str(tiny_checkpoints[MODEL]), **dict(ENGINE, num_kv_blocks=40), async_scheduling=True
    )
    assert token_ids(tight.generate(PROMPTS, GREEDY)) == reference
    assert tight.core.scheduler.num_preemptions > 0
    assert tight.core.kv_manager.num_used_blocks == 0


def test_an_abort_and_a_failed_step_while_a_step_is_in_flight(engines, reference):
    """Requests a, b, c decode; with a step in flight, a is aborted, then the next launch
    fails for b and c (a forward that raises): they end with an error, the engine goes on, and
    a request added after is its greedy self; no block is held."""
    _, async_ = engines
    core = async_.core
    for name, prompt in zip("abc", PROMPTS[4:7], strict=True):
        core.add_request(Request(name, prompt, GREEDY))
    outputs = []
    while not core.step_in_flight or not core.scheduler.running:
        outputs += core.step()
    outputs += core.abort_requests(["a"])
    launch = core.executor.launch_model

    def failing_launch(scheduler_output):
        raise RuntimeError("a broken forward")

    core.executor.launch_model = failing_launch
    try:
        outputs += core.step()
    finally:
        core.executor.launch_model = launch
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["a"].finish_reason == "abort"
    assert {finished[name].finish_reason for name in "bc"} == {"error"}
    assert "a broken forward" in finished["b"].error
    assert not core.has_work() and core.kv_manager.num_used_blocks == 0
    assert token_ids(async_.generate(PROMPTS[:1], GREEDY)) == reference[:1]


def test_two_ranks_broadcast_their_samples(tiny_checkpoints, reference):
    tp2 = LLM(str(tiny_checkpoints[MODEL]), **ENGINE, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert token_ids(tp2.generate(PROMPTS, GREEDY)) == reference
        assert tp2.core.kv_manager.num_used_blocks == 0
    finally:
        tp2.core.shutdown()


# --- on GPUs ----------------------------------------------------------------------------------

CUDA_ENGINE = dict(device="cuda", dtype="float32", num_kv_blocks=2048, max_num_batched_tokens=96)
SEEDED = [
    SamplingParams(
        temperature=0.8, seed=index, max_tokens=NEW_TOKENS, logprobs=2 if index % 2 else None
    )
    for index in range(len(PROMPTS))
]


@pytest.mark.cuda
def test_on_a_gpu_with_decode_graphs_equals_synchronous_scheduling(tiny_checkpoints):
    model = str(tiny_checkpoints[MODEL])
    sync = LLM(model, **CUDA_ENGINE, async_scheduling=False)
    async_ = LLM(model, **CUDA_ENGINE)  # on by default on CUDA
    assert async_.core.config.async_scheduling
    assert async_.core.executor.runner.decode_graphs is not None
    for params in (GREEDY, SEEDED):
        assert token_ids(async_.generate(PROMPTS, params)) == token_ids(
            sync.generate(PROMPTS, params)
        )
    assert async_.core.kv_manager.num_used_blocks == 0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_two_gpus_rank_0_broadcasts_its_samples(tiny_checkpoints):
    model = str(tiny_checkpoints[MODEL])
    sync = LLM(model, **CUDA_ENGINE, tensor_parallel_size=2, async_scheduling=False)
    expected = [token_ids(sync.generate(PROMPTS, params)) for params in (GREEDY, SEEDED)]
    sync.core.shutdown()
    async_ = LLM(model, **CUDA_ENGINE, tensor_parallel_size=2, async_scheduling=True)
    try:
        got = [token_ids(async_.generate(PROMPTS, params)) for params in (GREEDY, SEEDED)]
        assert got == expected
        assert async_.core.kv_manager.num_used_blocks == 0
    finally:
        async_.core.shutdown()

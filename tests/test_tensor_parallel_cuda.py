"""Tensor parallelism on two CUDA GPUs (NCCL): greedy output at TP=2 identical to transformers and
to TP=1, with the decode CUDA graphs (their collectives captured) and without; and PD from a
prefill worker at TP=1 to a decode worker at TP=2 over tcp, token-identical to a colocated
worker, with nothing held afterwards. Skipped without two GPUs."""

from __future__ import annotations

import httpx
import pytest
import torch

from pd_fixtures import assert_nothing_held
from tandem import LLM, SamplingParams
from test_cuda_engine import PROMPTS, greedy_body, hf_greedy
from worker_fixtures import running_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 2048}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qknorm"])
def test_tp2_on_two_gpus_matches_transformers_and_tp1(shape, eager, tiny_checkpoints):
    model = str(tiny_checkpoints[shape])
    prompts = PROMPTS[:16]
    expected, hf_model = hf_greedy(model, prompts, torch.float32)
    del hf_model
    tp2 = LLM(model, **ENGINE, tensor_parallel_size=2, enforce_eager=eager)
    assert (tp2.core.executor.rank.runner.decode_graphs is None) == eager
    got = [o.outputs[0].token_ids for o in tp2.generate(prompts, GREEDY)]
    tp2.core.shutdown()
    assert got == expected
    tp1 = LLM(model, **ENGINE)
    assert [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)] == got


def test_pd_from_tp1_prefill_to_tp2_decode_matches_colocated(tmp_path, tiny_checkpoints):
    """1P(TP=1, GPU 0) + 1D(TP=2, GPUs 0 and 1) over tcp, the legs driven directly: the decode
    worker's two ranks each install their KV-head range before decoding."""
    model = str(tiny_checkpoints["llama-gqa"])
    common = ("--dtype", "float32", "--num-kv-blocks", "2048", "--kv-transport", "tcp")
    with (
        running_worker(tmp_path, "--device", "cuda:0", *common, model=model) as both,
        running_worker(
            tmp_path, "--role", "prefill", "--device", "cuda:0", *common, model=model
        ) as prefill,
        running_worker(
            tmp_path, "--role", "decode", "--device", "cuda:0", "-tp", "2", *common, model=model
        ) as decode,
    ):
        for prompt in PROMPTS[:16]:
            body = greedy_body(prompt)
            colocated = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60).json()
            first = httpx.post(
                f"{prefill.url}/v1/completions",
                json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                timeout=60,
            ).json()
            params = first["kv_transfer_params"]
            assert params["tp_size"] == 1
            answer = httpx.post(
                f"{decode.url}/v1/completions",
                json=dict(body, kv_transfer_params=params),
                timeout=60,
            ).json()
            assert answer["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
        assert_nothing_held(prefill, decode)

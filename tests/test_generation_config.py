"""A model's generation_config.json gives the defaults of the sampling fields a request leaves
out (as vLLM does by default); `--generation-config none` and explicit fields override them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tandem.models.source import resolve_model, sampling_defaults
from tandem.server.openai.completion_request import CompletionRequest
from worker_fixtures import running_worker

QWEN3_STYLE = {
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_new_tokens": 100,
    "eos_token_id": 2,
}


def with_generation_config(tiny_checkpoints, tmp_path, settings: dict):
    directory = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama-gqa"], directory)
    (directory / "generation_config.json").write_text(json.dumps(settings))
    return directory


def test_sampling_fields_of_the_generation_config_become_defaults(tiny_checkpoints, tmp_path):
    directory = with_generation_config(tiny_checkpoints, tmp_path, QWEN3_STYLE)
    assert sampling_defaults(resolve_model(str(directory))) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.1,
    }
    # no sampling field: nothing (the tiny checkpoint's own file is what save_pretrained wrote)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert sampling_defaults(resolve_model(str(directory))) == {}
    assert sampling_defaults(resolve_model(str(tiny_checkpoints["llama-gqa"]))) == {}


def test_a_request_field_beats_the_default():
    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    params = CompletionRequest(prompt="x").sampling_params(None, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.6, 20, 1.1)
    params = CompletionRequest(prompt="x", temperature=0, top_k=-1).sampling_params(None, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0, 0, 1.1)
    assert CompletionRequest(prompt="x").sampling_params(None, {}).temperature == 1.0


@pytest.mark.timeout(240)
def test_worker_samples_with_the_models_defaults(tiny_checkpoints, tmp_path):
    """top_k 1 by default makes a request that sets nothing greedy; a request that sets top_k
    samples at the default temperature instead."""
    directory = with_generation_config(
        tiny_checkpoints, tmp_path, {"do_sample": True, "temperature": 1.5, "top_k": 1}
    )
    prompt = list(range(10, 30))
    with running_worker(tmp_path, "--num-kv-blocks", "64", model=str(directory)) as worker:

        def token_ids(**fields) -> list[int]:
            body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
            response = httpx.post(worker.url + "/v1/completions", json=body | fields, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        greedy = token_ids(temperature=0)
        assert token_ids() == greedy
        assert token_ids(seed=1) == greedy
        assert token_ids(top_k=0, seed=1) != greedy

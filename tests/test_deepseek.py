"""DeepSeek-V2/V3 (latent attention, routed and shared experts), against transformers.

* The routers' variants (V2 greedy and group-limited softmax; V3 sigmoid with the correction
  bias, group-limited) against transformers' routers; YaRN's frequencies, attention factor and
  softmax scale against transformers' rope functions and attention.
* The absorbed attention (decode) against the decompressed one on the same cache.
* A rank's slices: attention heads split, the latent projections whole; the cache layout of one
  latent per token; multi-token-prediction tensors skipped; settings tandem cannot run refused.
* Whole engines on tiny random checkpoints (V2-Lite-like without q compression; V3-like with it,
  a random correction bias, YaRN): greedy output identical to transformers' generate for 16
  prompts at TP=1, TP=2 and TP=2 with --enable-expert-parallel (gloo).
* PD over nixl (each decode rank reads the latents; over tcp, rank 0's relay, slow): a prefill
  worker at TP=1 and a decode worker at TP=2 with expert parallelism answer as a colocated TP=1
  worker, holding nothing afterwards; kv_transfer_params name the latent layout, and a decode
  told of another layout refuses the request.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import httpx
import pytest
import torch

from pd_fixtures import (
    assert_nothing_held,
    prefill_leg,
    prompt_set,
    run_direct,
    run_pd,
    running_processes,
    with_defaults,
)
from tandem import SamplingParams
from tandem.attention.base import AttentionMetadata, get_backend
from tandem.distributed.group import TensorParallelGroup
from tandem.kv.data import installed
from tandem.models import registry
from tandem.models.config import ModelConfig, MoEConfig
from tandem.models.layers.mla import MLARotary
from tandem.models.layers.moe import TopKRouter
from tandem.models.loader import iter_safetensors, load_model
from tandem.models.source import resolve_model
from tiny_models import DEEPSEEK_SHAPES, assert_generates, make_checkpoint, varied_prompts
from worker_fixtures import start_worker

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(num_kv_blocks=512, block_size=8, max_num_batched_tokens=96)  # chunked prefill
PROMPTS = varied_prompts(seed=41)
COMPLETIONS = "/v1/completions"


def hf_config(shape: str):
    from transformers import AutoConfig

    settings = dict(DEEPSEEK_SHAPES[shape])
    return AutoConfig.for_model(settings.pop("model_type"), vocab_size=512, **settings)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """shape -> checkpoint directory; V3's correction bias random (transformers saves zeros)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("deepseek")
    result = {name: make_checkpoint(name, root / name) for name in DEEPSEEK_SHAPES}
    model = AutoModelForCausalLM.from_pretrained(result["deepseek-v3"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=generator))
    model.save_pretrained(result["deepseek-v3"])
    return result


def tandem_config(shape: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(shape).to_dict())


# --- routing, rope and attention against transformers' modules -------------------------------


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_the_router_matches_transformers(method):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    shape = dict(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                 topk_group=2, routed_scaling_factor=1.5, num_hidden_layers=2,
                 num_attention_heads=4)  # fmt: skip
    if method == "noaux_tc":
        config = DeepseekV3Config(**shape, norm_topk_prob=True)
        theirs = DeepseekV3TopkRouter(config)
    else:
        config = DeepseekV2Config(**shape, topk_method=method, norm_topk_prob=False)
        theirs = DeepseekV2TopkRouter(config)
    moe = MoEConfig.from_hf(config.to_dict())
    assert (moe.topk_method, moe.num_groups, moe.topk_groups) == (method, 4, 2)
    mine = TopKRouter(16, moe)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(12, 16, generator=generator))
        mine.weight.copy_(theirs.weight)
        if method == "noaux_tc":
            theirs.e_score_correction_bias.copy_(torch.rand(12, generator=generator))
            mine.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(40, 16, generator=generator)
    weights, ids = mine(x)
    _, their_weights, their_ids = theirs(x)
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    groups_taken = [(row // 3).unique().numel() for row in ids]  # groups of 3 experts
    assert max(groups_taken) <= (3 if method == "greedy" else 2)
    if method == "greedy":
        assert max(groups_taken) == 3


@pytest.mark.parametrize("shape", sorted(DEEPSEEK_SHAPES))
def test_yarn_matches_transformers(shape):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = hf_config(shape)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rotary = MLARotary(tandem_config(shape))
    torch.testing.assert_close(rotary.inv_freq, inv_freq)
    assert rotary.attention_factor == pytest.approx(attention_factor)
    assert attention_factor != 1.0 if shape == "deepseek-v3" else attention_factor == 1.0
    scaling = DeepseekV3Attention(config, 0).scaling
    assert rotary.softmax_scale == pytest.approx(scaling)
    assert scaling != pytest.approx(24**-0.5)  # mscale_all_dim rescales the softmax


def decode_batch(num_seqs: int, context: int, block_size: int, generator) -> AttentionMetadata:
    """num_seqs sequences of `context` tokens each, one query token each, blocks shuffled."""
    blocks = -(-context // block_size)
    tables = torch.randperm(num_seqs * blocks, generator=generator).view(num_seqs, blocks)
    slots = tables[:, -1] * block_size + (context - 1) % block_size
    return AttentionMetadata(
        slot_mapping=slots.long(),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32),
        block_tables=tables.int(),
        max_query_len=1,
        max_seq_len=context,
    )


@pytest.mark.parametrize("shape", sorted(DEEPSEEK_SHAPES))
def test_absorbed_attention_equals_the_decompressed_one(shape, checkpoints):
    source = resolve_model(str(checkpoints[shape]))
    model = load_model(source, get_backend("torch"), torch.float32, torch.device("cpu"))
    attention = model.model.layers[1].self_attn
    generator = torch.Generator().manual_seed(7)
    layout = model.kv_cache_layout()
    cache = torch.randn(2, 40, 4, 1, layout.head_dim, generator=generator)  # one layer
    metadata = decode_batch(num_seqs=5, context=27, block_size=4, generator=generator)
    q = torch.randn(5, 4, 24, generator=generator)
    from tandem.models.layers.mla import gather_latents

    latents = gather_latents(cache, metadata)
    scale = model.model.rotary.softmax_scale
    absorbed = attention.attend_absorbed(q, cache, metadata, scale)
    decompressed = attention.attend_decompressed(q, latents, metadata, scale)
    assert absorbed.shape == (5, 4, source.hf_config["v_head_dim"])
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=1e-5)
    assert torch.equal(attention.attend(q, cache, metadata, scale), absorbed.reshape(5, -1))


# --- a rank's model -----------------------------------------------------------------------------


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_ranks_slices_are_the_checkpoints(expert_parallel, checkpoints):
    """Rank 1 of 2 (V3), built and loaded alone, against the checkpoint read whole."""
    source = resolve_model(str(checkpoints["deepseek-v3"]))
    assert registry.architecture_of(source.hf_config) == "DeepseekV3ForCausalLM"
    whole = {name: tensor[:] for name, tensor in iter_safetensors(source.path)}
    tp = TensorParallelGroup(1, 2)
    model = load_model(source, get_backend("torch"), torch.float32, torch.device("cpu"), tp=tp,
                       enable_expert_parallel=expert_parallel)  # fmt: skip
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn"
    # heads 2-3 of 4: q_b rows of 24 per head, kv_b rows of 16 + 12, o_proj columns of 12
    assert torch.equal(params[f"{attn}.q_b_proj.weight"], whole[f"{attn}.q_b_proj.weight"][48:])
    assert torch.equal(params[f"{attn}.kv_b_proj.weight"], whole[f"{attn}.kv_b_proj.weight"][56:])
    assert torch.equal(params[f"{attn}.o_proj.weight"], whole[f"{attn}.o_proj.weight"][:, 24:])
    for name in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert torch.equal(params[f"{attn}.{name}"], whole[f"{attn}.{name}"])
    mlp = "model.layers.1.mlp"
    shared_up = whole[f"{mlp}.shared_experts.up_proj.weight"][16:]  # rows 16-31 of 32
    assert torch.equal(params[f"{mlp}.shared_experts.gate_up_proj.weight"][16:], shared_up)
    bias = params[f"{mlp}.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(
        bias, whole[f"{mlp}.gate.e_score_correction_bias"]
    )
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == (4 if expert_parallel else 8)
    assert "model.layers.0.mlp.gate_up_proj.weight" in params  # first_k_dense_replace = 1
    layout = model.kv_cache_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 1, 20)  # (32 + 8) / 2
    assert model.config.num_kv_heads == 1  # one latent, whole on every rank


def test_multi_token_prediction_tensors_are_skipped(checkpoints):
    source = resolve_model(str(checkpoints["deepseek-v2-lite"]))
    model = registry.model_class(source.architecture)(source.config, get_backend("torch"))
    weights = list(iter_safetensors(source.path))
    extra = [("model.layers.3.eh_proj.weight", torch.zeros(64, 128)),
             ("model.layers.3.self_attn.q_proj.weight", torch.zeros(96, 64))]  # fmt: skip
    model.load_weights(weights + extra)
    with pytest.raises(ValueError, match=re.escape("'model.layers.1.self_attn.bogus.weight'")):
        model.load_weights(weights + [("model.layers.1.self_attn.bogus.weight", torch.zeros(1))])


def test_settings_tandem_cannot_run_are_refused():
    config = tandem_config("deepseek-v3")
    odd = dataclasses.replace(config, mla=dataclasses.replace(config.mla, kv_lora_rank=31))
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim is 39; .* even"):
        registry.model_class("DeepseekV3ForCausalLM")(odd, get_backend("torch"))
    linear = dataclasses.replace(config, rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    with pytest.raises(ValueError, match="rope scaling 'linear' is not supported for DeepSeek"):
        MLARotary(linear)


# --- whole engines ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(checkpoints):
    """shape -> transformers' greedy continuation of every prompt."""
    from transformers import AutoModelForCausalLM

    result = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: many times faster than several contended threads
    try:
        for shape, directory in checkpoints.items():
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            result[shape] = [
                model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in PROMPTS
            ]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return result


PARALLELISM = {
    "tp1": {},
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
FAST = {("deepseek-v2-lite", "tp1"), ("deepseek-v3", "tp1"), ("deepseek-v3", "tp2-ep")}


@pytest.mark.parametrize(
    "shape, parallelism",
    [
        pytest.param(shape, name, marks=() if (shape, name) in FAST else pytest.mark.slow)
        for shape in sorted(DEEPSEEK_SHAPES)
        for name in sorted(PARALLELISM)
    ],
)
def test_greedy_matches_transformers(shape, parallelism, checkpoints, references):
    settings = {**ENGINE, **PARALLELISM[parallelism]}
    assert_generates(checkpoints[shape], settings, PROMPTS, GREEDY, references[shape])


# --- PD between a TP=1 prefill and a TP=2 expert-parallel decode ------------------------------


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("tcp", marks=pytest.mark.slow),  # the relay: dense models test it by default
        pytest.param(
            "nixl", marks=pytest.mark.skipif(not installed("nixl"), reason="nixl missing")
        ),
    ],
)
def pd_workers(request, checkpoints, tmp_path_factory):
    """prefill (TP=1), decode (TP=2, expert parallel), both (TP=1, the reference): the V3, the
    latents over tcp (rank 0's relay) or nixl (each decode rank reads them, UCX over TCP)."""
    log_dir = tmp_path_factory.mktemp("deepseek-pd")
    start = functools.partial(start_worker, log_dir, model=str(checkpoints["deepseek-v3"]))
    common = ("--num-kv-blocks", "256", "--max-num-batched-tokens", "64")
    transport = ("--kv-transport", request.param)
    starts = {
        "prefill": functools.partial(start, "--role", "prefill", *transport, *common),
        "decode": functools.partial(start, "--role", "decode", *transport, *common,
                                    "--tensor-parallel-size", "2", "--enable-expert-parallel",
                                    "--kv-load-failure-policy", "fail"),  # no silent recompute
        "both": functools.partial(start, "--role", "both", *common),
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))  # no RDMA here: UCX over TCP
        with running_processes(starts) as workers:
            yield workers


def test_pd_to_an_expert_parallel_decode_matches_a_colocated_worker(pd_workers):
    prefill, decode = pd_workers["prefill"].url, pd_workers["decode"].url
    with httpx.Client() as client:
        for prompt in prompt_set(500, 1, 512)[::2]:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
            reference = run_direct(client, pd_workers["both"].url, COMPLETIONS, body)
            assert run_pd(client, prefill, decode, COMPLETIONS, body) == reference
        body = with_defaults({"prompt": prompt_set(500, 1, 512)[3], "max_tokens": 6})
        params = prefill_leg(client, prefill, COMPLETIONS, body)["kv_transfer_params"]
        assert params["kv_layout"] == "3xlatent32+8:float32"
        wrong = dict(params, kv_layout="3xlatent32+16:float32")
        answer = client.post(decode + COMPLETIONS, json=dict(body, kv_transfer_params=wrong))
        assert answer.status_code == 400 and "kv_layout" in answer.text, answer.text
        released = client.post(
            prefill + "/v1/kv/release", json={"remote_request_id": params["remote_request_id"]}
        )
        assert released.status_code < 300, released.text
    assert_nothing_held(prefill, decode)

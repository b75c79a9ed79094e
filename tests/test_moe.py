"""Mixture-of-experts models (Qwen3-MoE, Mixtral) and expert parallelism, against transformers.

* The router's top-k and each model's normalisation against transformers' own routers; the
  torch experts path against transformers' experts module on the same weights.
* A Mixtral GGUF file (stacked and per-expert tensors, as llama.cpp writes them) loads the same
  parameters as its safetensors checkpoint.
* Each rank's experts, loaded from lazy safetensors slices: split by rows (tensor parallelism)
  or whole (expert parallelism), against the checkpoint's tensors; sizes that cannot split the
  experts refused in one sentence.
* Whole engines on tiny random checkpoints: greedy output identical to transformers' generate
  for 16 prompts at TP=1, TP=2 and TP=2 with --enable-expert-parallel (gloo).
* On a GPU: the Triton grouped GEMM against the torch path, with and without skipped experts.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.attention.base import get_backend
from tandem.cli import build_parser
from tandem.distributed.group import TensorParallelGroup
from tandem.distributed.sharding import check_tensor_parallel
from tandem.engine.cli import engine_config_from_args
from tandem.models import registry
from tandem.models.config import ModelConfig, MoEConfig
from tandem.models.layers.moe import FusedMoE, TopKRouter, experts_reference
from tandem.models.loader import iter_safetensors, load_model
from tandem.models.source import SHIPPED_CONFIGS, resolve_model
from tiny_models import MOE_SHAPES, assert_generates, make_checkpoint, varied_prompts

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(num_kv_blocks=512, block_size=8, max_num_batched_tokens=96)  # chunked prefill


PROMPTS = varied_prompts(seed=37)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_checkpoint(name, root / name) for name in MOE_SHAPES}


# --- the router and the experts against transformers' modules ---------------------------------


@pytest.mark.parametrize("kind", ["qwen3-norm", "qwen3-no-norm", "mixtral"])
def test_the_router_matches_transformers(kind):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    shape = dict(hidden_size=16, num_experts_per_tok=3)
    if kind == "mixtral":
        theirs = MixtralTopKRouter(MixtralConfig(num_local_experts=6, **shape))
        hf = dict(model_type="mixtral", num_local_experts=6, intermediate_size=8)
    else:
        norm = kind == "qwen3-norm"
        theirs = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=6, norm_topk_prob=norm, **shape))
        hf = dict(model_type="qwen3_moe", num_experts=6, moe_intermediate_size=8,
                  norm_topk_prob=norm)  # fmt: skip
    moe = MoEConfig.from_hf(dict(hf, num_hidden_layers=1, num_experts_per_tok=3))
    mine = TopKRouter(16, moe)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mine.weight.copy_(torch.randn(6, 16, generator=generator))
        theirs.weight.copy_(mine.weight)
    x = torch.randn(9, 16, generator=generator)
    weights, ids = mine(x)
    _, their_weights, their_ids = theirs(x)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float())
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(9)) == (kind != "qwen3-no-norm")


def test_the_torch_experts_match_transformers():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=16, num_experts=6, moe_intermediate_size=12)
    theirs = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.randn(6, 24, 16, generator=generator))
        theirs.down_proj.copy_(torch.randn(6, 16, 12, generator=generator))
    x = torch.randn(11, 16, generator=generator)
    weights = torch.rand(11, 2, generator=generator)
    ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(11)])
    ids[:4] = torch.tensor([3, 1])  # one expert taken by several tokens
    expected = theirs(x, ids, weights)
    got = experts_reference(x, theirs.gate_up_proj, theirs.down_proj, weights, ids, 0)
    torch.testing.assert_close(got, expected)
    # experts 2..5 alone (a rank's under expert parallelism): the other experts' pairs skipped
    part = experts_reference(x, theirs.gate_up_proj[2:], theirs.down_proj[2:], weights, ids, 2)
    rest = experts_reference(x, theirs.gate_up_proj[:2], theirs.down_proj[:2], weights, ids, 0)
    torch.testing.assert_close(part + rest, expected)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_ranks_experts_are_the_checkpoints_slices(expert_parallel, checkpoints):
    """Rank 1 of 2, built and loaded alone, against the checkpoint read whole."""
    source = resolve_model(str(checkpoints["qwen3-moe"]))
    whole = {name: tensor[:] for name, tensor in iter_safetensors(source.path)}
    tp = TensorParallelGroup(1, 2)
    model = load_model(source, get_backend("torch"), torch.float32, torch.device("cpu"), tp=tp,
                       enable_expert_parallel=expert_parallel)  # fmt: skip
    params = dict(model.named_parameters())
    assert "model.layers.1.mlp.gate_up_proj.weight" in params  # layer 1: dense (mlp_only_layers)
    layer = "model.layers.2.mlp"
    experts = range(4, 8) if expert_parallel else range(8)
    rows = slice(0, 32) if expert_parallel else slice(16, 32)

    def stacked(projections, row_dim):
        return torch.stack([
            torch.cat([
                whole[f"{layer}.experts.{e}.{name}.weight"].narrow(row_dim, rows.start,
                                                                   rows.stop - rows.start)
                for name in projections
            ], dim=row_dim)
            for e in experts
        ])  # fmt: skip

    gate_up = stacked(["gate_proj", "up_proj"], 0)
    assert torch.equal(params[f"{layer}.experts.gate_up_proj"], gate_up)
    assert torch.equal(params[f"{layer}.experts.down_proj"], stacked(["down_proj"], 1))
    assert torch.equal(params[f"{layer}.gate.weight"], whole[f"{layer}.gate.weight"])


def test_a_checkpoint_that_lacks_an_expert_is_refused(checkpoints):
    source = resolve_model(str(checkpoints["mixtral"]))
    model = registry.model_class(source.architecture)(source.config, get_backend("torch"))
    weights = [(n, t) for n, t in iter_safetensors(source.path) if ".experts.3.w2." not in n]
    with pytest.raises(ValueError, match=r"lacks 2 tensors.*experts\.down_proj#\(3, None\)"):
        model.load_weights(weights)


def test_expert_shapes_that_cannot_split_are_refused():
    hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, num_experts=6,
              num_experts_per_tok=2, moe_intermediate_size=18)  # fmt: skip
    config = ModelConfig.from_hf(hf)
    with pytest.raises(ValueError, match=re.escape("does not divide the model's 6 experts")):
        check_tensor_parallel(config, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="expert MLP size 18: .* or --enable-expert-parallel"):
        check_tensor_parallel(config, 4)
    check_tensor_parallel(config, 2, expert_parallel=True)
    check_tensor_parallel(config, 2)


def test_the_flag_and_the_shipped_configs():
    args = build_parser().parse_args(["worker", "m.gguf", "-tp", "2", "--enable-expert-parallel"])
    config = engine_config_from_args(args, "worker")
    assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True)
    args = build_parser().parse_args(["worker", "m.gguf"])
    assert not engine_config_from_args(args, "worker").enable_expert_parallel
    shipped = (  # name, architecture, routed experts, dense layers first
        ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 128, 0),
        ("mixtral-8x7b", "MixtralForCausalLM", 8, 0),
        ("deepseek-v2-lite", "DeepseekV2ForCausalLM", 64, 1),
        ("deepseek-v3", "DeepseekV3ForCausalLM", 256, 3),
    )
    for name, architecture, experts, dense in shipped:
        hf = json.loads((SHIPPED_CONFIGS / f"{name}.json").read_text())
        assert registry.architecture_of(hf) == architecture
        config = ModelConfig.from_hf(hf)
        assert config.moe.num_experts == experts
        assert len(config.moe.sparse_layers) == config.num_layers - dense
        check_tensor_parallel(config, 2, expert_parallel=True)
        check_tensor_parallel(config, 2)


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute of attn_q / attn_k rows."""
    shape = weights.shape
    per_head = weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
    return per_head.swapaxes(1, 2).reshape(shape)


def write_mixtral_gguf(checkpoint, path):
    """The tiny Mixtral as llama.cpp's converter writes it (F32): layer 0's experts stacked
    (ffn_*_exps), layer 1's one tensor per expert (older files)."""
    import gguf

    hf = json.loads((checkpoint / "config.json").read_text())
    whole = {name: tensor[:].numpy() for name, tensor in iter_safetensors(checkpoint)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(hf["num_local_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    tensors = {
        "token_embd.weight": whole["model.embed_tokens.weight"],
        "output_norm.weight": whole["model.norm.weight"],
        "output.weight": whole["lm_head.weight"],
    }
    heads = {"q": hf["num_attention_heads"], "k": hf["num_key_value_heads"]}
    for layer in range(hf["num_hidden_layers"]):
        hf_layer, blk = f"model.layers.{layer}", f"blk.{layer}"
        moe = f"{hf_layer}.block_sparse_moe"
        tensors[f"{blk}.attn_norm.weight"] = whole[f"{hf_layer}.input_layernorm.weight"]
        tensors[f"{blk}.ffn_norm.weight"] = whole[f"{hf_layer}.post_attention_layernorm.weight"]
        for name, gguf_name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            weights = whole[f"{hf_layer}.self_attn.{name}_proj.weight"]
            if name in heads:
                weights = llama_cpp_permute(weights, heads[name])
            tensors[f"{blk}.{gguf_name}.weight"] = weights
        tensors[f"{blk}.attn_output.weight"] = whole[f"{hf_layer}.self_attn.o_proj.weight"]
        tensors[f"{blk}.ffn_gate_inp.weight"] = whole[f"{moe}.gate.weight"]
        for projection, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            experts = [whole[f"{moe}.experts.{e}.{w}.weight"] for e in range(4)]
            if layer == 0:
                tensors[f"{blk}.ffn_{projection}_exps.weight"] = np.stack(experts)
            else:
                for e, matrix in enumerate(experts):
                    tensors[f"{blk}.ffn_{projection}.{e}.weight"] = matrix
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_mixtral_gguf_loads_as_its_checkpoint(checkpoints, tmp_path):
    """Config and every parameter from the GGUF file equal to those from safetensors."""
    from tandem.models.gguf_loader import iter_gguf_weights, read_gguf_config

    checkpoint = checkpoints["mixtral"]
    path = write_mixtral_gguf(checkpoint, tmp_path / "mixtral.gguf")
    gguf_config = read_gguf_config(path)
    assert registry.architecture_of(gguf_config) == "MixtralForCausalLM"
    source = resolve_model(str(checkpoint))
    config = ModelConfig.from_hf(gguf_config)
    assert config.moe == source.config.moe
    backend = get_backend("torch")
    model_class = registry.model_class("MixtralForCausalLM")
    from_gguf, from_safetensors = model_class(config, backend), model_class(source.config, backend)
    from_gguf.load_weights(iter_gguf_weights(path))
    from_safetensors.load_weights(iter_safetensors(checkpoint))
    expected = dict(from_safetensors.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, expected[name]), name


# --- whole engines ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(checkpoints):
    """shape -> transformers' greedy continuation of every prompt."""
    from transformers import AutoModelForCausalLM

    result = {}
    for shape, directory in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        result[shape] = [
            model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
            for prompt in PROMPTS
        ]  # fmt: skip
    return result


PARALLELISM = {
    "tp1": {},
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}


@pytest.mark.parametrize("parallelism", sorted(PARALLELISM))
@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
def test_greedy_matches_transformers(shape, parallelism, checkpoints, references):
    settings = {**ENGINE, **PARALLELISM[parallelism]}
    assert_generates(checkpoints[shape], settings, PROMPTS, GREEDY, references[shape])


# --- the fused path on a GPU ------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_the_triton_experts_match_the_torch_path(dtype, num_tokens):
    from tandem.models import fused_moe

    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(num_tokens)
    num_experts, top_k, hidden, rows = 16, 4, 256, 96

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=generator) * scale).to(dtype)

    gate_up = rand(num_experts, 2 * rows, hidden, scale=0.1)
    down = rand(num_experts, hidden, rows, scale=0.1)
    x = rand(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=generator)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for first, count in ((0, num_experts), (4, 8)):  # every expert; a rank's 8 of them
        local_up, local_down = gate_up[first : first + count], down[first : first + count]
        expected = experts_reference(x, local_up, local_down, weights, ids, first)
        got = fused_moe.fused_experts(x, local_up, local_down, weights, ids, first,
                                      all_experts_local=count == num_experts)  # fmt: skip
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    # a layer that runs it: FusedMoE(fused=True) loads and computes as the torch one
    moe = MoEConfig(num_experts, top_k, rows, True, (0,))
    layers = [FusedMoE(hidden, moe, fused, TensorParallelGroup.single()) for fused in (False, True)]
    for layer in layers:
        layer.to(device=device, dtype=dtype)
        with torch.no_grad():
            layer.gate_up_proj.copy_(gate_up)
            layer.down_proj.copy_(down)
    torch.testing.assert_close(layers[1](x, weights, ids).float(),
                               layers[0](x, weights, ids).float(), **tolerance)  # fmt: skip

"""The engine against transformers' own model: greedy tokens identical, logits within float32
tolerance, under chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.attention.base import AttentionMetadata
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tiny_models import SHAPES

NEW_TOKENS = 64


def make_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 512, (n,), generator=generator).tolist()

    shared = rand(40)
    prompts = [rand(n) for n in (1, 3, 16, 17, 31, 64, 100)]
    prompts += [shared[:20] + rand(5), shared + rand(9), shared + rand(1), shared[:33]]
    prompts += [prompts[5], list(prompts[3]), shared]  # exact repeats
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    """shape name -> greedy continuation of every prompt by transformers' generate."""
    from transformers import AutoModelForCausalLM

    result = {}
    longest = max(len(p) for p in PROMPTS)
    # One batched generate per shape, prompts left-padded with an attention mask.
    input_ids = torch.zeros((len(PROMPTS), longest), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(PROMPTS):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt) :] = 1
    for name, directory in tiny_checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        generated = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        result[name] = generated[:, longest:].tolist()
    return result


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

VARIANTS = {
    "default": dict(num_kv_blocks=256),
    "chunked-7": dict(num_kv_blocks=256, max_num_batched_tokens=7, block_size=4),
    "preempting": dict(num_kv_blocks=40, block_size=8),
}


def shape_variants():
    """Every shape's default run and preemption on llama-gqa; chunked prefill (7 tokens a step:
    hundreds of steps) and the other shapes' variants when the slow tests run (the same
    scheduling paths, other layers; chunked prefill is checked by default against a colocated
    worker in the PD tests)."""
    for shape in sorted(SHAPES):
        for variant in sorted(VARIANTS):
            slow = variant == "chunked-7" or (variant != "default" and shape != "llama-gqa")
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(shape, variant, marks=marks, id=f"{shape}-{variant}")


@pytest.mark.parametrize(("shape", "variant"), list(shape_variants()))
def test_greedy_matches_transformers(shape, variant, tiny_checkpoints, references):
    llm = LLM(str(tiny_checkpoints[shape]), **VARIANTS[variant])
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt_index, (output, expected) in enumerate(zip(outputs, references[shape], strict=True)):
        assert output.outputs[0].token_ids == expected, f"prompt {prompt_index} diverged"
        assert output.outputs[0].finish_reason == "length"
    kv = llm.core.kv_manager
    assert kv.num_used_blocks == 0
    if variant == "chunked-7":  # later prompts run after earlier ones filled the cache
        assert kv.num_prefix_hits > 0
    if variant == "preempting":
        assert llm.core.scheduler.num_preemptions > 0


def test_repeated_batches_hit_the_prefix_cache(tiny_checkpoints, references):
    llm = LLM(str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=256)
    llm.generate(PROMPTS, GREEDY)
    hits_before = llm.core.kv_manager.num_prefix_hits
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.core.kv_manager.num_prefix_hits - hits_before >= sum(len(p) // 16 for p in PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == references["llama-gqa"]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logits_match_at_every_position(shape, tiny_checkpoints):
    """Prefill a prompt in uneven chunks through the paged cache; every position's logits must
    equal transformers' within float32 tolerance."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoints[shape]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = PROMPTS[6]  # 100 tokens
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]

    core = EngineCore(EngineConfig(model=str(directory), num_kv_blocks=64))
    block_size = core.kv_spec.block_size
    num_blocks = -(-len(prompt) // block_size)
    block_ids = torch.randperm(core.kv_spec.num_blocks)[:num_blocks]  # scattered, unordered
    got = []
    start = 0
    for size in (1, 13, 40, 46):
        positions = torch.arange(start, start + size)
        metadata = AttentionMetadata(
            slot_mapping=block_ids[positions // block_size] * block_size + positions % block_size,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32),
            seq_lens=torch.tensor([start + size], dtype=torch.int32),
            block_tables=block_ids[None].to(torch.int32),
            max_query_len=size,
            max_seq_len=start + size,
        )
        model, kv_cache = core.executor.model, core.executor.runner.kv_cache
        hidden = model.forward(
            torch.tensor(prompt[start : start + size]), positions, kv_cache, metadata
        )
        got.append(model.compute_logits(hidden))
        start += size
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=1e-4)


def test_the_registry_maps_each_architecture_and_refuses_others_naming_the_supported():
    from tandem.models import registry
    from tandem.models.llama import LlamaForCausalLM

    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert registry.model_class(architecture) is LlamaForCausalLM
    assert registry.architecture_of({"model_type": "qwen3"}) == "Qwen3ForCausalLM"  # no list
    listed = {"architectures": ["FancyForCausalLM", "MistralForCausalLM"]}
    assert registry.architecture_of(listed) == "MistralForCausalLM"  # the first supported
    with pytest.raises(ValueError, match="MambaForCausalLM is not supported") as refused:
        registry.architecture_of({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in str(
        refused.value
    )

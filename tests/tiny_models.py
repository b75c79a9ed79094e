"""Tiny random-weight checkpoints of each supported architecture, saved by transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHAPES = {
    # Llama with grouped-query attention (4 query heads share 2 KV heads), head_dim 16
    "llama-gqa": dict(
        model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    ),
    # Llama with tied embeddings, plain multi-head attention, head_dim 32, llama3 rope scaling
    "llama-tied": dict(
        model_type="llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Qwen2: q/k/v biases, 6 query heads over 2 KV heads
    "qwen2-bias": dict(
        model_type="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2
    ),
    # Qwen3: q/k RMSNorm, head_dim 32 independent of hidden/heads, 4 query heads over 1 KV head
    "qwen3-qknorm": dict(
        model_type="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
    ),
}

# Mixture-of-experts shapes (tests/test_moe.py), apart from SHAPES: every engine test runs those.
MOE_SHAPES = {
    # Qwen3-MoE: 8 experts of 32 rows, top-2 renormalised (norm_topk_prob), q/k norms; layer 1
    # keeps a dense MLP (mlp_only_layers)
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Mixtral: 4 experts of 64 rows, top-2 (a softmax over the top-2 logits), 1 KV head
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}


# DeepSeek shapes (tests/test_deepseek.py): latent attention (a 32-wide latent and an 8-wide rope
# part per token), YaRN rope scaling, shared experts and a dense first layer
DEEPSEEK_SHAPES = {
    # V2-Lite-like: no q compression, softmax top-2 of 8 experts (greedy), 2 shared experts,
    # DeepSeek's complex-pair rope with YaRN whose mscale changes the softmax scale
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        intermediate_size=96,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        topk_method="greedy",
        norm_topk_prob=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=16.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),  # fmt: skip
    ),
    # V3-like: q compression (q_lora_rank), sigmoid scores with the correction bias, top-2 of 8
    # experts from the best 2 of 4 groups, renormalised and scaled by 2.5, 1 shared expert,
    # interleaved rope with YaRN (mscale != mscale_all_dim: the cos/sin scaled too)
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        intermediate_size=96,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        num_mtp_layers=0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=16.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),  # fmt: skip
    ),
}


def varied_prompts(seed: int) -> list[list[int]]:
    """16 prompts of 1 to 120 token ids below 512, some sharing prefixes (prefix-cache hits)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(1, 512, (n,), generator=generator).tolist()

    shared = rand(48)
    prompts = [rand(n) for n in (1, 3, 8, 16, 17, 31, 64, 120)]
    prompts += [shared[:20] + rand(5), shared + rand(9), shared + rand(1), shared[:33]]
    prompts += [shared + rand(30), shared[:40], shared, list(prompts[5])]
    return prompts


def assert_generates(directory, settings, prompts, params, expected) -> None:
    """The engine (LLM(directory, **settings)) generates `expected` for `prompts`, token for
    token, with prefix-cache hits among the prompts (varied_prompts share prefixes)."""
    from tandem import LLM

    llm = LLM(str(directory), **settings)
    try:
        got = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
        for index, (tokens, reference) in enumerate(zip(got, expected, strict=True)):
            assert tokens == reference, f"prompt {index} diverged from transformers"
        assert llm.core.kv_manager.num_prefix_hits > 0
    finally:
        llm.core.shutdown()


def mixed_sampling(max_tokens: int, seeded: bool):
    """16 requests' sampling parameters (for varied_prompts): top-p seeded by request; top-k with
    logprobs, seeded too or drawn from the engine's generator; greedy with min_tokens; penalties
    on the tokens so far; greedy with prompt logprobs (last)."""
    from tandem import SamplingParams

    top_p = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=index, max_tokens=max_tokens)
        for index in range(7)
    ]
    top_k = [
        SamplingParams(
            temperature=1.0,
            top_k=50,
            seed=index if seeded else None,
            max_tokens=max_tokens,
            logprobs=3,
        )
        for index in range(5)
    ]
    penalized = SamplingParams(
        temperature=0, max_tokens=max_tokens, repetition_penalty=1.5, frequency_penalty=0.5
    )
    return [
        *top_p,
        *top_k,
        SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=6, logprobs=1),
        penalized,
        penalized,
        SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2),
    ]


def assert_same_generations(got, expected, tolerance: float) -> None:
    """Two engines' outputs (LLM.generate's) for the same requests: the same tokens, the same
    top logprobs' ids, and logprobs and the last request's prompt logprobs within tolerance."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for mine, theirs in zip(got, expected, strict=True):
        mine_logprobs, their_logprobs = mine.outputs[0].logprobs, theirs.outputs[0].logprobs
        assert (mine_logprobs is None) == (their_logprobs is None)
        for a, b in zip(mine_logprobs or [], their_logprobs or [], strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=tolerance)
    last_mine, last_theirs = got[-1].prompt_logprobs, expected[-1].prompt_logprobs
    assert len(last_mine) == len(last_theirs)
    for a, b in zip(last_mine[1:], last_theirs[1:], strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=tolerance)


def make_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Save a random checkpoint of shape `name` (config.json + model.safetensors) in directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict({**SHAPES, **MOE_SHAPES, **DEEPSEEK_SHAPES}[name])
    model_type = settings.pop("model_type")
    defaults = dict(
        vocab_size=512,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config = AutoConfig.for_model(model_type, **{**defaults, **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def byte_level_bpe(corpus: list[str], vocab_size: int):
    """A small byte-level BPE tokenizer (`tokenizers.Tokenizer`) trained on `corpus`, with
    `<|end|>` as its one special token; wrap it in transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    return core

"""The executor seam: a step's SchedulerOutput is plain data. It round-trips through msgspec
(which refuses to encode a live object: a Request, a grammar matcher), and the executor, driven
from the decoded copy, samples the same tokens as from the scheduler's own, for greedy, seeded,
penalized, logprob-asking and grammar-held requests over several steps (prompt chunks, then
decode). The structured output's choice shows the bitmask travelled: without it the random
model's tokens would leave the choice."""

from __future__ import annotations

import msgspec
import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.outputs import SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tiny_models import byte_level_bpe

VOCAB = 512
CHOICES = ["abba", "baab"]
CORPUS = ["abba baab aabb bbaa ab ba aa bb", "the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture
def core(tiny_checkpoints):
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_checkpoints["qwen3-qknorm"]),
            num_kv_blocks=64,
            block_size=8,
            max_num_batched_tokens=24,  # the prompts go in chunks
        )
    )
    tokenizer = byte_level_bpe(CORPUS, VOCAB)
    engine.set_tokenizer(tokenizer.to_str(), [0])
    yield engine, tokenizer
    engine.shutdown()


def test_a_step_from_the_decoded_scheduler_output_samples_the_same_tokens(core):
    core, tokenizer = core
    prompt = list(range(5, 25))
    params = {
        "greedy": SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6),
        "penalized": SamplingParams(
            temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, max_tokens=6
        ),
        "choice": SamplingParams(
            temperature=0, max_tokens=6, structured_output=StructuredOutput(choice=CHOICES)
        ),
    }
    for request_id, sampling_params in params.items():
        core.add_request(Request(request_id, list(prompt), sampling_params))
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    num_bitmasks = 0
    for _ in range(12):
        if not core.has_work():
            break
        scheduler_output = core.scheduler.schedule()
        decoded = decoder.decode(msgspec.msgpack.encode(scheduler_output))
        assert decoded == scheduler_output
        num_bitmasks += sum(item.grammar_bitmask is not None for item in decoded.requests)
        from_decoded = core.executor.launch_model(decoded)()
        from_original = core.executor.launch_model(scheduler_output)()  # rewrites the same KV
        assert from_decoded == from_original
        core.scheduler.update_from_output(scheduler_output, from_original)
    assert num_bitmasks > 0
    assert not core.has_work()  # every request finished


def test_the_choice_is_held_by_the_bitmask_alone(core):
    """The decoded copy's bitmask is what holds the output to the choice: the text is one of
    the choices."""
    core, tokenizer = core
    params = SamplingParams(
        temperature=0, max_tokens=8, structured_output=StructuredOutput(choice=CHOICES)
    )
    core.add_request(Request("choice", list(range(5, 15)), params))
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    token_ids = []
    while core.has_work():
        scheduler_output = core.scheduler.schedule()
        decoded = decoder.decode(msgspec.msgpack.encode(scheduler_output))
        for output in core.scheduler.update_from_output(
            scheduler_output, core.executor.launch_model(decoded)()
        ):
            token_ids.extend(output.new_token_ids)
    assert tokenizer.decode(token_ids) in CHOICES

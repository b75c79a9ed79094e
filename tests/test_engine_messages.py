"""The engine core's messages survive msgpack whole: a request's settings and tokens, an engine's
outputs with their logprobs; a structured output crosses with its compiled grammar and is not
compiled again in the engine; a message of the wrong shape is refused."""

from __future__ import annotations

import msgspec
import pytest

from tandem.engine.messages import (
    INPUT_DECODER,
    OUTPUT_DECODER,
    AbortRequests,
    AddRequests,
    EngineInfo,
    Fatal,
    NewRequest,
    Outputs,
    Ready,
    ReleaseRemote,
    encode,
)
from tandem.engine.outputs import EngineCoreOutput, TokenLogprobs
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tandem.kv.params import KVTransferParams


@pytest.mark.parametrize(
    "field, low, high",
    [("seed", -(2**63), 2**63 - 1), ("priority", -(2**63), 2**63 - 1), ("top_k", 0, 2**63 - 1)],
)
def test_integers_at_64_bits_cross_and_one_past_is_refused(field, low, high):
    """A request's integers cross to the engine as msgpack's 64-bit ints: the extremes a request
    may hold arrive whole, one past either end is refused where the request is made (a 400 at
    the server) instead of failing the message (a 500)."""
    for value in (low, high):
        request = Request("r-0", [1, 2], SamplingParams(**{field: value}), max_total_tokens=8)
        message = INPUT_DECODER.decode(encode(AddRequests([NewRequest.of(request)])))
        assert getattr(message.requests[0].to_request().sampling_params, field) == value
    for value in (low - 1, high + 1) if low else (high + 1,):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_a_request_crosses_whole_and_its_grammar_is_not_compiled_again(monkeypatch):
    params = SamplingParams(
        temperature=0.5,
        stop=["\n"],
        logit_bias={7: -2.5},
        structured_output=StructuredOutput(regex="[ab]+"),
        structured_output_after=9,
        seed=3,
    )
    request = Request(
        "r-0",
        [1, 2, 3],
        params,
        eos_token_ids=frozenset({2, 5}),
        max_total_tokens=64,
        kv_transfer_params=KVTransferParams(do_remote_prefill=True, remote_block_ids=[4, 5]),
    )
    request.output_token_ids.append(11)  # a remote prefill's first token

    def no_compiling(self, kind):
        raise AssertionError("the engine compiled a grammar the front end had compiled")

    monkeypatch.setattr(StructuredOutput, "_compile", no_compiling)
    message = INPUT_DECODER.decode(encode(AddRequests([NewRequest.of(request)])))
    (received,) = [new.to_request() for new in message.requests]

    assert received.sampling_params == params
    assert received.sampling_params.structured_output.compiled == params.structured_output.compiled
    assert received.sampling_params.penalizes_history == params.penalizes_history
    for name in (
        "request_id",
        "prompt_token_ids",
        "eos_token_ids",
        "max_total_tokens",
        "arrival_time",
        "kv_transfer_params",
        "output_token_ids",
    ):
        assert getattr(received, name) == getattr(request, name), name


def test_outputs_and_the_engines_info_cross_whole():
    outputs = [
        EngineCoreOutput(
            "r-0",
            [4],
            [TokenLogprobs(4, -0.25, [(4, -0.25), (8, -1.5)], rank=1)],
            finish_reason="stop",
            stop_reason="\n",
            num_prompt_tokens=3,
            kv_transfer_params=KVTransferParams(remote_request_id="r-0", remote_block_ids=[1]),
            prompt_logprobs=[None, TokenLogprobs(2, -3.0, [], rank=7)],
        )
    ]
    stats = {"kv_blocks_used": 3, "requests_running": 1}
    assert OUTPUT_DECODER.decode(encode(Outputs(outputs, stats))) == Outputs(outputs, stats)
    assert OUTPUT_DECODER.decode(encode(Fatal("boom", outputs))) == Fatal("boom", outputs)
    info = EngineInfo("m", 128, 1000, frozenset({0, 2}), kv_port=4242)
    assert OUTPUT_DECODER.decode(encode(Ready(info))) == Ready(info)


def test_messages_of_the_wrong_shape_are_refused():
    assert INPUT_DECODER.decode(encode(AbortRequests(["a"]))) == AbortRequests(["a"])
    with pytest.raises(msgspec.ValidationError):
        INPUT_DECODER.decode(msgspec.msgpack.encode({"type": "abort", "request_ids": "a"}))
    with pytest.raises(msgspec.ValidationError):
        INPUT_DECODER.decode(msgspec.msgpack.encode({"type": "reboot"}))
    with pytest.raises(msgspec.ValidationError):  # an output is not an input
        INPUT_DECODER.decode(encode(Ready(EngineInfo("m", 1, 1, frozenset()))))
    release = ReleaseRemote(KVTransferParams(remote_request_id="x"))
    assert INPUT_DECODER.decode(encode(release)) == release

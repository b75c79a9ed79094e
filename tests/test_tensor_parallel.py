"""Tensor parallelism on the CPU (gloo), against independent references.

* The split rules: which sizes a model takes, which KV heads each rank holds (replicas when
  fewer KV heads than ranks), and a size that cannot work refused at start in one sentence.
* The parallel layers over three ranks (threads of one process, a real gloo group) against
  torch's own linear and embedding on the whole weights, the vocabulary padded.
* Each rank's shard, loaded from lazy safetensors slices, against the checkpoint's tensors.
* Whole engines at TP=2 on tiny random checkpoints (Llama with GQA; Qwen3 with q/k norms and
  one KV head, replicated): greedy output identical to transformers' generate and to TP=1 for 16
  prompts (chunked prefill, prefix-cache hits), seeded and unseeded sampling and logprobs
  identical to TP=1; a GGUF model through the per-rank cache; the HTTP worker
  (`tandem worker --tensor-parallel-size 2`) identical to TP=1 over the OpenAI API.
* Rank 0 takes each rank's replies stage by stage, a fast rank's reply to a later stage kept
  for it (a rank on NCCL alone loads its shard before a slow one has started).
* Failures: a rank that dies ends the engine with a sentence naming it, and the worker exits;
  a step that never returns after the death (as one waiting on the GPU for the dead rank would)
  ends the process with a line saying why, and so does a step waiting on a rank that is alive
  but stopped, at the execute-model timeout; shutdown leaves no rank process behind.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import msgspec
import pytest
import torch
import torch.nn.functional as F
import zmq

from process_tree import alive
from tandem import LLM, SamplingParams
from tandem.attention.base import get_backend
from tandem.distributed.group import TensorParallelGroup, host_store, join_group
from tandem.distributed.sharding import check_tensor_parallel, kv_head_range
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore, FatalEngineError
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.executor.base import ExecutorFailedError
from tandem.executor.multiproc import RankReplies
from tandem.executor.rank import MESSAGE_DECODER, BlockTables, RankReply, for_other_ranks
from tandem.models.config import ModelConfig
from tandem.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.models.loader import iter_safetensors, load_model
from tandem.models.source import resolve_model
from tandem.server.main import ENGINE_DIED_EXIT_CODE
from tiny_gguf import write_tiny_llama_gguf
from tiny_models import assert_same_generations, mixed_sampling, varied_prompts
from worker_fixtures import rank_pids_in_log, running_worker, start_worker

SHAPES = ["llama-gqa", "qwen3-qknorm"]  # 4 heads over 2 KV heads; 4 heads over 1 KV head
NEW_TOKENS = 12


PROMPTS = varied_prompts(seed=33)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(num_kv_blocks=512, block_size=8, max_num_batched_tokens=96)  # chunked prefill


def rank_pids(executor) -> list[int]:
    return [process.pid for process in executor.processes]


def shut_down(llm: LLM) -> None:
    """Shut the engine down; every rank process must be gone."""
    pids = rank_pids(llm.core.executor)
    llm.core.shutdown()
    assert not [pid for pid in pids if alive(pid)]


# --- the split rules --------------------------------------------------------------------------


def model_config(heads: int, kv_heads: int, intermediate: int = 64) -> ModelConfig:
    return ModelConfig.from_hf(
        dict(
            vocab_size=64, hidden_size=heads * 8, intermediate_size=intermediate,
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
        )
    )  # fmt: skip


def test_kv_heads_are_split_or_replicated():
    assert [kv_head_range(8, rank, 4) for rank in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_head_range(2, rank, 4) for rank in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(1, rank, 2) for rank in range(2)] == [(0, 1), (0, 1)]


@pytest.mark.parametrize(
    "heads, kv_heads, intermediate, size, message",
    [
        (6, 2, 64, 4, "does not divide the model's 6 attention heads"),
        (6, 2, 64, 3, "neither divides the model's 2 KV heads nor is a multiple of them"),
        (4, 4, 30, 4, "does not divide the model's MLP size 30"),
    ],
)
def test_a_model_that_cannot_be_split_is_refused(heads, kv_heads, intermediate, size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tensor_parallel(model_config(heads, kv_heads, intermediate), size)
    check_tensor_parallel(model_config(heads, kv_heads, intermediate), 2)  # 2 works


def test_the_engine_refuses_such_a_size_before_starting_ranks(tiny_checkpoints):
    threads_before = threading.active_count()
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        EngineCore(EngineConfig(model=str(tiny_checkpoints["llama-gqa"]), tensor_parallel_size=3))
    assert threading.active_count() == threads_before  # no rank monitor: no rank was started


# --- the parallel layers over a real gloo group -----------------------------------------------


def run_ranks(size: int, work):
    """work(group) on `size` ranks (threads, one gloo group); the results by rank."""
    store, address = host_store(size)
    results: list = [None] * size
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            group = join_group(
                rank, size, address, torch.device("cpu"), store if rank == 0 else None
            )
            results[rank] = work(group)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_parallel_layers_equal_the_whole_layers():
    size, hidden, out, vocab, tokens = 3, 8, 12, 10, 5  # vocabulary rows per rank: 4, 4, 2 + 2
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    column_w, row_w, row_b = rand(out, hidden), rand(hidden, out), rand(hidden)
    embedding, x, wide_x = rand(vocab, hidden), rand(tokens, hidden), rand(tokens, out)
    ids = torch.tensor([0, 3, 4, 8, 9])

    @torch.no_grad()  # loading and running; no_grad holds per thread
    def work(tp: TensorParallelGroup):
        column = ColumnParallelLinear.even(hidden, out, tp=tp)
        column.weight_loader(column.weight, column_w)
        row = RowParallelLinear(out, hidden, bias=True, tp=tp)
        row.weight_loader(row.weight, row_w)
        row.weight_loader(row.bias, row_b)
        embed = VocabParallelEmbedding(vocab, hidden, tp)
        embed.weight_loader(embed.weight, embedding)
        head = ParallelLMHead(hidden, vocab, tp=tp)
        head.weight_loader(head.weight, embedding)
        columns = slice(tp.rank * 4, tp.rank * 4 + 4)
        return column(x), row(wide_x[:, columns]), embed(ids), head.compute(x), head.weight

    results = run_ranks(size, work)
    for rank, (column_y, row_y, embedded, logits, head_weight) in enumerate(results):
        torch.testing.assert_close(column_y, F.linear(x, column_w)[:, rank * 4 : rank * 4 + 4])
        torch.testing.assert_close(row_y, F.linear(wide_x, row_w, row_b))
        torch.testing.assert_close(embedded, F.embedding(ids, embedding))
        if rank == 0:
            torch.testing.assert_close(logits, F.linear(x, embedding))
        else:
            assert logits is None
        assert head_weight.shape == (4, hidden)
    assert torch.equal(results[2][4][2:], torch.zeros(2, hidden))  # the padding rows


def test_a_split_steps_rows_are_padded_and_sliced_by_rank():
    """A sequence-parallel step's rows (`split_sequence`; its products run on CUDA only): 5 rows
    over 2 ranks are 3 a rank, the last slice padded with a zero row; 4 rows need no padding.
    Outside the split nothing is left set."""
    x = torch.arange(10.0).view(5, 2)
    for rank, expected in ((0, x[:3]), (1, torch.cat([x[3:], torch.zeros(1, 2)]))):
        tp = TensorParallelGroup(rank, 2)
        with tp.split_sequence(5):
            assert torch.equal(tp.own_rows(x), expected)
            assert torch.equal(tp.padded_rows(x), torch.cat([x, torch.zeros(1, 2)]))
        assert tp.sequence_split is None
        even = x[:4]
        with tp.split_sequence(4):
            assert tp.padded_rows(even) is even  # no copy
            assert torch.equal(tp.own_rows(even), x[2 * rank : 2 * rank + 2])


def test_qkv_rows_follow_the_heads():
    """6 query heads over 3 ranks, 1 KV head replicated: rank r holds q heads 2r, 2r+1."""
    head_dim, hidden = 2, 4
    q, kv = torch.arange(6 * head_dim * hidden).float().view(12, hidden), torch.ones(2, hidden)
    for rank in range(3):
        tp = TensorParallelGroup(rank, 3)
        qkv = QKVParallelLinear(hidden, head_dim, 6, 1, tp=tp)
        with torch.no_grad():
            for shard, tensor in enumerate((q, kv, 2 * kv)):
                qkv.weight_loader(qkv.weight, tensor, shard)
        expected = torch.cat([q[4 * rank : 4 * rank + 4], kv, 2 * kv])
        assert torch.equal(qkv.weight, expected)
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_heads) == (2, 1, (0, 1))


# --- each rank's shard of a checkpoint --------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_shards_are_the_checkpoints_slices(shape, tiny_checkpoints):
    """Rank 1 of 2 built and loaded alone (loading needs no collective), against the tensors of
    the checkpoint read whole."""
    source = resolve_model(str(tiny_checkpoints[shape]))
    config = source.config
    whole = {name: tensor[:] for name, tensor in iter_safetensors(source.path)}
    backend = get_backend("torch")
    model = load_model(
        source, backend, torch.float32, torch.device("cpu"), tp=TensorParallelGroup(1, 2)
    )
    d = config.head_dim
    kv_start = 1 if config.num_kv_heads == 2 else 0  # one KV head: rank 1 holds a replica
    layout = model.kv_cache_layout()
    assert (layout.kv_head_start, layout.num_kv_heads) == (kv_start, 1)
    layer = "model.layers.1"
    params = dict(model.named_parameters())
    expected_qkv = torch.cat(
        [
            whole[f"{layer}.self_attn.q_proj.weight"][2 * d : 4 * d],
            whole[f"{layer}.self_attn.k_proj.weight"][kv_start * d : (kv_start + 1) * d],
            whole[f"{layer}.self_attn.v_proj.weight"][kv_start * d : (kv_start + 1) * d],
        ]
    )
    assert torch.equal(params[f"{layer}.self_attn.qkv_proj.weight"], expected_qkv)
    o_proj = whole[f"{layer}.self_attn.o_proj.weight"]
    assert torch.equal(params[f"{layer}.self_attn.o_proj.weight"], o_proj[:, 2 * d :])
    half = config.intermediate_size // 2
    gate_up = torch.cat(
        [whole[f"{layer}.mlp.{name}_proj.weight"][half:] for name in ("gate", "up")]
    )
    assert torch.equal(params[f"{layer}.mlp.gate_up_proj.weight"], gate_up)
    embed = whole["model.embed_tokens.weight"]
    assert torch.equal(params["model.embed_tokens.weight"], embed[config.vocab_size // 2 :])
    if shape == "qwen3-qknorm":
        q_norm = whole[f"{layer}.self_attn.q_norm.weight"]
        assert torch.equal(params[f"{layer}.self_attn.q_norm.weight"], q_norm)  # replicated


# --- whole engines ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    """shape -> transformers' greedy continuation of every prompt."""
    from transformers import AutoModelForCausalLM

    result = {}
    for shape in SHAPES:
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[shape], dtype=torch.float32)
        result[shape] = []
        for prompt in PROMPTS:
            generated = model.eval().generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            result[shape].append(generated[0, len(prompt) :].tolist())
    return result


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """shape -> (TP=1 engine, TP=2 engine), the same settings."""
    result = {}
    for shape in SHAPES:
        model = str(tiny_checkpoints[shape])
        result[shape] = (LLM(model, **ENGINE), LLM(model, **ENGINE, tensor_parallel_size=2))
    yield result
    for _, tp2 in result.values():
        shut_down(tp2)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_matches_transformers_and_tp1(shape, engines, references):
    tp1, tp2 = engines[shape]
    assert tp2.core.kv_spec.kv_head_range == (0, 1)  # rank 0's: its one KV head
    assert tp1.core.kv_spec.kv_head_range == (0, tp1.core.model_config.num_kv_heads)
    got = token_ids(tp2.generate(PROMPTS, GREEDY))
    for index, (tokens, expected) in enumerate(zip(got, references[shape], strict=True)):
        assert tokens == expected, f"prompt {index} diverged from transformers"
    assert got == token_ids(tp1.generate(PROMPTS, GREEDY))
    kv = tp2.core.kv_manager
    assert kv.num_prefix_hits > 0 and kv.num_used_blocks == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_sampling_and_logprobs_match_tp1(shape, engines):
    """Seeded requests, requests drawn from the engine's seeded generator, logprobs, penalties
    on the tokens so far (which only rank 0 is sent) and prompt logprobs: the same at TP=2 as at
    TP=1 (logprobs within float32 tolerance)."""
    params = mixed_sampling(NEW_TOKENS, seeded=False)
    tp1, tp2 = engines[shape]
    got = tp2.generate(PROMPTS, params)
    assert_same_generations(got, tp1.generate(PROMPTS, params), tolerance=1e-4)
    assert len(got[-1].prompt_logprobs) == len(PROMPTS[-1])


def test_the_other_ranks_get_no_sampling_inputs():
    """for_other_ranks, through msgpack: no sampling parameters, output tokens or grammar mask,
    and the prompt and its logprobs count only while a step's tokens reach into the prompt of a
    request that wants its logprobs; what the forward reads arrives as rank 0 has it."""

    def scheduled(rid: str, start: int, prompt_logprobs: int | None) -> ScheduledRequest:
        params = SamplingParams(max_tokens=4, temperature=0.5, prompt_logprobs=prompt_logprobs)
        return ScheduledRequest(
            rid, [7, 8], start, [0, 1], True, params, 3, [1, 2, 3, 4], [9], b"\x01\x00\x00\x00"
        )

    step = SchedulerOutput([scheduled("a", 2, 1), scheduled("b", 4, 1), scheduled("c", 0, None)], 6)
    message = msgspec.msgpack.encode(for_other_ranks(step, BlockTables()))
    restored = BlockTables().restore(MESSAGE_DECODER.decode(message))
    got = restored.requests
    assert [r.prompt_token_ids for r in got] == [[1, 2, 3, 4], [], []]
    assert [r.sampling_params.prompt_logprobs for r in got] == [1, None, None]
    assert all(r.sampling_params.temperature == 1.0 for r in got)  # not sent: the defaults
    assert all(r.output_token_ids == [] and r.grammar_bitmask is None for r in got)
    forward = [(r.request_id, r.token_ids, r.start_position, r.block_ids, r.sample) for r in got]
    assert forward == [(r, [7, 8], s, [0, 1], True) for r, s in (("a", 2), ("b", 4), ("c", 0))]
    assert [r.output_index for r in got] == [3, 3, 3] and restored.num_batched_tokens == 6
    assert step.requests[2].output_token_ids == [9]  # rank 0's own step untouched


def test_the_other_ranks_are_sent_only_new_block_ids_and_rebuild_every_table():
    """Step messages through msgpack, as the ranks get them: the tables another rank rebuilds
    equal rank 0's at every step, while a request that ran the step before is sent only its new
    block ids; a new request, one resumed after a preemption (other blocks, even as many) and
    one left out of a step are sent whole; a gone request is forgotten on both ends."""
    encoder = msgspec.msgpack.Encoder()

    def step(tables: dict[str, list[int]]) -> SchedulerOutput:
        requests = [
            ScheduledRequest(rid, [5], 0, list(ids), True, SamplingParams(), 0)
            for rid, ids in tables.items()
        ]
        return SchedulerOutput(requests, len(requests))

    steps = [
        {"a": [3, 4], "b": [9]},
        {"a": [3, 4], "b": [9, 10]},  # decode steps: nothing or one block more
        {"a": [3, 4, 7], "b": [9, 10], "c": [1, 2, 8]},  # c is new
        {"a": [11, 12, 13], "c": [1, 2, 8, 14]},  # a preempted and resumed; b left out
        {"a": [11, 12, 13], "b": [9, 10, 15], "c": [1, 2, 8, 14]},  # b back: sent whole
        {"c": [1, 2, 8, 14, 16]},
    ]
    rank0, other = BlockTables(), BlockTables()
    sent_counts = []
    for tables in steps:
        message = MESSAGE_DECODER.decode(encoder.encode(for_other_ranks(step(tables), rank0)))
        sent_counts.append([len(r.new_block_ids) for r in message.requests])
        restored = other.restore(message)
        assert {r.request_id: r.block_ids for r in restored.requests} == tables
        assert rank0.tables == other.tables == tables
    assert sent_counts == [[2, 1], [0, 1], [1, 0, 3], [3, 1], [0, 3, 0], [1]]


def test_a_gguf_model_loads_per_rank_through_the_cache(tmp_path, monkeypatch):
    """The tiny GGUF Llama (quantized, tied embeddings): TP=2 greedy equals TP=1, and each rank
    caches its own parameters."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    prompts = [prompt[:40] for prompt in PROMPTS[:6]]
    prompts = [[min(token, 250) for token in prompt] for prompt in prompts]
    tp1 = LLM(str(path), num_kv_blocks=64)
    expected = token_ids(tp1.generate(prompts, GREEDY))
    tp2 = LLM(str(path), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert token_ids(tp2.generate(prompts, GREEDY)) == expected
    finally:
        shut_down(tp2)
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("model.*.safetensors"))
    shards = ["model.float32.tp2-rank0.safetensors", "model.float32.tp2-rank1.safetensors"]
    assert cached == ["model.float32.safetensors", *shards]


@pytest.mark.slow  # 25 s; the tables' bookkeeping is checked message by message by default
def test_preempted_requests_resume_on_every_rank_with_their_new_blocks(
    tiny_checkpoints, references
):
    """A KV cache too small for the batch: requests are preempted and resume on other blocks,
    which the other rank must be sent whole (BlockTables); the greedy tokens are still
    transformers'."""
    model = str(tiny_checkpoints["llama-gqa"])
    tight = LLM(model, **dict(ENGINE, num_kv_blocks=40), tensor_parallel_size=2)
    try:
        assert token_ids(tight.generate(PROMPTS, GREEDY)) == references["llama-gqa"]
        assert tight.core.scheduler.num_preemptions > 0
        assert tight.core.kv_manager.num_used_blocks == 0
    finally:
        shut_down(tight)


def test_an_engine_dropped_without_shutdown_tells_its_ranks_to_stop(tiny_checkpoints):
    """An offline engine that is never shut down (a script that ends after its generate): its
    ranks are told to stop and exit by themselves (code 0), not killed after the stop timeout,
    which would hold the interpreter's exit for seconds."""
    llm = LLM(str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=64, tensor_parallel_size=2)
    assert token_ids(llm.generate([[5, 6, 7]], GREEDY))
    processes = list(llm.core.executor.processes)
    del llm
    gc.collect()
    assert [process.returncode for process in processes] == [0]


def test_a_stage_takes_each_ranks_own_reply_when_one_rank_runs_ahead():
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind("inproc://replies")
    ranks = {rank: context.socket(zmq.PUSH) for rank in (1, 2)}
    for socket in ranks.values():
        socket.connect("inproc://replies")

    def say(rank: int, **fields) -> None:
        ranks[rank].send(msgspec.msgpack.encode(RankReply(rank, **fields)))

    replies = RankReplies(inbox, 3)
    say(1)  # rank 1 started
    say(1, num_blocks=1)  # and loaded (a stand-in mark for its second reply)
    say(2)  # rank 2 only started
    started = replies.next_from_each("start", lambda: None)
    assert [(r.rank, r.num_blocks) for r in started] == [(1, 0), (2, 0)]
    say(2, num_blocks=1)
    loaded = replies.next_from_each("load", lambda: None)
    assert [(r.rank, r.num_blocks) for r in loaded] == [(1, 1), (2, 1)]
    say(2, error="out of memory")  # before rank 1 answers: raises at once
    with pytest.raises(RuntimeError, match="rank 2 could not size its KV cache: out of memory"):
        replies.next_from_each("size its KV cache", lambda: None)
    context.destroy(linger=0)


def test_a_rank_that_dies_ends_the_engine(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=64, tensor_parallel_size=2)
    assert token_ids(llm.generate([[5, 6, 7]], GREEDY))
    (pid,) = rank_pids(llm.core.executor)
    os.kill(pid, signal.SIGKILL)
    # Found out before the next step (ExecutorFailedError) or in it (its collective fails, and
    # the step's error is fatal): either way the engine ends with the same sentence.
    deadline = time.monotonic() + 10
    with pytest.raises(
        (ExecutorFailedError, FatalEngineError),
        match=rf"tensor-parallel rank 1 \(pid {pid}\) exited with code -9",
    ):
        while time.monotonic() < deadline:
            llm.generate([[5, 6, 7]], GREEDY)
    shut_down(llm)


STUCK_STEP = textwrap.dedent(
    """
    import os, signal, sys, time
    from tandem import LLM, SamplingParams
    from tandem.executor import multiproc

    multiproc.STUCK_STEP_EXIT_S = 1.0
    llm = LLM(sys.argv[1], num_kv_blocks=64, tensor_parallel_size=2)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([[5, 6, 7]], greedy)
    (rank,) = llm.core.executor.processes

    def stuck_step(scheduler_output):
        # the rank dies in the step, which never returns, as one whose kernel waits on the
        # GPU for the dead rank
        os.kill(rank.pid, signal.SIGKILL)
        time.sleep(600)

    llm.core.executor.rank.runner.launch = stuck_step
    llm.generate([[5, 6, 7]], greedy)
    print("the step returned")
    """
)


def test_a_step_still_running_after_a_ranks_death_ends_the_process(tiny_checkpoints):
    """The watchdog, not the interpreter, ends the process: the step sleeps in the interpreter
    here, but on a GPU it waits in a kernel, with whatever else waits for the GPU."""
    model = str(tiny_checkpoints["llama-gqa"])
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STUCK_STEP, model], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "tensor-parallel rank 1" in result.stderr and "exited with code -9" in result.stderr
    assert "if the engine's step has not returned 1 s after tensor-parallel rank 1" in result.stderr
    assert "Timeout (0:00:01)!" in result.stderr and "in stuck_step" in result.stderr
    assert "the step returned" not in result.stdout
    assert time.monotonic() - started < 90


STOPPED_RANK = textwrap.dedent(
    """
    import os, signal, sys
    from tandem import LLM, SamplingParams

    llm = LLM(sys.argv[1], num_kv_blocks=64, tensor_parallel_size=2)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([[5, 6, 7]], greedy)
    (rank,) = llm.core.executor.processes
    print(rank.pid, flush=True)
    os.kill(rank.pid, signal.SIGSTOP)  # alive, but its side of every collective never comes
    llm.generate([[5, 6, 7]], greedy)
    print("the step returned")
    """
)


def test_a_step_that_waits_on_a_stopped_rank_ends_at_the_timeout(tiny_checkpoints):
    """No rank dies: rank 0's step waits in gloo's sum (whose own timeout is 120 s) for a rank
    that is stopped, as a step waits on a GPU whose peer kernel never comes. The step's timeout
    ends the process, naming its cause, with the stack of the wait."""
    model = str(tiny_checkpoints["llama-gqa"])
    env = dict(os.environ, TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS="2")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STOPPED_RANK, model], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(
        r"the engine's step has run for \d+ s \(TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS=2\)",
        result.stderr,
    ), result.stderr[-3000:]
    assert "in all_reduce" in result.stderr, result.stderr[-3000:]
    assert "the step returned" not in result.stdout
    assert time.monotonic() - started < 60
    rank_pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank_pid)  # killed with its parent, stopped or not


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_step_timeout_that_is_not_a_positive_number_is_refused(
    value, tiny_checkpoints, monkeypatch
):
    monkeypatch.setenv("TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS", value)
    with pytest.raises(ValueError, match="TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS must be a number"):
        LLM(str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=64, tensor_parallel_size=2)


# --- the HTTP worker --------------------------------------------------------------------------


def completions(url: str, prompts: list[list[int]]) -> list[list[int]]:
    result = []
    with httpx.Client(timeout=60) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
            response = client.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            result.append(response.json()["choices"][0]["token_ids"])
    return result


def test_the_worker_at_tp2_answers_as_tp1_and_stops_its_ranks(tiny_checkpoints, engines, tmp_path):
    model = str(tiny_checkpoints["llama-gqa"])
    tp1, _ = engines["llama-gqa"]
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = PROMPTS[::2]
    expected = token_ids(tp1.generate(prompts, params))
    flags = ("--tensor-parallel-size", "2", "--num-kv-blocks", "256", "--device", "cpu")
    with running_worker(tmp_path, *flags, model=model) as worker:
        assert completions(worker.url, prompts) == expected
        pids = rank_pids_in_log(worker.log_tail(100_000))
        worker.send_signal(signal.SIGTERM)
        assert worker.process.wait(30) == 0
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.slow  # 30 s; by default a rank's death ends the engine (the test above)
def test_a_worker_whose_rank_dies_exits_naming_it(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints["qwen3-qknorm"])
    worker = start_worker(tmp_path, "-tp", "2", "--num-kv-blocks", "64", model=model)
    try:
        worker.wait_healthy()
        engine_pid, rank_pid = rank_pids_in_log(worker.log_tail(100_000))
        os.kill(rank_pid, signal.SIGKILL)
        assert worker.process.wait(30) == ENGINE_DIED_EXIT_CODE
        log = worker.log_tail(100_000)
        assert f"tensor-parallel rank 1 (pid {rank_pid}) exited with code -9" in log, log
        deadline = time.monotonic() + 10
        while alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(engine_pid)
    finally:
        worker.stop()

"""Tensor parallelism on two CUDA GPUs (NCCL): the group's sums (peer memory for small ones,
NCCL for the rest) equal to the sum of the inputs, eager and in a CUDA graph; the sum fused with
the residual add and RMSNorm equal to the sum of the inputs then the add-and-norm kernel, at 2
ranks, for every row count it takes, eager and in a CUDA graph; a prompt step
run sequence-parallel identical to transformers, TP=1 and TP=2 unsplit; greedy output at
TP=2 identical to transformers and to TP=1, with the decode CUDA graphs (their collectives
captured) and without, and with every all-reduce on NCCL (these two at TP=4 too, given four
GPUs); and PD over tcp from a prefill worker at TP=1 to a decode worker at TP=2, and from a
TP=2 prefill worker whose prompt steps split to a TP=1 decode worker, token-identical to a
colocated worker, with nothing held afterwards; a TP=2 worker whose rank 1 is killed, or
stopped, while it decodes streams ends them with an error and exits. Skipped without two
GPUs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch
import torch.multiprocessing as mp

from pd_fixtures import assert_nothing_held
from process_tree import alive
from tandem import LLM, SamplingParams
from tandem.distributed import group
from tandem.distributed.group import (
    FUSED_ADD_NORM_MAX_RANKS,
    PEER_MEMORY_MAX_BYTES,
    SEQUENCE_SPLIT_MAX_RANKS,
    SEQUENCE_SPLIT_MIN_TOKENS,
    host_store,
    join_group,
)
from tandem.executor.multiproc import STUCK_STEP_EXIT_S
from tandem.server.main import ENGINE_DIED_EXIT_CODE
from test_cuda_engine import PROMPTS, greedy_body, hf_greedy
from worker_fixtures import rank_pids_in_log, running_worker, start_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 2048}
HIDDEN = 4096
FOUR_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
# rows of bf16 sums: a decode step's (peer memory) and a prompt's (over PEER_MEMORY_MAX_BYTES: NCCL)
SUM_ROWS = [1, 64, 1024]


def rank_input(rank: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank * 1000 + rows)
    return torch.randn(rows, HIDDEN, generator=generator).to(torch.bfloat16)


def run_rank(target, rank: int, size: int, address, results) -> None:
    """In rank `rank`'s process: target(rank, size, address), or its error's repr."""
    try:
        results.put((rank, target(rank, size, address)))
    except Exception as exc:
        results.put((rank, repr(exc)))


def on_ranks(target, size: int) -> dict:
    """target(rank, size, address) in a spawned process per rank on GPUs 0 to size - 1,
    which rendezvous at `address`: {rank: its result, or its error's repr}."""
    context = mp.get_context("spawn")
    results = context.Queue()
    store, address = host_store(size)
    ranks = [
        context.Process(target=run_rank, args=(target, rank, size, address, results))
        for rank in range(size)
    ]
    for process in ranks:
        process.start()
    by_rank = dict(results.get(timeout=180) for _ in ranks)
    for process in ranks:
        process.join(60)
    del store
    return by_rank


def rank_sums(rank: int, size: int, address) -> tuple:
    """On GPU `rank`: the group's sum of every SUM_ROWS input, eager, and the 1-row sum taken
    eight times over in one CUDA graph (each sum the next one's input)."""
    torch.cuda.set_device(rank)
    tp = join_group(rank, size, address, torch.device("cuda", rank), None, torch.bfloat16)
    # float32 numpy (exact for bf16): plain pickles, not tensors shared through a descriptor
    # that the child's exit may close before the parent takes it
    sums = {
        rows: tp.all_reduce(rank_input(rank, rows).cuda()).float().cpu().numpy()
        for rows in SUM_ROWS
    }
    x = rank_input(rank, 1).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        tp.all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(8):
            y = tp.all_reduce(y)
    graph.replay()
    return tp.peer_memory is not None, sums, y.float().cpu().numpy()


def test_the_groups_sums_equal_the_sum_of_the_inputs():
    assert SUM_ROWS[-1] * HIDDEN * 2 > PEER_MEMORY_MAX_BYTES  # the last sum goes through NCCL
    for result in on_ranks(rank_sums, 2).values():
        assert isinstance(result, tuple), result  # else the error
        peer_memory, sums, chained = result
        assert peer_memory is True
        for rows in SUM_ROWS:  # two bf16 addends: every path rounds their exact sum alike
            expected = (rank_input(0, rows).float() + rank_input(1, rows).float()).bfloat16()
            assert torch.equal(torch.from_numpy(sums[rows]).bfloat16(), expected), rows
        expected = rank_input(0, 1).float() + rank_input(1, 1).float()
        for _ in range(7):
            expected = expected.bfloat16().float() * 2
        assert torch.equal(torch.from_numpy(chained).bfloat16(), expected.bfloat16())


# rows of the fused sum, add and norm: odd and even, up to its 128 programs' one each, 1 MiB last
FUSED_ROWS = [1, 3, 32, 33, 1, 64, 2, 128]
FUSED_GRAPH_REPLAYS = 4
EPS = 1e-5


def fused_inputs(rank: int, call: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s partial sums for call `call`, and the residual stream (the same on every
    rank)."""
    partial = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rank * 97 + call))
    residual = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(5000 + call))
    return partial.to(torch.bfloat16), residual.to(torch.bfloat16)


def rank_fused_sums(rank: int, size: int, address) -> list:
    """On GPU `rank` of `size`: each FUSED_ROWS call's (out, residual) and what the add-and-norm
    kernel makes of the inputs' sum (gathered, summed in fp32 in rank order); then the same for
    one call captured in a CUDA graph and replayed on new inputs, an eager call between
    replays."""
    from tandem.models.triton_ops import add_rms_norm

    torch.cuda.set_device(rank)
    tp = join_group(rank, size, address, torch.device("cuda", rank), None, torch.bfloat16)
    weight = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    calls = []

    def checked(call: int, partial: torch.Tensor, residual: torch.Tensor, out: torch.Tensor):
        gathered = [torch.empty_like(partial) for _ in range(size)]
        tp.process_group.allgather([gathered], [partial]).wait()
        summed = torch.stack(gathered).float().sum(0).bfloat16()
        expected_residual = fused_inputs(rank, call, partial.shape[0])[1].cuda()
        expected = add_rms_norm(summed, expected_residual, weight, EPS)
        calls.append([t.float().cpu().numpy() for t in (out, residual, expected)])

    for call, rows in enumerate(FUSED_ROWS):
        partial, residual = (t.cuda() for t in fused_inputs(rank, call, rows))
        assert tp.fuses_add_rms_norm(partial)
        checked(call, partial, residual, tp.all_reduce_add_rms_norm(partial, residual, weight, EPS))
    assert not tp.fuses_add_rms_norm(torch.empty(129, HIDDEN, dtype=torch.bfloat16, device="cuda"))
    partial, residual = (t.cuda() for t in fused_inputs(rank, 0, 1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        tp.all_reduce_add_rms_norm(partial, residual, weight, EPS)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce_add_rms_norm(partial, residual, weight, EPS)
    for replay in range(FUSED_GRAPH_REPLAYS):
        call = len(FUSED_ROWS) + replay
        for static, new in zip((partial, residual), fused_inputs(rank, call, 1), strict=True):
            static.copy_(new)
        graph.replay()
        checked(call, partial, residual, out)
        between = [t.cuda() for t in fused_inputs(rank, 0, 8)]
        tp.all_reduce_add_rms_norm(*between, weight, EPS)
    torch.cuda.synchronize()
    return calls


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=FOUR_GPUS)])
def test_the_sum_fused_with_add_and_norm_equals_the_sum_then_the_norm(size):
    assert size <= FUSED_ADD_NORM_MAX_RANKS
    by_rank = on_ranks(rank_fused_sums, size)
    rows = FUSED_ROWS + [1] * FUSED_GRAPH_REPLAYS
    for rank, calls in by_rank.items():
        assert isinstance(calls, list), calls  # else the error
        assert len(calls) == len(rows)
        for call, (out, residual, expected) in enumerate(calls):
            partials = [fused_inputs(r, call, rows[call])[0].float() for r in range(size)]
            summed = torch.stack(partials).sum(0).bfloat16().float()
            stream = (summed + fused_inputs(rank, call, rows[call])[1].float()).bfloat16()
            assert torch.equal(torch.from_numpy(residual).bfloat16(), stream), (rank, call)
            assert (out == expected).all(), (rank, call)  # the same bits as sum, then norm
            assert (out == by_rank[0][call][0]).all(), (rank, call)  # and on every rank


# Two batches of prompts, each one step over SEQUENCE_SPLIT_MIN_TOKENS with an odd token count.
SPLIT_BATCHES = [(900, 800, 451), (960, 960, 960, 721)]
SPLIT_ENGINE = {**ENGINE, "max_num_batched_tokens": 4096, "max_model_len": 1024}


def split_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randint(0, 512, (n,), generator=generator).tolist()
        for batch in SPLIT_BATCHES
        for n in batch
    ]


def split_greedy(model: str, size: int, results) -> None:
    """In a process of its own (peer memory, which the split needs, goes to a process's first
    group): TP=size's greedy output of `split_prompts`, a batch at a time, and the steps it
    split; or the error."""
    try:
        tpn = LLM(model, **SPLIT_ENGINE, tensor_parallel_size=size)
        tp = tpn.core.executor.rank.model.tp  # rank 0's model's group
        splits, split_sequence = [], tp.split_sequence

        def counted_split(num_tokens: int):
            splits.append(num_tokens)
            return split_sequence(num_tokens)

        tp.split_sequence = counted_split
        prompts, got = split_prompts(), []
        first = len(SPLIT_BATCHES[0])
        for batch in (prompts[:first], prompts[first:]):
            got += [list(o.outputs[0].token_ids) for o in tpn.generate(batch, GREEDY)]
        tpn.core.shutdown()
        results.put((splits, got))
    except Exception as exc:
        results.put((repr(exc), None))


@pytest.mark.parametrize(
    ("shape", "size"),
    [
        ("llama-gqa", 2),
        ("qwen2-bias", 2),
        ("qwen3-qknorm", 2),
        pytest.param("llama-gqa", 4, marks=FOUR_GPUS),
        pytest.param("qwen3-qknorm", 4, marks=FOUR_GPUS),
    ],
)
def test_a_prompt_step_split_over_the_ranks_matches_tp1(shape, size, tiny_checkpoints):
    """Steps of prompts at TP=2 run sequence-parallel (each rank its slice of the tokens
    between the layers, an odd count padded): greedy output identical to transformers', TP=1's
    and TP=2's without the split (every all-reduce on NCCL). At 4 ranks, past
    SEQUENCE_SPLIT_MAX_RANKS, they do not split, and the output is the same."""
    model, prompts = str(tiny_checkpoints[shape]), split_prompts()
    assert min(map(sum, SPLIT_BATCHES)) >= SEQUENCE_SPLIT_MIN_TOKENS
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=split_greedy, args=(model, size, results))
    child.start()
    splits, got = results.get(timeout=300)
    child.join(60)
    assert splits == ([2151, 3601] if size <= SEQUENCE_SPLIT_MAX_RANKS else []), splits
    expected, hf_model = hf_greedy(model, prompts, torch.float32)
    del hf_model
    assert got == expected
    for settings in ({}, {"tensor_parallel_size": size, "disable_custom_all_reduce": True}):
        reference = LLM(model, **SPLIT_ENGINE, **settings)
        assert [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)] == got
        reference.core.shutdown()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qknorm"])
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=FOUR_GPUS)])
def test_tp_on_gpus_matches_transformers_and_tp1(size, shape, eager, tiny_checkpoints):
    model = str(tiny_checkpoints[shape])
    prompts = PROMPTS[:16]
    expected, hf_model = hf_greedy(model, prompts, torch.float32)
    del hf_model
    first_group = not group._peer_memory_set_up  # peer memory in a process's first group only
    tpn = LLM(model, **ENGINE, tensor_parallel_size=size, enforce_eager=eager)
    assert (tpn.core.executor.rank.runner.decode_graphs is None) == eager
    assert (tpn.core.executor.tp.peer_memory is not None) == first_group
    fused = first_group and size <= FUSED_ADD_NORM_MAX_RANKS
    assert (tpn.core.executor.tp.sum_add_norm is not None) == fused
    got = [o.outputs[0].token_ids for o in tpn.generate(prompts, GREEDY)]
    tpn.core.shutdown()
    assert got == expected
    tp1 = LLM(model, **ENGINE)
    assert [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)] == got
    tp1.core.shutdown()
    nccl = LLM(model, **ENGINE, tensor_parallel_size=size, disable_custom_all_reduce=True)
    assert nccl.core.executor.tp.peer_memory is None
    assert [o.outputs[0].token_ids for o in nccl.generate(prompts, GREEDY)] == got
    nccl.core.shutdown()


def long_context_copy(checkpoint, directory):
    """The checkpoint with a 4096-token context (its rotary embedding has no learned limit), so
    that one prompt makes a step long enough to split."""
    directory.mkdir()
    for file in checkpoint.iterdir():
        if file.name != "config.json":
            (directory / file.name).symlink_to(file)
    config = json.loads((checkpoint / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=4096)))
    return directory


def long_prompts() -> list[list[int]]:
    """Two prompts over SEQUENCE_SPLIT_MIN_TOKENS, of odd lengths."""
    generator = torch.Generator().manual_seed(12)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (2101, 2877)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "split-tp2-to-tp1"]
)
def test_pd_between_tp_sizes_matches_colocated(prefill_tp, decode_tp, tmp_path, tiny_checkpoints):
    """1P + 1D over tcp on GPUs 0 and 1, the legs driven directly: each decode rank installs
    its KV-head range before decoding. From TP=1 to TP=2, the 16 short prompts; from TP=2 to
    TP=1, prompts of over 2048 tokens, each one step that the prefill worker's ranks run
    sequence-parallel (its engine process's first group has peer memory; the split's taking is
    asserted at the engine level above), so the decode reads the KV a split step wrote."""
    checkpoint, prompts = tiny_checkpoints["llama-gqa"], PROMPTS[:16]
    common = ["--dtype", "float32", "--num-kv-blocks", "2048", "--kv-transport", "tcp"]
    if prefill_tp == 2:
        checkpoint, prompts = long_context_copy(checkpoint, tmp_path / "long"), long_prompts()
        common += ["--max-model-len", "4096", "--max-num-batched-tokens", "4096"]
    model = str(checkpoint)
    with (
        running_worker(tmp_path, "--device", "cuda:0", *common, model=model) as both,
        running_worker(
            tmp_path,
            "--role",
            "prefill",
            "--device",
            "cuda:0",
            "-tp",
            str(prefill_tp),
            *common,
            model=model,
        ) as prefill,
        running_worker(
            tmp_path,
            "--role",
            "decode",
            "--device",
            "cuda:0",
            "-tp",
            str(decode_tp),
            *common,
            model=model,
        ) as decode,
    ):
        for prompt in prompts:
            body = greedy_body(prompt)
            colocated = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60).json()
            first = httpx.post(
                f"{prefill.url}/v1/completions",
                json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                timeout=60,
            ).json()
            params = first["kv_transfer_params"]
            assert params["tp_size"] == prefill_tp
            answer = httpx.post(
                f"{decode.url}/v1/completions",
                json=dict(body, kv_transfer_params=params),
                timeout=60,
            ).json()
            assert answer["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
        assert_nothing_held(prefill, decode)


STREAMS = 4
STREAM_TOKENS = 3500  # with a prompt of under 300 tokens, within the 4096-token context


def stream_events(url: str, prompt: list[int], max_tokens: int, seen: list) -> None:
    """A streamed completion's data events, appended to `seen` as they come, until it ends."""
    body = dict(greedy_body(prompt), max_tokens=max_tokens, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(line.removeprefix("data: "))


STEP_TIMEOUT_S = 10


@pytest.mark.parametrize(
    "signal_to_rank", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"]
)
def test_a_rank_killed_or_stopped_while_decoding_ends_the_worker(
    signal_to_rank, tmp_path, tiny_checkpoints, monkeypatch
):
    """A TP=2 worker decoding streams with its CUDA graphs in bf16 (every sum in a peer-memory
    kernel that waits for the other rank's values on the GPU): rank 1 SIGKILLed, or SIGSTOPped
    (alive, so no death is seen), mid-stream. Rank 0's step cannot return, so its process exits
    STUCK_STEP_EXIT_S after the death, or at the execute-model timeout; each stream then ends
    with an error event, the worker exits with ENGINE_DIED_EXIT_CODE, and no process is left."""
    monkeypatch.setenv("TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_TIMEOUT_S))
    model = str(long_context_copy(tiny_checkpoints["llama-gqa"], tmp_path / "long"))
    flags = ["--device", "cuda:0", "-tp", "2", "--dtype", "bfloat16", "--max-model-len", "4096"]
    worker = start_worker(tmp_path, *flags, "--num-kv-blocks", "2048", model=model)
    try:
        worker.wait_healthy()
        engine_pid, rank_pid = rank_pids_in_log(worker.log_tail(100_000))
        streams = [[] for _ in range(STREAMS)]
        readers = [
            threading.Thread(target=stream_events, args=(worker.url, prompt, STREAM_TOKENS, seen))
            for prompt, seen in zip(PROMPTS, streams, strict=False)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 60
        while min(map(len, streams)) < 20:  # every stream is decoding
            assert time.monotonic() < deadline, ([len(seen) for seen in streams], worker.log_tail())
            time.sleep(0.01)
        os.kill(rank_pid, signal_to_rank)
        signalled = time.monotonic()
        code = worker.process.wait(STUCK_STEP_EXIT_S + 60)
        exited_s = time.monotonic() - signalled
        log = worker.log_tail(100_000)
        assert code == ENGINE_DIED_EXIT_CODE, log
        if signal_to_rank == signal.SIGKILL:
            assert f"tensor-parallel rank 1 (pid {rank_pid}) exited with code -9" in log, log
            # the watchdog's dump: the step did not return
            assert f"Timeout (0:00:{STUCK_STEP_EXIT_S:02.0f})!" in log, log
        else:
            assert "the engine's step has run for" in log, log
            assert STEP_TIMEOUT_S <= exited_s < STEP_TIMEOUT_S + 30, log
        print(f"the worker exited {exited_s:.1f} s after rank 1 was sent {signal_to_rank.name}")
        for reader in readers:
            reader.join(10)
        assert not any(reader.is_alive() for reader in readers), "a stream hung"
        for seen in streams:  # cut short: an error event, then the end of the stream
            assert seen[-1] == "[DONE]" and "error" in json.loads(seen[-2]), seen[-2:]
            assert len(seen) < STREAM_TOKENS
        deadline = time.monotonic() + 10  # a stopped rank is killed with the engine's process
        while (alive(engine_pid) or alive(rank_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(engine_pid) and not alive(rank_pid)
    finally:
        worker.stop()

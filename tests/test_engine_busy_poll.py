"""The engine loop's wait for input: up to its spin deadline it polls without sleeping (its
thread keeps a CPU busy), after it sleeps in the poll; either way it returns as soon as input
arrives, and not before the timeout when none does."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zmq

from tandem.engine.config import EngineConfig
from tandem.engine.core_process import poll_events
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from worker_fixtures import running_worker

WAIT_MS = 200


@pytest.fixture
def pair():
    """A PUSH socket and a poller on the PULL socket it feeds."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://busy-poll")
    push.connect("inproc://busy-poll")
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    yield push, poller, pull
    context.destroy(linger=0)


class RecordingPoller:
    """A poller that records the timeout of each poll: a spinning wait polls with 0 again and
    again, a sleeping one waits in a poll with a timeout (how much CPU each then uses is the
    operating system's, and on a loaded machine not this test's to tell)."""

    def __init__(self, poller: zmq.Poller) -> None:
        self.poller = poller
        self.timeouts: list[int] = []

    def poll(self, timeout: int):
        self.timeouts.append(timeout)
        return self.poller.poll(timeout)


def timed_wait(poller, spin_s: float, wait_ms: int = WAIT_MS) -> tuple[dict, float, list[int]]:
    """poll_events for wait_ms: its events, wall time and the timeouts it polled with."""
    recording = RecordingPoller(poller)
    wall = time.monotonic()
    events = poll_events(recording, wait_ms, time.monotonic() + spin_s)
    return events, time.monotonic() - wall, recording.timeouts


def test_a_spinning_wait_polls_without_sleeping_and_a_sleeping_one_sleeps(pair):
    _, poller, _ = pair
    events, wall, timeouts = timed_wait(poller, spin_s=10.0)
    assert events == {}
    assert wall >= WAIT_MS / 1000
    assert len(timeouts) > 1 and set(timeouts) == {0}

    events, wall, timeouts = timed_wait(poller, spin_s=0.0)
    assert events == {}
    assert wall >= 0.9 * WAIT_MS / 1000  # zmq's own poll timeout, in whole milliseconds
    assert timeouts == [WAIT_MS]


def test_spinning_ends_at_its_deadline_and_the_rest_of_the_wait_sleeps(pair):
    _, poller, _ = pair
    events, wall, timeouts = timed_wait(poller, spin_s=0.05)
    assert events == {}
    assert wall >= 0.9 * WAIT_MS / 1000
    # 50 ms of spinning, then about 150 ms asleep (none where a stall of the machine took it)
    *spinning, last = timeouts
    assert spinning and set(spinning) == {0}
    assert last <= WAIT_MS - 50


@pytest.mark.parametrize("spin_s", [10.0, 0.0])
def test_input_ends_the_wait_at_once(pair, spin_s):
    """Input sent 20 ms in ends a 5-second wait long before its timeout (the margin is for a
    loaded machine, where the sending thread may wait a while for the GIL or a CPU)."""
    push, poller, pull = pair
    wait_ms = 5000
    sender = threading.Timer(0.02, push.send, args=(b"add",))
    sender.start()
    events, wall, _ = timed_wait(poller, spin_s, wait_ms)
    sender.join()
    assert pull in events and pull.recv() == b"add"
    assert wall < wait_ms / 1000 / 2


def test_busy_polling_is_off_on_the_cpu_by_default_and_checked():
    assert EngineConfig(device="cpu").resolved().busy_poll_s == 0.0
    assert EngineConfig(device="cpu", busy_poll_s=0.5).resolved().busy_poll_s == 0.5
    with pytest.raises(ValueError, match="busy_poll_s"):
        EngineConfig(device="cpu", busy_poll_s=-1.0).resolved()


def test_a_busy_polling_worker_answers_like_the_offline_engine(tiny_checkpoints, tmp_path):
    """The whole loop with busy polling on (the CPU default is off): two requests in a row, the
    second while the loop still spins after the first; greedy tokens as the offline engine's."""
    model = str(tiny_checkpoints["llama-gqa"])
    prompts = [list(range(3, 23)), list(range(40, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [
        output.outputs[0].token_ids
        for output in LLM(model, device="cpu", num_kv_blocks=64).generate(prompts, params)
    ]
    flags = ("--device", "cpu", "--num-kv-blocks", "64", "--busy-poll-s", "5")
    with running_worker(tmp_path, *flags, model=model) as worker:
        for prompt, tokens in zip(prompts, expected, strict=True):
            body = {
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            answer = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["token_ids"] == tokens

"""The engine core in its own process, so HTTP work never stalls the step loop.

    API process                         engine core process
    AsyncEngineClient --(add/abort)-->  run_engine_core: poll inputs, step, send outputs
                      <--(outputs, stats)--

The messages are the typed structs of `messages.py`, as msgpack over two ZeroMQ PUSH/PULL
sockets on ipc:// addresses. The loop blocks on its input only while it has nothing to do; a KV
transport thread that finishes a load or a remote read wakes it through a pipe, so a loaded
request starts at once. For `busy_poll_s` after its last work it waits by polling without
sleeping, which keeps its CPU core awake for the next request (on the GPU hosts an idle core
doubled the host time of about one prefill step in five, and of most at 1024 tokens).

The engine dies with its API process: on Linux the kernel kills it then (PR_SET_PDEATHSIG);
elsewhere, or should that fail, the loop stops once its parent is gone (reparented). A request
that fails in the engine fails alone (see core.py); when the engine cannot go on
(`FatalEngineError`, or an exception that escapes the core), the loop sends `Fatal` with the
failed step's outputs and the process exits with ENGINE_FAILED_EXIT_CODE: the API process
answers what is left with 503s and exits, for its supervisor to restart it.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import zmq

from tandem.engine.config import EngineConfig
from tandem.engine.messages import (
    INPUT_DECODER,
    AbortRequests,
    AddRequests,
    EngineInfo,
    EngineInput,
    Fatal,
    Outputs,
    Ready,
    ReleaseLease,
    ReleaseRemote,
    SetTokenizer,
    Shutdown,
    StartFailed,
    encode,
)
from tandem.lifetime import die_with_parent

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # nothing to do: wake up this often to report stats
# Only waiting on remote KV or holding leases: transfers that end wake the loop through the
# pipe; this poll is what expires leases (their deadlines are seconds).
REMOTE_POLL_MS = 10
STATS_INTERVAL_S = 0.5
# While the loop spins it holds the GIL most of the time: the KV transport's threads get it
# within this (Python's default is 5 ms).
BUSY_POLL_SWITCH_INTERVAL_S = 0.0005
ENGINE_FAILED_EXIT_CODE = 70  # EX_SOFTWARE


def collect_stats(core) -> dict[str, Any]:
    scheduler, kv = core.scheduler, core.kv_manager
    stats = {
        "kv_blocks_used": kv.num_used_blocks,
        "kv_blocks_total": kv.num_blocks,
        "requests_running": scheduler.num_running,
        "requests_waiting": scheduler.num_waiting,
        "tokens_waiting": prompt_tokens_waiting(scheduler),
        "prefix_cache_queries": kv.num_prefix_queries,
        "prefix_cache_hits": kv.num_prefix_hits,
        "num_preemptions": scheduler.num_preemptions,
    }
    stats.update(core.connector.stats())
    stats.update(core.decode_step_costs.report())
    return stats


def prompt_tokens_waiting(scheduler) -> int:
    """The prefill queue a router balances on: prompt tokens admitted, not yet computed. It
    runs after every step, over every running request: a plain loop, a few times cheaper than
    a generator calling max() per request."""
    total = 0
    for request in itertools.chain(scheduler.waiting, scheduler.running):
        left = len(request.prompt_token_ids) - request.num_computed_tokens
        if left > 0:
            total += left
    return total


def run_engine_core(
    config: EngineConfig,
    kv_config: Any,
    input_address: str,
    output_address: str,
    api_pid: int,
) -> None:
    """Process entry point: build the core, announce it, then step until told to stop."""
    die_with_parent(api_pid)
    # A terminal's Ctrl-C, and a supervisor's SIGTERM (tandem serve, Slurm), reach the whole
    # process group; the API process decides when the engine stops (it finishes or aborts what
    # is in flight first, then sends Shutdown, or SIGKILL).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    try:
        from tandem.engine.core import EngineCore, FatalEngineError

        factory = None
        if kv_config is not None:
            from tandem.kv.connector import make_connectors

            factory = make_connectors(kv_config)
        core = EngineCore(config, factory)
    except Exception as exc:  # start-up failures go to the front end as a sentence
        outputs.send(encode(StartFailed(f"{type(exc).__name__}: {exc}")))
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        context.destroy(linger=1000)
        return
    info = EngineInfo(
        model=config.model,
        max_model_len=core.max_model_len,
        vocab_size=core.model_config.vocab_size,
        eos_token_ids=core.eos_token_ids,
        kv_port=core.connector.kv_port,
        kv_engine_id=core.connector.kv_engine_id,
        kv_layout=core.connector.kv_layout,
    )
    # What start-up built (the model, its modules, the tokenizer's tables) lives as long as the
    # process: frozen, the garbage collector stops walking it, which shortens its pauses in the
    # step loop.
    gc.collect()
    gc.freeze()
    outputs.send(encode(Ready(info)))
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)  # a full pipe already holds a wake-up
    core.connector.set_wakeup(lambda: _wake(wake_write))
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    poller.register(wake_read, zmq.POLLIN)
    busy_poll_s = core.config.busy_poll_s
    if busy_poll_s > 0:
        sys.setswitchinterval(BUSY_POLL_SWITCH_INTERVAL_S)
    last_stats = 0.0
    spin_until = 0.0
    step_outputs: list = []
    fatal: str | None = None
    try:
        while True:
            scheduler = core.scheduler
            if scheduler.waiting or scheduler.running or core.step_in_flight:
                timeout = 0
            elif scheduler.waiting_for_remote or scheduler.held_for_remote:
                timeout = REMOTE_POLL_MS
            else:
                timeout = IDLE_POLL_MS
            step_outputs = []
            events = poll_events(poller, timeout, spin_until)
            if events or timeout == 0:  # new input, a wake-up, or work to step
                spin_until = time.monotonic() + busy_poll_s
            while events:
                if wake_read in events:
                    os.read(wake_read, 4096)
                if inputs in events:
                    message = INPUT_DECODER.decode(inputs.recv())
                    if not handle_message(core, message, step_outputs):
                        return
                events = dict(poller.poll(0))
            if core.has_work():
                # A handoff's first token goes out ahead of the step that decodes on from it: the
                # front end opens the stream while that step runs.
                if transfer_outputs := core.take_finished_transfers():
                    outputs.send(encode(Outputs(transfer_outputs, collect_stats(core))))
                step_outputs.extend(core.step_batch())
            if os.getppid() != api_pid:  # reparented: the API process died
                logger.warning("the API process is gone: the engine stops")
                return
            now = time.monotonic()
            if step_outputs or now - last_stats > STATS_INTERVAL_S:
                outputs.send(encode(Outputs(step_outputs, collect_stats(core))))
                last_stats = now
    except FatalEngineError as exc:
        fatal = str(exc)
        step_outputs.extend(exc.outputs)
    except Exception as exc:  # the core's state is unknown: nothing more can be trusted
        logger.critical("the engine failed outside any request:\n%s", traceback.format_exc())
        fatal = f"{type(exc).__name__}: {exc}"
    finally:
        if fatal is not None:
            logger.critical("the engine cannot go on and exits: %s", fatal)
            outputs.send(encode(Fatal(fatal, step_outputs)))
        core.shutdown()
        context.destroy(linger=1000 if fatal is not None else 0)
        os.close(wake_read)
        os.close(wake_write)
        # No interpreter teardown: after a fatal error it could touch a broken device, and a
        # tensor-parallel engine's waited in NCCL's communicator abort for over a minute once
        # the other ranks were gone (2 x H200, torch 2.11).
        logging.shutdown()
        sys.stdout.flush()
        os._exit(ENGINE_FAILED_EXIT_CODE if fatal is not None else 0)


def handle_message(core, message: EngineInput, step_outputs: list) -> bool:
    """Apply one message from the front end; False when it says to shut down."""
    if isinstance(message, AddRequests):  # a request that cannot be admitted fails alone
        step_outputs.extend(core.admit(new.to_request() for new in message.requests))
        return True
    try:
        match message:
            case AbortRequests(request_ids):
                step_outputs.extend(core.abort_requests(request_ids))
            case ReleaseLease(remote_request_id):
                core.connector.release(remote_request_id)
            case ReleaseRemote(kv_transfer_params):
                core.connector.release_remote(kv_transfer_params)
            case SetTokenizer(tokenizer_json, eos_token_ids):
                core.set_tokenizer(tokenizer_json, eos_token_ids)
    except Exception:
        logger.error("the engine could not apply %r:\n%s", message, traceback.format_exc())
    return not isinstance(message, Shutdown)


def poll_events(poller: zmq.Poller, timeout_ms: int, spin_until: float) -> dict:
    """`poller.poll(timeout_ms)`, except that up to `spin_until` (a time.monotonic() value) it
    waits by polling without sleeping."""
    now = time.monotonic()
    if timeout_ms == 0 or now >= spin_until:
        return dict(poller.poll(timeout_ms))
    deadline = now + timeout_ms / 1000
    while not (events := dict(poller.poll(0))):
        now = time.monotonic()
        if now >= deadline:
            break
        if now >= spin_until:  # the rest of the wait sleeps
            return dict(poller.poll(max(1, round((deadline - now) * 1000))))
    return events


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except OSError:  # the pipe is full (a wake-up is pending) or closed at shutdown
        pass

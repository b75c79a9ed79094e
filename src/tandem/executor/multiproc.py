"""The executor of a tensor-parallel engine: one process per rank, rank 0 in the engine core's
own process (next to the scheduler), ranks 1.. in processes of their own (`rank_worker`).

    engine core process                                   rank r process (r >= 1)
    scheduler -> SchedulerOutput -> msgpack --ZeroMQ PUSH--> decode -> same forward on shard r
                 (for_other_ranks: no sampling inputs, new block ids only)
                 rank 0: forward on shard 0                  (collectives pair up, gloo / NCCL)
                 logits gathered on rank 0 -> sample -> RunnerOutput

Why ZeroMQ for the step's input, not a torch.distributed broadcast: the engine already speaks
msgpack over ZeroMQ ipc sockets; a send does not wait for the other ranks (they start as it
lands; their first collective syncs them); it needs no CPU-side group beside NCCL's; and a dead
rank cannot block it.

Failures: a rank that fails to start fails the engine's start with its error. A monitor thread
waits on the rank processes; when one exits, the executor has failed (`check_health` raises
`ExecutorFailedError`, which ends the engine, idle or mid-step: gloo's pending collective raises
at once, NCCL's is aborted). A death in a step also arms faulthandler's watchdog: a step still
running STUCK_STEP_EXIT_S later waits on the GPU for the dead rank (peer-memory kernels have no
timeout; NCCL's abort then hangs too), so every thread's stack goes to stderr and the process
ends (code 1), as when a step runs past the execute-model timeout with every rank alive.
Shutdown, or the executor's end without it (an offline engine at exit), stops every rank
(Shutdown, then SIGKILL; ranks ignore the SIGINT and SIGTERM that a terminal or a supervisor
sends the worker's process group); the ranks die with the engine core anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import msgspec
import zmq

from tandem.distributed.group import TensorParallelGroup, host_store, join_group
from tandem.distributed.sharding import check_tensor_parallel
from tandem.engine.config import EngineConfig
from tandem.engine.outputs import RunnerOutput, SchedulerOutput
from tandem.executor.base import Executor, ExecutorFailedError
from tandem.executor.rank import (
    REPLY_DECODER,
    BlockTables,
    InitializeKVCache,
    PlanKVCache,
    Rank,
    RankMessage,
    RankReply,
    Shutdown,
    for_other_ranks,
    peer_memory_dtype,
    rank_device,
)
from tandem.executor.runner import KVCacheSpec
from tandem.executor.step_watch import StepWatch
from tandem.kv.connector.base import KVConnectorWorker
from tandem.models.source import ModelSource

logger = logging.getLogger(__name__)
T = TypeVar("T")

REPLY_POLL_MS = 100  # while waiting on the ranks: how often to look whether one died
STOP_TIMEOUT_S = 5.0  # a rank told to stop gets this long, then SIGKILL
DEATH_GRACE_S = 1.0  # a step that raised: how long to wait for a rank's exit to show
# A rank died in the middle of rank 0's step, which is still running this long after (a step
# fails at its next collective, gloo's or an aborted NCCL's): it waits on the GPU for ever.
STUCK_STEP_EXIT_S = 30.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        size = config.tensor_parallel_size
        check_tensor_parallel(source.config, size, config.enable_expert_parallel)
        steps = StepWatch("a kernel or a collective waits for a rank that does not answer")
        self.size = size
        self.stopping = False
        self.encoder = msgspec.msgpack.Encoder()
        self.block_tables = BlockTables()  # what the other ranks hold of each block table
        self.directory = tempfile.mkdtemp(prefix="tandem-tp-")
        self.context = zmq.Context()
        replies = self.context.socket(zmq.PULL)
        reply_address = f"ipc://{self.directory}/replies"
        replies.bind(reply_address)
        self.replies = RankReplies(replies, size)
        self.inputs: list[zmq.Socket] = []
        self.processes: list[subprocess.Popen] = []
        store, address = host_store(size)
        self.store = store  # the other ranks rendezvous on it as long as the group lives
        for rank in range(1, size):
            socket = self.context.socket(zmq.PUSH)
            input_address = f"ipc://{self.directory}/rank{rank}"
            socket.bind(input_address)
            self.inputs.append(socket)
            arguments = (config, source, rank, address, input_address, reply_address)
            self.processes.append(start_rank(arguments))
        self.monitor = RankMonitor(self.processes, steps)
        # An executor dropped without shutdown() (an offline engine at the interpreter's exit)
        # still stops its ranks, the same way.
        self._finalizer = weakref.finalize(
            self, stop_ranks, self.monitor, self.processes, self.inputs, self.context,
            self.directory,
        )  # fmt: skip
        try:
            self._wait_replies("start")
            device = rank_device(config, 0)
            self.tp = join_group(0, size, address, device, store, peer_memory_dtype(config))
            self.monitor.tp = self.tp
            self.rank = Rank(config, source, self.tp)
            self._wait_replies("load its shard of the model")
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (pids %s)", size,
                    [os.getpid()] + [p.pid for p in self.processes])  # fmt: skip

    def determine_kv_cache(self) -> KVCacheSpec:
        self._send(PlanKVCache())
        spec = self.rank.plan_kv_cache()
        replies = self._wait_replies("size its KV cache")
        num_blocks = min([spec.num_blocks] + [reply.num_blocks for reply in replies])
        return replace(spec, num_blocks=num_blocks)

    def initialize_kv_cache(
        self, kv_spec: KVCacheSpec, connector: KVConnectorWorker, max_model_len: int
    ) -> None:
        kv_transfer = None
        if hasattr(connector, "attach_ranks"):  # a PD role's connector
            from tandem.kv.connector.ranks import HeadRelay, RankLayout

            layout = RankLayout.of(self.rank.source.config.num_kv_heads, self.size)
            kv_transfer = connector.attach_ranks(HeadRelay(self.tp, layout))
        self._send(InitializeKVCache(kv_spec.num_blocks, max_model_len, kv_transfer))
        self.rank.initialize_kv_cache(kv_spec.num_blocks, connector, max_model_len)
        self._wait_replies("allocate its KV cache")

    def launch_model(self, scheduler_output: SchedulerOutput) -> Callable[[], RunnerOutput]:
        def launch() -> Callable[[], RunnerOutput]:
            self._send(for_other_ranks(scheduler_output, self.block_tables))
            return self.rank.runner.launch(scheduler_output)

        wait = self._in_step(launch)
        return lambda: self._in_step(wait)

    def _in_step(self, call: Callable[[], T]) -> T:
        """call() as a part of rank 0's step, which a rank's death from here on arms the
        watchdog against; a rank found dead, before or by an exception, raises
        ExecutorFailedError."""
        with self.monitor.steps.step():
            self.check_health()
            try:
                return call()
            except Exception as exc:
                deadline = time.monotonic() + DEATH_GRACE_S
                while self.failure is None and time.monotonic() < deadline:
                    time.sleep(0.01)  # a collective that raised: did a rank die?
                self.check_health(exc)
                raise

    @property
    def failure(self) -> str | None:
        return self.monitor.failure

    def check_health(self, cause: BaseException | None = None) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure) from cause

    def shutdown(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._finalizer()
        self.rank = None  # the KV cache goes with it

    def _send(self, message: RankMessage) -> None:
        payload = self.encoder.encode(message)
        for socket in self.inputs:
            socket.send(payload, copy=False)

    def _wait_replies(self, what: str) -> list[RankReply]:
        """Every other rank's reply to the stage `what`; a rank's error, or a rank's death,
        raises."""
        return self.replies.next_from_each(what, self.check_health)


class RankReplies:
    """The other ranks' replies on rank 0's socket. Each rank answers the stages in order, one
    reply a stage, but not in step with the others: a rank whose group needs no collective to
    join (NCCL without peer memory) loads its shard and says so while a slower rank has not yet
    said it started. So a stage takes each rank's oldest reply not yet taken, and keeps the
    ones that came early for the next."""

    def __init__(self, socket: zmq.Socket, size: int) -> None:
        self.socket = socket
        self.unread: dict[int, list[RankReply]] = {rank: [] for rank in range(1, size)}

    def next_from_each(self, what: str, check_health) -> list[RankReply]:
        while not all(self.unread.values()):
            check_health()
            if not self.socket.poll(REPLY_POLL_MS):
                continue
            reply = REPLY_DECODER.decode(self.socket.recv())
            if reply.error is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {reply.rank} could not {what}: {reply.error}"
                )
            self.unread[reply.rank].append(reply)
        return [replies.pop(0) for replies in self.unread.values()]


def start_rank(arguments: tuple) -> subprocess.Popen:
    """A rank's process: `python -m tandem.executor.rank_worker`, its arguments pickled on its
    stdin. Not a multiprocessing child: a worker's engine core is a daemonic process, which
    multiprocessing does not let have children."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.executor.rank_worker"], stdin=subprocess.PIPE, env=env
    )
    process.stdin.write(pickle.dumps((*arguments, os.getpid())))
    process.stdin.close()
    return process


class RankMonitor:
    """A thread per rank process, waiting for it to exit: the first to exit, unless stopped
    first, sets `failure` and aborts the group's pending NCCL collectives; if rank 0 is in a
    step then, a watchdog ends this process unless the step returns within STUCK_STEP_EXIT_S.
    Rank 0's step runs within `steps.step()`, which also ends this process once one call of it
    has run for the execute-model timeout (`step_watch`)."""

    def __init__(self, processes: list[subprocess.Popen], steps: StepWatch) -> None:
        self.failure: str | None = None
        self.tp: TensorParallelGroup | None = None  # once joined
        self.steps = steps
        self.stopped = threading.Event()
        for rank, process in enumerate(processes, start=1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank{rank}-monitor",
                daemon=True,
            ).start()  # fmt: skip

    def stop(self) -> None:
        self.stopped.set()
        self.steps.stop()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if self.stopped.is_set() or self.failure is not None:
            return
        self.failure = (
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}: the "
            "engine cannot go on"
        )
        logger.critical("%s", self.failure)
        if self.steps.exit_unless_the_step_returns(STUCK_STEP_EXIT_S):
            logger.critical(
                "if the engine's step has not returned %.0f s after tensor-parallel rank %d "
                "died (a kernel on the GPU waits for it), this process ends, every thread's "
                "stack on stderr", STUCK_STEP_EXIT_S, rank,
            )  # fmt: skip
        tp = self.tp
        if tp is not None and tp.uses_nccl:
            tp.abort()  # NCCL would wait on the dead rank: fail what is pending


def stop_ranks(
    monitor: RankMonitor,
    processes: list[subprocess.Popen],
    inputs: list[zmq.Socket],
    context: zmq.Context,
    directory: str,
) -> None:
    """Tell the ranks to stop and wait for them (about a second on 2 x H200), else SIGKILL
    them; then free the sockets and their directory."""
    monitor.stop()
    shutdown = msgspec.msgpack.encode(Shutdown())
    for socket in inputs:
        with contextlib.suppress(zmq.ZMQError):  # that rank is gone already
            socket.send(shutdown, zmq.NOBLOCK)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)

"""The executor: what the engine core calls to run the model, "the workers that run the model".

    executor = UniprocessExecutor(config, source)    loads the model on its rank(s)
    kv_spec = executor.determine_kv_cache()           how many KV blocks fit (profiled on CUDA)
    executor.initialize_kv_cache(kv_spec, connector, max_model_len)
                                                      allocates the cache, captures CUDA graphs
    wait = executor.launch_model(scheduler_output)                 once per step
    wait() -> RunnerOutput                     waits for the step (after the next is launched,
                                               under async scheduling)
    executor.check_health()                           raises ExecutorFailedError once a rank died
    executor.shutdown()

`make_executor` picks the executor: one rank in this process, or one process per rank
(`MultiprocExecutor`, tensor parallelism).

Invariants: the engine core talks to the model only through this interface; a step's input is a
`SchedulerOutput` (plain data, so an executor of several ranks can broadcast it) and its output a
`RunnerOutput` (plain data, rank 0's); the executor holds no scheduling state.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig
    from tandem.engine.outputs import RunnerOutput, SchedulerOutput
    from tandem.executor.runner import KVCacheSpec
    from tandem.kv.connector.base import KVConnectorWorker
    from tandem.models.source import ModelSource


class ExecutorFailedError(RuntimeError):
    """The executor cannot run another step (a rank died): the engine ends."""


class Executor(abc.ABC):
    @abc.abstractmethod
    def determine_kv_cache(self) -> KVCacheSpec:
        """The KV cache every rank allocates: its layout and how many blocks fit."""

    @abc.abstractmethod
    def initialize_kv_cache(
        self, kv_spec: KVCacheSpec, connector: KVConnectorWorker, max_model_len: int
    ) -> None:
        """Allocate the KV cache, register it with the connector's worker side, and make ready
        to run batches of sequences up to max_model_len tokens (CUDA graphs)."""

    @abc.abstractmethod
    def launch_model(self, scheduler_output: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Start one step (the forward pass of the scheduled tokens and their samples) without
        waiting for the device; returns the function that waits for its output. Steps run in
        the order launched; a step may take, on the device, the tokens the one before sampled
        (`SAMPLED_IN_FLIGHT`)."""

    def check_health(self) -> None:  # noqa: B027 (one rank in this process cannot fail alone)
        """Raise ExecutorFailedError when the executor cannot run another step."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the ranks and what they hold."""


def make_executor(config: EngineConfig, source: ModelSource, kv_transfer: bool) -> Executor:
    """The executor of `config.tensor_parallel_size` ranks; kv_transfer: the engine has a KV
    connector (a PD role): with several ranks, every rank gets its part of it
    (`initialize_kv_cache`; tandem.kv.connector.ranks)."""
    if config.tensor_parallel_size == 1:
        from tandem.executor.uniprocess import UniprocessExecutor

        return UniprocessExecutor(config, source)
    from tandem.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source)

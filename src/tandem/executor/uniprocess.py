"""The executor of one rank in the engine core's own process: a `ModelRunner` called directly.

The model is loaded when the executor is made; the runner (with the KV cache and CUDA graphs)
once the engine core has sized the cache. The connector given to `initialize_kv_cache` is its
worker side (the engine core keeps the scheduler side). On a GPU each call of a step runs under
the execute-model timeout (`step_watch`): a step that never returns ends the process. On the CPU
only when TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS is set: a large model's step there can take
minutes, and no kernel waits on a device.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tandem.attention.base import get_backend
from tandem.engine.config import EngineConfig
from tandem.engine.outputs import RunnerOutput, SchedulerOutput
from tandem.executor.base import Executor
from tandem.executor.runner import KVCacheSpec, ModelRunner, plan_kv_cache
from tandem.executor.sampler import Sampler
from tandem.executor.step_watch import STEP_TIMEOUT_ENV, StepWatch
from tandem.kv.connector.base import KVConnectorWorker
from tandem.models.base import CausalLM
from tandem.models.loader import load_model
from tandem.models.source import ModelSource


class UniprocessExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.source = source
        self.device = torch.device(config.device)
        timed = self.device.type == "cuda" or STEP_TIMEOUT_ENV in os.environ
        self.steps = StepWatch("a kernel, or the device, does not return") if timed else None
        self.model: CausalLM = load_model(
            source,
            get_backend(config.attention_backend),
            config.torch_dtype,
            self.device,
            config.load_format,
            config.seed,
        )
        self.runner: ModelRunner | None = None

    def determine_kv_cache(self) -> KVCacheSpec:
        return plan_kv_cache(self.config, self.model)

    def initialize_kv_cache(
        self, kv_spec: KVCacheSpec, connector: KVConnectorWorker, max_model_len: int
    ) -> None:
        config = self.config
        eager = config.enforce_eager
        self.runner = ModelRunner(
            self.model,
            kv_spec,
            self.device,
            Sampler(self.source.config.eos_token_ids, config.seed),
            connector,
            cuda_graph_max_batch=0 if eager else config.max_num_seqs,
            max_seq_len=max_model_len,
            piecewise_graph_max_tokens=0
            if eager
            else min(config.piecewise_cuda_graph_max_tokens, config.max_num_batched_tokens),
            async_scheduling=config.async_scheduling,
        )

    def launch_model(self, scheduler_output: SchedulerOutput) -> Callable[[], RunnerOutput]:
        if self.steps is None:
            return self.runner.launch(scheduler_output)
        wait = self.steps.call(lambda: self.runner.launch(scheduler_output))
        return lambda: self.steps.call(wait)

    def shutdown(self) -> None:
        if self.steps is not None:
            self.steps.stop()
        self.runner = None  # the KV cache and the graphs go with it

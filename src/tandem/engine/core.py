"""The engine core: scheduler, KV cache manager and executor in one step loop, token ids only.

    step():  take the connector's finished transfers -> schedule -> the executor runs the model
             (and the connector's loads/saves) -> update requests

With async scheduling (`EngineConfig.async_scheduling`, vLLM's) the host's work overlaps the
device's step: schedule n+1 -> launch n+1 -> wait for n's output -> update requests from n. A
step whose output the next schedule needs (a grammar's or penalties' token) is taken at once, as
is an empty one.

The core reaches the model only through its `Executor` (tandem.executor), which it hands each
step's `SchedulerOutput`, plain data; the executor loads the model and sizes the KV cache, the
core keeps the block bookkeeping and every request's state.

Tokenization, detokenization and stop strings belong to the front end (`LLM` offline, the HTTP
server online), which talks to this core in the same process or through `EngineCoreProcess`.

Faults: what can be pinned on one request fails that request alone (finish reason "error", its
blocks and KV lease freed): its admission (`admit`), its connector calls and its update after a
step (the scheduler's). An exception in a whole step (the model's forward of a batch) fails the
requests of that step and the engine goes on. A step of one request pins the fault on it: no
request can end the engine. A CUDA error (sticky: no later kernel runs), or MAX_FAILED_STEPS steps
of several requests failed in a row, raise `FatalEngineError`, which ends the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import EngineCoreOutput, KVConnectorOutput, RunnerOutput, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.step_costs import DecodeStepCosts
from tandem.engine.structured_output import GrammarBackend, UnsatisfiableConstraint
from tandem.executor.base import Executor, ExecutorFailedError, make_executor
from tandem.kv.connector.base import (
    ConnectorFactory,
    NoKVConnectorScheduler,
    NoKVConnectorWorker,
)
from tandem.models.source import resolve_model

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # of several requests, in a row: the engine is broken, not one request


class FatalEngineError(RuntimeError):
    """The engine cannot go on; `outputs` fail the requests of the step that found it out."""

    def __init__(self, message: str, outputs: list[EngineCoreOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


def is_sticky_device_error(exc: BaseException) -> bool:
    """A CUDA error leaves the context unusable: every later kernel launch fails too."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return "CUDA error" in str(exc)


@dataclass(frozen=True)
class LaunchedStep:
    """A step the executor runs, its output not yet taken."""

    scheduler_output: SchedulerOutput
    request_ids: list[str]  # the requests its schedule took up (a failure fails them)
    wait: Callable[[], RunnerOutput]


def transfer_request_ids(report: KVConnectorOutput | None) -> list[str]:
    """The requests a connector's report moves on (not those whose blocks it frees)."""
    if report is None:
        return []
    return [
        *report.finished_recving,
        *report.failed_recving,
        *report.first_tokens,
    ]


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        connector_factory: ConnectorFactory | None = None,
    ) -> None:
        self.config = config = config.resolved()
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels launch on the current device
        self.source = resolve_model(config.model)
        self.model_config = self.source.config
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.executor: Executor = make_executor(
            config, self.source, kv_transfer=connector_factory is not None
        )
        self.kv_spec = self.executor.determine_kv_cache()
        # A request longer than the whole KV cache could never finish: it would be preempted
        # and rescheduled forever. Such requests are refused up front instead.
        kv_capacity = self.kv_spec.num_blocks * config.block_size
        if kv_capacity < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens: max_model_len lowered from %d to %d",
                kv_capacity,
                self.max_model_len,
                kv_capacity,
            )
            self.max_model_len = kv_capacity
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.connector, self.kv_worker = (
            connector_factory(self.kv_spec, self.device)
            if connector_factory
            else (NoKVConnectorScheduler(), NoKVConnectorWorker())
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_waiting,
                config.scheduling_policy,
            ),
            self.kv_manager,
            self.connector,
        )
        self.executor.initialize_kv_cache(self.kv_spec, self.kv_worker, self.max_model_len)
        self.grammars = GrammarBackend(self.model_config.vocab_size)
        self.num_failed_steps = 0  # of several requests, in a row
        self.step_in_flight: LaunchedStep | None = None  # async scheduling
        self.decode_step_costs = DecodeStepCosts()  # for the load report (a router's planner)
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens",
            config.model,
            config.device,
            config.dtype,
            self.kv_spec.num_blocks,
            config.block_size,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.model_config.eos_token_ids)

    def set_tokenizer(self, tokenizer_json: str, eos_token_ids: Iterable[int]) -> None:
        """The model's tokenizer (the tokenizers library's JSON) and the ids that end a
        request, which structured outputs need; the front end, which loads it, gives it."""
        self.grammars.set_tokenizer(tokenizer_json, list(eos_token_ids))

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if params.structured_output is not None:
            request.grammar = self.grammars.matcher(
                params.structured_output, request.output_token_ids, params.structured_output_after
            )
        self.scheduler.add_request(request)

    def admit(self, requests: Iterable[Request]) -> list[EngineCoreOutput]:
        """add_request each; one that raises fails alone: the error outputs of those."""
        failed = []
        for request in requests:
            try:
                self.add_request(request)
            except UnsatisfiableConstraint as exc:  # the client's to change: a 400
                failed.append(
                    EngineCoreOutput(
                        request.request_id,
                        [],
                        finish_reason="error",
                        error=str(exc),
                        error_status=400,
                    )
                )
            except Exception as exc:
                logger.error("request %s was not admitted", request.request_id, exc_info=exc)
                error = f"the engine could not admit this request ({type(exc).__name__}: {exc})"
                if self.scheduler.requests.get(request.request_id) is request:
                    failed.append(self.scheduler.fail_request(request.request_id, error))
                else:
                    failed.append(
                        EngineCoreOutput(request.request_id, [], finish_reason="error", error=error)
                    )
        return failed

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort live requests; for one that already finished, end the KV lease it may still
        hold for a remote decoder."""
        request_ids = list(request_ids)
        outputs = self.scheduler.abort_requests(request_ids)
        aborted = {output.request_id for output in outputs}
        for request_id in request_ids:
            if request_id not in aborted:
                self.connector.release(request_id)
        return outputs

    def has_work(self) -> bool:
        """Whether a step has something to do; raises ExecutorFailedError once a rank died,
        which ends an engine loop that asks, idle or not."""
        self.executor.check_health()
        return self.step_in_flight is not None or self.scheduler.has_work()

    def take_finished_transfers(self) -> list[EngineCoreOutput]:
        """Apply the KV transfers that ended since the last call; returns what they output (a
        handoff's first token, a failed load's error). step() starts with this."""
        report = None
        outputs: list[EngineCoreOutput] = []
        try:
            report = self.kv_worker.get_finished()
            outputs.extend(self.scheduler.update_from_connector(report))
        except Exception as exc:
            self._failed_step(exc, transfer_request_ids(report), outputs)
        return outputs

    def step(self) -> list[EngineCoreOutput]:
        # Transfers first: a request whose KV has just arrived is scheduled in this step.
        outputs = self.take_finished_transfers()
        outputs.extend(self.step_batch())
        return outputs

    def step_batch(self) -> list[EngineCoreOutput]:
        """Schedule and launch one batch, without taking finished transfers first; returns the
        outputs of the step before (async scheduling), and of this one unless it is left in
        flight."""
        outputs: list[EngineCoreOutput] = []
        try:
            self._schedule_and_launch(outputs)
        finally:
            if self.step_in_flight is None:  # what finished meanwhile is no step's to write
                self.scheduler.free_blocks_after_step()
        return outputs

    def _schedule_and_launch(self, outputs: list[EngineCoreOutput]) -> None:
        started = time.monotonic()
        try:
            scheduler_output = self.scheduler.schedule()
            self.decode_step_costs.record(scheduler_output, started)
            wait = self.executor.launch_model(scheduler_output)
        except Exception as exc:
            request_ids = list(self.scheduler.step_request_ids)
            self._take_step_in_flight(outputs)
            self._failed_step(exc, request_ids, outputs)
            return
        launched = LaunchedStep(scheduler_output, list(self.scheduler.step_request_ids), wait)
        self._take_step_in_flight(outputs)
        self.step_in_flight = launched
        if (
            not self.config.async_scheduling
            or scheduler_output.needs_sampled_tokens
            or scheduler_output.is_empty  # nothing to wait for (an idle engine leaves none)
        ):
            self._take_step_in_flight(outputs)

    def _take_step_in_flight(self, outputs: list[EngineCoreOutput]) -> None:
        """Wait for the step in flight, if any, and update its requests from its output (added
        to `outputs`)."""
        step, self.step_in_flight = self.step_in_flight, None
        if step is None:
            return
        try:
            runner_output = step.wait()
            # what finished while it ran (their tokens in flight were this step's) can go now
            self.scheduler.free_blocks_after_step()
            outputs.extend(self.scheduler.update_from_output(step.scheduler_output, runner_output))
        except Exception as exc:
            self._failed_step(exc, step.request_ids, outputs)
            return
        self.num_failed_steps = 0

    def _failed_step(
        self, exc: Exception, request_ids: Iterable[str], outputs: list[EngineCoreOutput]
    ) -> None:
        """A step raised: nothing pins it on one request, so its requests fail (their blocks and
        leases freed; their outputs added to `outputs`) and the engine goes on, unless it cannot
        (FatalEngineError, with `outputs`)."""
        request_ids = list(dict.fromkeys(request_ids))
        if len(request_ids) > 1:  # one request's step failing is that request's fault
            self.num_failed_steps += 1
        logger.error(
            "a step failed (%d in a row): its %d requests fail",
            self.num_failed_steps,
            len(request_ids),
            exc_info=exc,
        )
        error = f"the engine's step that ran this request failed ({type(exc).__name__}: {exc})"
        outputs.extend(self.scheduler.take_failed_outputs())
        outputs.extend(self.scheduler.fail_request(request_id, error) for request_id in request_ids)
        if isinstance(exc, ExecutorFailedError):
            raise FatalEngineError(str(exc), outputs)
        if is_sticky_device_error(exc):
            raise FatalEngineError(f"a CUDA error, after which no kernel runs: {exc}", outputs)
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise FatalEngineError(
                f"{self.num_failed_steps} steps failed in a row, the last with "
                f"{type(exc).__name__}: {exc}",
                outputs,
            )

    def shutdown(self) -> None:
        self.kv_worker.shutdown()
        self.connector.shutdown()
        self.executor.shutdown()

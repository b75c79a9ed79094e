"""The engine core: model, KV cache, scheduler and runner in one step loop, token ids only.

    step():  take the connector's finished transfers -> schedule -> run the model (and the
             connector's loads/saves) -> update requests

Tokenization, detokenization and stop strings belong to the front end (`LLM` offline, the HTTP
server online), which talks to this core in the same process or through `EngineCoreProcess`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from tandem.attention.base import get_backend
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner, plan_kv_cache
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.structured_output import GrammarBackend
from tandem.kv.base import KVConnector, NoKVConnector
from tandem.models.loader import load_model, resolve_model

logger = logging.getLogger(__name__)

ConnectorFactory = Callable[["EngineCore"], KVConnector]


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
        backend = get_backend(config.attention_backend)
        self.model = load_model(
            self.source,
            backend,
            config.torch_dtype,
            self.device,
            config.load_format,
            config.seed,
        )
        self.kv_spec = plan_kv_cache(config, self.model_config, self.model)
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
        self.connector = connector_factory(self) if connector_factory else NoKVConnector()
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
        self.runner = ModelRunner(
            self.model,
            self.kv_spec,
            self.device,
            Sampler(self.model_config.eos_token_ids, config.seed),
            self.connector,
            cuda_graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
            max_seq_len=self.max_model_len,
            piecewise_graph_max_tokens=0
            if config.enforce_eager
            else min(config.piecewise_cuda_graph_max_tokens, config.max_num_batched_tokens),
        )
        self.grammars = GrammarBackend(self.model_config.vocab_size)
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
        return self.scheduler.has_work()

    def take_finished_transfers(self) -> list[EngineCoreOutput]:
        """Apply the KV transfers that ended since the last call; returns what they output (a
        handoff's first token, a failed load's error). step() starts with this."""
        return self.scheduler.update_from_connector(self.connector.get_finished())

    def step(self) -> list[EngineCoreOutput]:
        # Transfers first: a request whose KV has just arrived is scheduled in this step.
        outputs = self.take_finished_transfers()
        outputs.extend(self.step_batch())
        return outputs

    def step_batch(self) -> list[EngineCoreOutput]:
        """Schedule, run and update one batch, without taking finished transfers first."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.scheduler.holds_samples:
            # A handoff ran ahead of its first token, whose announcement is most likely in by
            # now (the step waited for the prefill's GPU): both tokens go out with this step.
            outputs.extend(self.take_finished_transfers())
        return outputs

    def shutdown(self) -> None:
        self.connector.shutdown()

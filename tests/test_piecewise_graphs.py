"""The padded token counts the piecewise CUDA graphs are captured for, and which steps may run
as one whole-pass graph (the graphs themselves are checked on the GPU in test_cuda_engine.py)."""

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.executor.piecewise_graphs import token_count_ladder
from tandem.kv.config import KVTransferConfig
from tandem.kv.connector import make_connectors
from tandem.kv.connector.base import KVTransferParams, NoKVConnectorWorker


def test_ladder_doubles_to_256_then_steps_by_256_to_the_cap():
    assert token_count_ladder(2048) == [16, 32, 64, 128, 256, *range(512, 2049, 256)]
    assert token_count_ladder(1000) == [16, 32, 64, 128, 256, 512, 768, 992]
    assert token_count_ladder(48) == [16, 32, 48]
    assert token_count_ladder(16) == [16]
    assert token_count_ladder(15) == []


def test_every_size_is_a_multiple_of_16_and_a_batch_fits_the_next_one_up():
    sizes = token_count_ladder(3000)
    assert all(size % 16 == 0 for size in sizes)
    assert sizes == sorted(set(sizes))
    for num_tokens in range(1, sizes[-1] + 1):
        padded = next(size for size in sizes if size >= num_tokens)
        assert padded - num_tokens < max(16, padded // 2)


def test_a_negative_token_cap_is_refused():
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens must be 0"):
        EngineConfig(device="cpu", piecewise_cuda_graph_max_tokens=-1).resolved()
    off = EngineConfig(device="cpu", piecewise_cuda_graph_max_tokens=0).resolved()
    assert off.piecewise_cuda_graph_max_tokens == 0


def test_only_the_tcp_transports_saves_keep_the_layers_apart(tiny_checkpoints):
    """A prefill whose KV goes out over TCP copies each layer out while the next ones run: its
    steps need the layers apart. With no save in the step (or no connector), one whole-pass
    graph may run and the per-layer calls after it."""
    kv_config = KVTransferConfig(role="prefill", transport="tcp")
    config = EngineConfig(model=str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=32)
    core = EngineCore(config, make_connectors(kv_config))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        prompt = list(range(3, 43))
        core.add_request(
            Request("p", prompt, params, kv_transfer_params=KVTransferParams(do_remote_decode=True))
        )
        metadata = core.scheduler.schedule().kv_connector_metadata
        assert metadata.saves
        assert core.kv_worker.saves_between_layers(metadata)
        assert not core.kv_worker.saves_between_layers(core.connector.build_connector_meta([]))
    finally:
        core.shutdown()
    assert not NoKVConnectorWorker().saves_between_layers(None)

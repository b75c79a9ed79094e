"""The KV connector, split by side (`base` holds the interfaces the engine sees). Only
`make_connectors` is here: the sides and their control and data planes load when a worker
with a KV transport builds them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.kv.config import KVTransferConfig
    from tandem.kv.connector.base import ConnectorFactory, KVConnectorScheduler, KVConnectorWorker


def make_connectors(config: KVTransferConfig) -> ConnectorFactory:
    """What the engine core calls, once its KV cache is planned, for this worker's connector:
    both sides over one control plane."""

    def build(kv_spec, device: torch.device) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
        from tandem.kv.connector.metadata import ForNextStep, TransferShape, kv_layout
        from tandem.kv.connector.scheduler import PDConnectorScheduler
        from tandem.kv.connector.worker import PDConnectorWorker
        from tandem.kv.control.plane import ControlPlane

        control = ControlPlane(config)
        shape, installs, reads = TransferShape(kv_layout(kv_spec)), ForNextStep(), ForNextStep()
        try:
            worker = PDConnectorWorker(config, kv_spec, device, control, shape, installs, reads)
        except BaseException:
            control.close()
            raise
        return PDConnectorScheduler(config, kv_spec, control, shape, installs, reads), worker

    return build

"""The KV data planes by name (`--kv-transport`), each imported only when chosen, so that a plane
whose library is missing costs nothing until it is asked for (nixl and mooncake come as entries).
`tandem.kv.data.base` holds the interface every plane implements."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kv.data.base import DataPlane

DATA_PLANES = {
    "tcp": "tandem.kv.data.tcp:TcpDataPlane",
    "cuda-ipc": "tandem.kv.data.cuda_ipc:CudaIpcDataPlane",
}


def data_plane_class(name: str) -> type[DataPlane]:
    if name not in DATA_PLANES:
        choices = ", ".join(DATA_PLANES)
        raise ValueError(f"unknown KV transport {name!r}; the transports are: {choices}")
    module_name, _, class_name = DATA_PLANES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)

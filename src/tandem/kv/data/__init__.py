"""The KV data planes by name (`--kv-transport`), each imported only when chosen, so that a plane
whose library is missing costs nothing until it is asked for (nixl: NIXL, mooncake: Mooncake's
transfer engine, both optional extras); asking for one without its library is an ImportError
that names the pip install.
`tandem.kv.data.base` holds the interface every plane implements."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kv.data.base import DataPlane

DATA_PLANES = {
    "tcp": "tandem.kv.data.tcp:TcpDataPlane",
    "cuda-ipc": "tandem.kv.data.cuda_ipc:CudaIpcDataPlane",
    "nixl": "tandem.kv.data.nixl:NixlDataPlane",
    "mooncake": "tandem.kv.data.mooncake:MooncakeDataPlane",
}
# the modules whose presence makes a plane usable (what `auto` and the start-up check look for)
LIBRARIES = {"nixl": ("nixl", "nixl_cu12"), "mooncake": ("mooncake.engine",)}


def installed(name: str) -> bool:
    """Whether the library a transport needs is importable (tcp and cuda-ipc need none)."""
    modules = LIBRARIES.get(name, ())
    return not modules or any(_importable(module) for module in modules)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def auto_transport(on_gpus: bool) -> str:
    """What `auto` picks for the workers `tandem serve` starts on one host: cuda-ipc between its
    GPUs, else tcp (over UCX's TCP, nixl took twice tcp's time on loopback: docs/benchmarks.md;
    nixl and mooncake are for hosts with RDMA, named with --kv-transport)."""
    return "cuda-ipc" if on_gpus else "tcp"


def data_plane_class(name: str) -> type[DataPlane]:
    if name not in DATA_PLANES:
        choices = ", ".join(DATA_PLANES)
        raise ValueError(f"unknown KV transport {name!r}; the transports are: {choices}")
    module_name, _, class_name = DATA_PLANES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)

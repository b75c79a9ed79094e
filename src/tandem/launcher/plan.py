"""What `tandem serve` runs: each process's command line and the environment they all share.

Ports: workers take `worker_port_base + i`, and `kv_port_base + i` for their KV listener, in the
order prefill, decode, both, pd, auto. With GPUs, the workers take the GPUs in that order: a
worker of tensor_parallel_size N the next N (`--device cuda:i`, its rank r on GPU i + r), a pd
server twice that (`--device cuda:i --decode-device cuda:i+N`). Tensor-parallel workers share no
GPU, and a cluster with one that needs more GPUs than the host has is refused; a cluster of
one-GPU workers only takes the GPUs round (mod their number), as a prefill and a decode sharing
one GPU do. Every worker sees the same GPUs under the same indices, which CUDA IPC between them
needs (so no CUDA_VISIBLE_DEVICES per worker). The KV transport `auto` becomes cuda-ipc on GPUs
(all workers share this host), else tcp, whatever the workers' tensor-parallel sizes. The router
gets pd servers as colocated (`--worker`) workers. `check_model_splits` refuses, before anything
starts, a tensor_parallel_size the model cannot be split over, as the worker would refuse it at
its start.

Secrets (the API key, the cluster token) never appear on a command line, where any user of the
host can read them: every child gets them in its environment (`child_environment`), and reads
them there as the default of its own `--api-key` / `--cluster-token`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.access import API_KEY_ENV, CLUSTER_TOKEN_ENV
from tandem.engine.config import cuda_available
from tandem.kv.data import auto_transport
from tandem.launcher.cli import ROUTER_TUNING
from tandem.launcher.cluster import WORKER_ROLES, ClusterError, ClusterSpec

# the router keys of a cluster file passed on as `tandem router --key-name value`
ADAPTIVE_ROUTER_KEYS = ("disaggregation", *(name for name, _ in ROUTER_TUNING))


@dataclass(frozen=True)
class ProcessPlan:
    name: str  # "prefill-0", ..., "router"
    argv: tuple[str, ...]
    url: str
    role: str  # "prefill" | "decode" | "both" | "pd" | "auto" | "router"


def resolve_device(device: str) -> tuple[str, int]:
    """("cpu" or "cuda", number of GPUs); `auto` means cuda when torch sees a GPU. A host
    without an NVIDIA device node has none: `auto` is cpu there without importing torch (2-3 s
    of the launcher's start on a small CPU host; `cuda_available`)."""
    if device == "cpu" or (device == "auto" and not cuda_available()):
        return "cpu", 0
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and num_gpus == 0:
        raise RuntimeError("--device cuda was asked for, but torch sees no GPU")
    return ("cuda", num_gpus) if num_gpus else ("cpu", 0)


def child_environment(
    base: Mapping[str, str], cluster_token: str, api_key: str | None
) -> dict[str, str]:
    """`base` with the secrets every child of the cluster shares."""
    env = dict(base)
    env[CLUSTER_TOKEN_ENV] = cluster_token
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


def tensor_parallel_size(spec: ClusterSpec, role: str) -> int:
    return spec.engine_of(role).tensor_parallel_size or 1


def gpus_per_worker(spec: ClusterSpec, role: str) -> int:
    """A worker's GPUs: one per rank, those of both engines for a pd server."""
    return tensor_parallel_size(spec, role) * (2 if role == "pd" else 1)


def used_roles(spec: ClusterSpec) -> list[str]:
    return [role for role in WORKER_ROLES if getattr(spec.roles, role).count]


def check_gpu_count(spec: ClusterSpec, num_gpus: int) -> None:
    """ClusterError when a cluster with tensor-parallel workers needs more GPUs than the host
    has (one-GPU workers may share GPUs)."""
    roles = used_roles(spec)
    if all(tensor_parallel_size(spec, role) == 1 for role in roles):
        return
    needed = sum(getattr(spec.roles, role).count * gpus_per_worker(spec, role) for role in roles)
    if needed > num_gpus:
        raise ClusterError(
            f"The cluster needs {needed} GPUs (tensor_parallel_size of them per worker, twice "
            f"that per pd server) but this host has {num_gpus}; use fewer workers or smaller "
            "tensor_parallel_size values."
        )


def check_model_splits(spec: ClusterSpec) -> None:
    """ClusterError when a role's tensor_parallel_size cannot split the model (its attention
    heads, KV heads, MLP, experts), by the rule the worker refuses such a size with."""
    from tandem.distributed.sharding import check_tensor_parallel
    from tandem.models.source import resolve_model

    for role in used_roles(spec):
        size = tensor_parallel_size(spec, role)
        if size == 1:
            continue
        engine = spec.engine_of(role)
        try:
            config = resolve_model(spec.model_of(role)).config
            check_tensor_parallel(config, size, "--enable-expert-parallel" in engine.extra_args)
        except ValueError as exc:
            raise ClusterError(f"roles.{role}: {exc}.") from None


def kv_transport_of(spec: ClusterSpec, role: str, on_gpus: bool) -> str | None:
    """The role's --kv-transport, `auto` resolved."""
    transport = spec.engine_of(role).kv_transport
    return auto_transport(on_gpus) if transport == "auto" else transport


def plan_processes(
    spec: ClusterSpec, device: str, num_gpus: int, python: str = sys.executable
) -> list[ProcessPlan]:
    """The workers, then the router, with their command lines (nothing is started); a
    ClusterError when the GPUs do not suffice."""
    if device == "cuda":
        check_gpu_count(spec, num_gpus)
    plans: list[ProcessPlan] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": [], "auto": []}
    next_gpu = 0
    for role in WORKER_ROLES:
        size = tensor_parallel_size(spec, role)
        for index in range(getattr(spec.roles, role).count):
            slot = len(plans)
            port = spec.worker_port_base + slot
            url = f"http://127.0.0.1:{port}"
            argv = [python, "-m", "tandem.cli", "worker", "--model", spec.model_of(role)]
            argv += ["--role", role, "--host", "127.0.0.1", "--port", str(port)]
            if spec.served_model_name:
                argv += ["--served-model-name", *spec.served_model_name]
            argv += ["--kv-port", str(spec.kv_port_base + slot), "--device"]
            if device != "cuda":
                argv.append(device)
            else:
                argv.append(f"cuda:{next_gpu % num_gpus}")
                if role == "pd":
                    argv += ["--decode-device", f"cuda:{(next_gpu + size) % num_gpus}"]
                next_gpu += gpus_per_worker(spec, role)
            transport = kv_transport_of(spec, role, on_gpus=device == "cuda")
            engine = spec.engine_of(role).model_copy(update={"kv_transport": transport})
            argv += engine.worker_flags()
            plans.append(ProcessPlan(f"{role}-{index}", tuple(argv), url, role))
            urls["both" if role == "pd" else role].append(url)  # whole requests, to a router
    router = spec.router
    argv = [python, "-m", "tandem.cli", "router", "--host", router.host]
    argv += ["--port", str(spec.ports.router)]
    flags = (("prefill", "--prefill"), ("decode", "--decode"), ("both", "--worker"))
    for role, flag in (*flags, ("auto", "--auto")):
        for url in urls[role]:
            argv += [flag, url]
    if router.prefill_policy:
        argv += ["--prefill-policy", router.prefill_policy]
    if router.decode_policy:
        argv += ["--decode-policy", router.decode_policy]
    for name in ADAPTIVE_ROUTER_KEYS:
        if (value := getattr(router, name)) is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if router.allowed_origins:
        argv += ["--allowed-origins", *router.allowed_origins]
    if device == "cuda":  # the workers' loops keep awake on GPUs: the router's does as long
        from tandem.engine.config import BUSY_POLL_CUDA_S

        argv += ["--busy-poll-s", str(BUSY_POLL_CUDA_S)]
    argv += router.extra_args
    router_url = f"http://127.0.0.1:{spec.ports.router}"
    plans.append(ProcessPlan("router", tuple(argv), router_url, "router"))
    return plans


def expected_router_counts(plans: list[ProcessPlan]) -> dict[str, int]:
    """The workers of `plans` by role, as the router's /health counts them at the start (an
    auto worker starts on decode duty)."""
    counts = {"prefill": 0, "decode": 0, "both": 0}
    for plan in plans:
        role = {"pd": "both", "auto": "decode"}.get(plan.role, plan.role)
        if role in counts:
            counts[role] += 1
    return counts

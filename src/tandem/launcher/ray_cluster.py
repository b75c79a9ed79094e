"""`tandem serve --ray [ADDRESS]`: the cluster of `tandem.launcher.plan`, run on a Ray cluster.

One placement group holds a bundle per planned process (the workers, then the router): a worker
asks for one CPU and, on GPUs, one GPU per rank (twice that for a pd server), the router for
one CPU, each also for its role's `ray.nodes` custom resources. `ray.placement` pack is Ray's
PACK (as few nodes as possible), spread its SPREAD. Each process runs under an actor in its
bundle (`ray_processes.ProcessHost`), on its node's address; workers register with the router
(`--router`: the router's node address and port), which starts with no static workers. The KV
transport `auto` is picked by where the workers landed, one for the whole cluster since any
prefill pairs with any decode: cuda-ipc when they share one node's GPUs, else nixl when every
worker's node has it, else tcp (always tcp on CPUs, where nixl over UCX's TCP took twice tcp's
time), whatever the workers' tensor-parallel sizes.

Supervision (`ray_processes.RaySupervisor`) as on one host: `ready at URL/v1` once every process
is healthy and the router's pool holds the workers; a process that exits, or whose actor dies
(Ray restarts the actor in its bundle), is started again after a backoff; `max_start_failures`
failed starts in a row stop everything (exit 1). Ctrl-C or SIGTERM stops the processes, the
router first (SIGTERM, then SIGKILL after `stop_timeout_s`), kills the actors, removes the
placement group and ends the connection to Ray, which shuts down a Ray it started; a second
Ctrl-C skips the wait. The secrets reach each process in its environment through `launch`'s
arguments, never on a command line. Ray is imported only when asked for.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import urlsplit

from tandem.launcher.cluster import ClusterError, ClusterSpec, RaySpec
from tandem.launcher.plan import (
    ProcessPlan,
    gpus_per_worker,
    plan_processes,
)

RAY_MISSING = "tandem serve: --ray needs Ray, which is not installed: pip install 'tandem[ray]'"
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
KV_PAIR_ROLES = ("prefill", "decode", "auto")  # any of them may hand KV to any other
ROUTER_WORKER_FLAGS = ("--prefill", "--decode", "--worker", "--auto")
WILDCARD_HOSTS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class HostInfo:
    """Where a process's actor landed."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]  # the node's GPU indices Ray gave the actor, ascending
    python: str  # the node's interpreter, which runs the process
    has_nixl: bool


# ---- placement (plain data, no Ray) ------------------------------------------------------------


def ray_device(device: str, cluster_gpus: float) -> str:
    """The cluster file's device on a Ray cluster: `auto` is cuda when the cluster has GPUs."""
    if device == "cuda" and not cluster_gpus:
        raise ClusterError("The device is cuda, but the Ray cluster has no GPU.")
    return "cuda" if device == "cuda" or (device == "auto" and cluster_gpus) else "cpu"


def bundle_of(spec: ClusterSpec, plan: ProcessPlan, device: str) -> dict[str, float]:
    """The resources of `plan`'s bundle (and actor)."""
    nodes = (spec.ray or RaySpec()).nodes.get(plan.role, {})
    if plan.role == "router":
        return {"CPU": 1.0, **nodes}
    ranks = float(gpus_per_worker(spec, plan.role))
    return {"CPU": ranks, **({"GPU": ranks} if device == "cuda" else {}), **nodes}


def kv_transport_on_ray(spec: ClusterSpec, device: str, workers: list[HostInfo]) -> str:
    """What `auto` becomes, by where the workers that hand KV to each other landed."""
    if device == "cuda" and len({host.node_id for host in workers}) == 1:
        return "cuda-ipc"
    if device == "cuda" and all(host.has_nixl for host in workers):
        return "nixl"
    return "tcp"


def with_kv_transport(spec: ClusterSpec, transport: str) -> ClusterSpec:
    """`spec` with `auto` resolved to `transport` in the roles that pair up (a pd server's
    engines share one node: its own `auto` stays for the plan to resolve)."""
    roles = spec.roles
    for role in KV_PAIR_ROLES:
        role_spec = getattr(roles, role)
        if role_spec.engine.kv_transport == "auto":
            engine = role_spec.engine.model_copy(update={"kv_transport": transport})
            roles = roles.model_copy(update={role: role_spec.model_copy(update={"engine": engine})})
    return spec.model_copy(update={"roles": roles})


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def placed_url(plan: ProcessPlan, host: HostInfo) -> str:
    """`plan`'s URL on the node it landed on."""
    return f"http://{_url_host(host.node_ip)}:{urlsplit(plan.url).port}"


def _cuda_device(name: str, gpu_ids: tuple[int, ...]) -> str:
    """The first of a worker's GPUs, whose ranks take the next ones."""
    if list(gpu_ids) != list(range(gpu_ids[0], gpu_ids[0] + len(gpu_ids))):
        raise RuntimeError(
            f"Ray gave {name} the GPUs {list(gpu_ids)}, not consecutive ones as its ranks "
            "need; free whole runs of GPUs on the nodes"
        )
    return f"cuda:{gpu_ids[0]}"


def placed_argv(plan: ProcessPlan, host: HostInfo, router_url: str) -> list[str]:
    """`plan`'s command line on the node it landed on: its interpreter, its address, its GPUs; a
    worker registers with `router_url`, the router waits for workers to register."""
    argv = [host.python, *plan.argv[1:]]
    if plan.role == "router":
        argv = [
            arg
            for index, arg in enumerate(argv)
            if arg not in ROUTER_WORKER_FLAGS and argv[index - 1] not in ROUTER_WORKER_FLAGS
        ]
        if argv[argv.index("--host") + 1] not in WILDCARD_HOSTS:
            _set_flag(argv, "--host", host.node_ip)
        return argv
    _set_flag(argv, "--host", host.node_ip)
    if host.gpu_ids:
        if plan.role == "pd":  # its prefill engine's GPUs, then its decode engine's
            half = len(host.gpu_ids) // 2
            _set_flag(argv, "--device", _cuda_device(plan.name, host.gpu_ids[:half]))
            _set_flag(argv, "--decode-device", _cuda_device(plan.name, host.gpu_ids[half:]))
        else:
            _set_flag(argv, "--device", _cuda_device(plan.name, host.gpu_ids))
    return [*argv, "--router", router_url]


# ---- the cluster on Ray -----------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does


def _interrupt_on_signals() -> dict[int, Any]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt (also where the shell ignored SIGINT, or Ray
    set its own SIGTERM handler); returns the handlers they had."""
    return {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


class RayCluster:
    """The placement group and the actors of one `tandem serve --ray`, for `tear_down`."""

    def __init__(self, spec: ClusterSpec, out: TextIO) -> None:
        self.spec = spec
        self.out = out
        self.placement_group: Any = None
        self.actors: list[Any] = []

    def _say(self, message: str) -> None:
        print(f"tandem serve: {message}", file=self.out, flush=True)

    def place(self, startup_timeout_s: float) -> tuple[list[ProcessPlan], list[HostInfo]]:
        """Creates the placement group and an actor in each bundle; returns the plans (the KV
        transport resolved by where the workers landed) and where each landed. Raises
        ClusterError when the cluster cannot be placed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tandem.launcher.ray_processes import ProcessHost

        spec = self.spec
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        device = ray_device(spec.device, num_gpus)
        plans = plan_processes(spec, device, num_gpus)
        bundles = [bundle_of(spec, plan, device) for plan in plans]
        strategy = STRATEGIES[(spec.ray or RaySpec()).placement]
        self.placement_group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=startup_timeout_s)
        except GetTimeoutError:
            raise ClusterError(
                f"The Ray cluster found no room in {startup_timeout_s:g} s for the bundles "
                f"{bundles} ({strategy}); it has {ray.available_resources()} free."
            ) from None
        host_class = ray.remote(ProcessHost)
        for index, (plan, bundle) in enumerate(zip(plans, bundles, strict=True)):
            where = PlacementGroupSchedulingStrategy(self.placement_group, index)
            custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
            options = host_class.options(
                max_restarts=-1,  # in its bundle; the launcher starts the process again
                max_task_retries=-1,  # a call in flight as the actor died runs on its restart
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources=custom,
                scheduling_strategy=where,
            )
            self.actors.append(options.remote(plan.name))
        try:
            hosts = ray.get([actor.describe.remote() for actor in self.actors])
        except RayActorError as exc:
            raise ClusterError(f"The Ray actors did not start: {exc}") from None
        workers = [
            host for plan, host in zip(plans, hosts, strict=True) if plan.role in KV_PAIR_ROLES
        ]
        transport = kv_transport_on_ray(spec, device, workers)
        plans = plan_processes(with_kv_transport(spec, transport), device, num_gpus)
        for plan, host in zip(plans, hosts, strict=True):
            gpus = f", GPUs {list(host.gpu_ids)}" if host.gpu_ids else ""
            self._say(f"{plan.name} on node {host.node_ip} ({host.node_id[:8]}{gpus})")
        self._say(
            f"{device} workers on {len({h.node_id for h in workers})} node(s); KV: {transport}"
        )
        return plans, hosts

    def tear_down(self, stop_timeout_s: float) -> None:
        """Stops every process, kills every actor, removes the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:  # the router first: what it streams finishes on workers that still serve
            for group in (self.actors[-1:], self.actors[:-1]):
                stops = [actor.stop.remote(stop_timeout_s) for actor in group]
                if stops:
                    ray.wait(stops, num_returns=len(stops), timeout=stop_timeout_s + 5)
        except KeyboardInterrupt:
            self._say("killing everything at once")
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def serve_on_ray(
    spec: ClusterSpec,
    secrets: dict[str, str],
    *,
    startup_timeout_s: float,
    stop_timeout_s: float,
    max_start_failures: int,
    unresponsive_timeout_s: float,
    out: TextIO = sys.stdout,
) -> int:
    """Runs `spec` on Ray until Ctrl-C or SIGTERM (0) or a failed start (1); 2 when it cannot
    start for a reason the user can fix (no Ray, an unreachable cluster, no room)."""
    try:
        import ray
    except ImportError:
        print(RAY_MISSING, file=sys.stderr)
        return 2
    address = (spec.ray or RaySpec()).address
    previous = _interrupt_on_signals()
    cluster = RayCluster(spec, out)
    try:
        try:
            ray.init(address=address)
            _interrupt_on_signals()
        except (ConnectionError, ValueError, RuntimeError) as exc:
            print(
                f"tandem serve: cannot reach Ray at {address or 'this host'}: {exc}",
                file=sys.stderr,
            )
            return 2
        try:
            plans, hosts = cluster.place(startup_timeout_s)
        except ClusterError as exc:
            print(f"tandem serve: {exc}", file=sys.stderr)
            return 2
        from tandem.launcher.ray_processes import RaySupervisor

        supervisor = RaySupervisor(
            plans,
            cluster.actors,
            placed_url(plans[-1], hosts[-1]),  # the router's
            secrets,
            startup_timeout_s=startup_timeout_s,
            max_start_failures=max_start_failures,
            unresponsive_timeout_s=unresponsive_timeout_s,
            out=out,
        )
        return supervisor.supervise()
    except KeyboardInterrupt:
        print("tandem serve: stopping", file=out, flush=True)
        return 0
    finally:
        try:
            if ray.is_initialized():
                cluster.tear_down(stop_timeout_s)
                ray.shutdown()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

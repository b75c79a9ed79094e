"""What `tandem serve` starts: the cluster description, from a YAML file and/or flags
(docs/router.md, "The cluster file").

    model: smollm2-135m-instruct
    served_model_name: [smollm2]  # names in the API (default: the model's)
    device: auto                  # auto | cpu | cuda
    roles:
      prefill: {count: 1, engine: {block_size: 16, kv_transport: tcp, tensor_parallel_size: 2}}
      decode:  {count: 1, engine: {block_size: 16, kv_transport: tcp}}
      both:    {count: 0}
      pd:      {count: 0}          # servers over a prefill and a decode engine (--role pd)
      auto:    {count: 0}          # prefill, decode or whole, as the router's planner assigns
    ports: {router: 8000, workers: 8100, kv: 8200}
    router: {prefill_policy: prefix-aware, disaggregation: conditional,
             max_local_prefill_length: 512, max_prefill_queue_tokens: 8192}

Unknown keys are refused, and so is a cluster that cannot work, each in one sentence naming
the problem (`ClusterError`; the list: docs/router.md, "The cluster file"): roles of different
models, or KV layouts, or transports; prefill without decode workers or the reverse; overlapping
port ranges; a tensor-parallel worker sized in extra_args; a secret in the file (it comes from
`tandem serve`'s flags or environment). A prefill or auto role without a kv_transport takes
the decode role's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem import DEFAULT_MODEL

KV_TRANSPORTS = ("auto", "tcp", "cuda-ipc", "nixl", "mooncake")
SECRET_FLAGS = ("--cluster-token", "--api-key")  # never in a file, never on a command line


class ClusterError(ValueError):
    """A cluster description that cannot be started; the message is one sentence."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Strict):
    """Worker flags for one role; each set field becomes `--field-name value`."""

    block_size: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, gt=0)
    num_kv_blocks: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    # ranks per worker (--tensor-parallel-size): N GPUs each on CUDA, N processes on the CPU
    tensor_parallel_size: int | None = Field(default=None, gt=0)
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    # auto: cuda-ipc on GPUs (of one host), else tcp; nixl and mooncake when named
    kv_transport: Literal["auto", "tcp", "cuda-ipc", "nixl", "mooncake"] | None = None
    # tool_choice "auto" answered with calls found in this format (--enable-auto-tool-choice)
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None  # chat reasoning split off
    chat_template: str | None = None  # a Jinja template, or a file holding one
    extra_args: tuple[str, ...] = ()

    def worker_flags(self) -> list[str]:
        flags: list[str] = []
        for name, value in self:
            if name == "extra_args" or value is None:
                continue
            if name == "tool_call_parser":
                flags.append("--enable-auto-tool-choice")
            flags += [f"--{name.replace('_', '-')}", str(value)]
        return flags + list(self.extra_args)


class RoleSpec(_Strict):
    count: int = Field(default=0, ge=0)
    model: str | None = None
    engine: EngineSettings = EngineSettings()


class RolesSpec(_Strict):
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    both: RoleSpec = RoleSpec()
    pd: RoleSpec = RoleSpec()
    auto: RoleSpec = RoleSpec()


WORKER_ROLES = tuple(RolesSpec.model_fields)  # in the order their workers are planned


class PortsSpec(_Strict):
    router: int = Field(default=8000, gt=0, lt=65536)
    workers: int | None = Field(default=None, gt=0, lt=65536)  # default: router + 100
    kv: int | None = Field(default=None, gt=0, lt=65536)  # default: router + 200


class RouterSpec(_Strict):
    host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()  # browser origins answered (CORS)
    prefill_policy: Literal["prefix-aware", "least-outstanding", "round-robin"] | None = None
    decode_policy: Literal["least-outstanding", "round-robin", "prefix-aware"] | None = None
    # conditional disaggregation and the planner of auto workers: `tandem router`'s flags
    disaggregation: Literal["always", "conditional"] | None = None
    max_local_prefill_length: int | None = Field(default=None, ge=0)
    max_prefill_queue_tokens: int | None = Field(default=None, ge=0)
    planner_prefill_queue_high: int | None = Field(default=None, ge=0)
    planner_prefill_queue_low: int | None = Field(default=None, ge=0)
    planner_decode_tpot_high_ms: int | None = Field(default=None, ge=0)
    planner_decode_kv_high: float | None = Field(default=None, ge=0, le=1)
    planner_dwell_s: float | None = Field(default=None, ge=0)
    planner_idle_s: float | None = Field(default=None, ge=0)
    extra_args: tuple[str, ...] = ()


class RaySpec(_Strict):
    """`tandem serve --ray` (tandem.launcher.ray_cluster): where the processes go on Ray."""

    address: str | None = None  # ray.init's (None: $RAY_ADDRESS, a local `ray start`, or a new one)
    placement: Literal["pack", "spread"] = "pack"  # as few nodes as possible, or across nodes
    # per role (or router): custom node resources its processes also ask for, which pick its nodes
    nodes: dict[Literal["prefill", "decode", "both", "pd", "auto", "router"], dict[str, float]] = {}


def _check_ray_nodes(ray: RaySpec) -> None:
    for role, resources in ray.nodes.items():
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ClusterError(
                    f"ray.nodes.{role} asks for {amount:g} {name}; it names custom node "
                    "resources only, each a positive amount (CPUs and GPUs follow from the "
                    "role's tensor_parallel_size)."
                )


class ClusterSpec(_Strict):
    model: str = DEFAULT_MODEL
    served_model_name: tuple[str, ...] = ()  # every worker's --served-model-name
    device: Literal["auto", "cpu", "cuda"] = "auto"
    roles: RolesSpec = RolesSpec()
    ports: PortsSpec = PortsSpec()
    router: RouterSpec = RouterSpec()
    ray: RaySpec | None = None  # a Ray cluster runs it (as with `tandem serve --ray`)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_or_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    def model_of(self, role: str) -> str:
        return getattr(self.roles, role).model or self.model

    @property
    def worker_port_base(self) -> int:
        return self.ports.workers if self.ports.workers is not None else self.ports.router + 100

    @property
    def kv_port_base(self) -> int:
        return self.ports.kv if self.ports.kv is not None else self.ports.router + 200

    @property
    def num_workers(self) -> int:
        roles = self.roles
        return sum(getattr(roles, role).count for role in WORKER_ROLES)

    def engine_of(self, role: str) -> EngineSettings:
        """The role's engine settings, with a prefill (or auto) kv_transport defaulting to
        decode's."""
        engine = getattr(self.roles, role).engine
        if role in ("prefill", "auto") and engine.kv_transport is None:
            return engine.model_copy(update={"kv_transport": self.roles.decode.engine.kv_transport})
        return engine


def _describe(value: object) -> str:
    return "the worker default" if value is None else str(value)


def _check_same_kv(spec: ClusterSpec, role: str, other: str) -> None:
    """Auto workers exchange KV with `other`'s: one layout, one transport."""
    for field in ("block_size", "dtype", "kv_transport"):
        value, other_value = (
            getattr(spec.engine_of(role), field),
            getattr(spec.engine_of(other), field),
        )
        if value != other_value:
            raise ClusterError(
                f"roles.{role}.engine.{field} ({_describe(value)}) differs from "
                f"roles.{other}.engine.{field} ({_describe(other_value)}); workers that hand KV "
                "to each other must share one KV layout and transport."
            )


TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp")


def _check_tensor_parallel(spec: ClusterSpec, role: str) -> None:
    """The size is a key that placement reads (every transport moves a tensor-parallel
    worker's KV: tcp through its rank 0, the others rank by rank)."""
    engine = spec.engine_of(role)
    for arg in engine.extra_args:
        if arg.split("=", 1)[0] in TENSOR_PARALLEL_FLAGS:
            raise ClusterError(
                f"roles.{role}.engine.extra_args holds {arg}; give the size as "
                f"roles.{role}.engine.tensor_parallel_size, by which tandem serve places GPUs."
            )


def check_cluster(spec: ClusterSpec) -> ClusterSpec:
    """Returns `spec` if it can work, else raises ClusterError naming the first problem."""
    roles = spec.roles
    counts = {name: getattr(roles, name).count for name in WORKER_ROLES}
    if sum(counts.values()) == 0:
        raise ClusterError("The cluster has no workers: give prefill, decode, both or pd a count.")
    if counts["prefill"] and not counts["decode"] and not counts["auto"]:
        raise ClusterError(
            "The cluster has prefill workers but no decode worker to continue their requests."
        )
    if counts["decode"] and not counts["prefill"] and not counts["auto"]:
        raise ClusterError(
            "The cluster has decode workers but no prefill worker to feed them; use role both "
            "for colocated workers."
        )
    used = [name for name, count in counts.items() if count]
    for name in used[1:]:
        if spec.model_of(name) != spec.model_of(used[0]):
            raise ClusterError(
                f"roles.{name} serves {spec.model_of(name)} but roles.{used[0]} serves "
                f"{spec.model_of(used[0])}; every role must serve the same model."
            )
    if counts["prefill"] and counts["decode"]:
        decode = roles.decode.engine
        if decode.kv_transport is None:
            raise ClusterError(
                "roles.decode.engine.kv_transport is not set, so the decode workers have no way "
                "to receive KV from the prefill workers; set it to auto, tcp or cuda-ipc."
            )
        for field in ("block_size", "dtype", "kv_transport"):
            prefill_value = getattr(spec.engine_of("prefill"), field)
            decode_value = getattr(decode, field)
            if prefill_value != decode_value:
                raise ClusterError(
                    f"roles.prefill.engine.{field} ({_describe(prefill_value)}) differs from "
                    f"roles.decode.engine.{field} ({_describe(decode_value)}); prefill and decode "
                    "must share one KV layout and transport."
                )
    kv_roles = [name for name in ("prefill", "decode") if counts[name]]
    if counts["auto"] and kv_roles:
        _check_same_kv(spec, "auto", kv_roles[-1])
    transports = {spec.engine_of(name).kv_transport for name in used}
    if spec.device == "cpu" and "cuda-ipc" in transports:
        raise ClusterError("The cuda-ipc KV transport needs GPUs, but the device is cpu.")
    for name in used:
        _check_tensor_parallel(spec, name)
    if spec.ray is not None:
        _check_ray_nodes(spec.ray)
    worker_ports = range(spec.worker_port_base, spec.worker_port_base + spec.num_workers)
    kv_ports = range(spec.kv_port_base, spec.kv_port_base + spec.num_workers)
    if worker_ports.stop > 65536 or kv_ports.stop > 65536:
        raise ClusterError("The worker or KV port range runs past port 65535.")
    if spec.ports.router in worker_ports or spec.ports.router in kv_ports:
        raise ClusterError(
            f"The router port {spec.ports.router} falls in a worker or KV port range."
        )
    if set(worker_ports) & set(kv_ports):
        raise ClusterError(
            f"The worker ports ({worker_ports.start}-{worker_ports.stop - 1}) overlap the KV ports "
            f"({kv_ports.start}-{kv_ports.stop - 1})."
        )
    return spec


def _secret_in(node: Any, where: str = "") -> str | None:
    """Where in plain data a secret sits (a cluster_token key, a secret flag), if anywhere."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "cluster_token":
                return path
            found = _secret_in(value, path)
            if found:
                return found
    elif isinstance(node, list):
        for arg in node:
            if str(arg).split("=", 1)[0] in SECRET_FLAGS:
                return f"{where} ({arg})"
    return None


def _refuse_secrets(data: dict[str, Any]) -> None:
    where = _secret_in(data)
    if where is not None:
        raise ClusterError(
            f"{where}: a cluster file must not hold a secret (it is the kind of file that gets "
            "committed, and the flags it holds show in process lists); give the cluster token "
            "to tandem serve with --cluster-token or the environment variable "
            "TANDEM_CLUSTER_TOKEN, the API key with --api-key or TANDEM_API_KEY."
        )


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown key {where}."
    return f"{where}: {error['msg']}."


def parse_cluster(data: Any, source: str | None = None) -> ClusterSpec:
    """A checked ClusterSpec from plain data (a parsed YAML document from file `source`)."""
    prefix = f"{source}: " if source else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ClusterError(f"{prefix}the top level must be a mapping of keys to values.")
    try:
        _refuse_secrets(data)
        return check_cluster(ClusterSpec.model_validate(data))
    except ValidationError as exc:
        raise ClusterError(prefix + _first_error(exc)) from None
    except ClusterError as exc:
        raise ClusterError(prefix + str(exc)) from None


def load_cluster_file(path: str | Path) -> dict[str, Any]:
    """The YAML document of a cluster file, as plain data (checked by `parse_cluster`)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ClusterError(f"Cannot read the cluster file {path}: {exc.strerror}.") from None
    except yaml.YAMLError as exc:
        raise ClusterError(f"{path} is not valid YAML: {exc}.") from None
    return {} if data is None else data


def merge_overrides(data: Any, overrides: dict[str, Any]) -> Any:
    """`data` with the dotted keys of `overrides` (e.g. "roles.prefill.count") set."""
    if not isinstance(data, dict):
        return data
    merged: dict[str, Any] = dict(data)
    for dotted, value in overrides.items():
        node = merged
        *parents, leaf = dotted.split(".")
        for key in parents:
            child = node.get(key)
            if child is None:
                child = {}
            if not isinstance(child, dict):
                break  # a malformed file: leave it for validation to name
            node[key] = dict(child)
            node = node[key]
        else:
            node[leaf] = value
    return merged


def append_args(data: Any, dotted: str, args: list[str]) -> Any:
    """`data` with `args` after the list at the dotted key (e.g. "router.extra_args"), which
    they start if it is missing; a malformed file is left for validation to name."""
    if not args:
        return data
    existing: Any = data
    for key in dotted.split("."):
        existing = existing.get(key) if isinstance(existing, dict) else None
    if existing is None:
        existing = []
    if not isinstance(existing, list):
        return data
    return merge_overrides(data, {dotted: [*existing, *args]})

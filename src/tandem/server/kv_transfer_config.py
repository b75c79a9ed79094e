"""vLLM's `--kv-transfer-config '{...}'` on `tandem worker`, mapped onto tandem's own flags, so
that a vLLM PD launch script runs with `vllm serve` changed to `tandem worker`.

    vLLM key                   tandem
    kv_role                    --role: kv_producer -> prefill, kv_consumer -> decode,
                               kv_both -> both (with a KV transport: serves either leg)
    kv_connector               NixlConnector -> --kv-transport nixl, MooncakeConnector ->
                               mooncake (the same libraries), P2pNcclConnector and
                               PyNcclConnector -> tcp (worker to worker), each said in the log
                               (a --kv-transport given beside it wins: cuda-ipc between GPUs of
                               one host); a connector that keeps KV in storage or a cache
                               service (LMCache, SharedStorage, Offloading, Multi) or an unknown
                               one is refused
    kv_ip, kv_port             --kv-host, --kv-port
    kv_load_failure_policy     --kv-load-failure-policy (recompute | fail)
    engine_id, kv_buffer_*,    ignored, said in the log: they tune vLLM's connectors
    kv_rank, kv_parallel_size,
    kv_connector_extra_config, ...

Any other key, or a value of the wrong type, is refused when the flags are parsed. A flag given
beside the config with another value than the config's is refused too (`apply`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.server.worker_flags import LOAD_FAILURE_POLICIES

# vLLM's point-to-point connectors, and the transport tandem moves the same KV over
CONNECTOR_TRANSPORTS = {
    "NixlConnector": "nixl",
    "MooncakeConnector": "mooncake",
    "P2pNcclConnector": "tcp",
    "PyNcclConnector": "tcp",
}
# vLLM's connectors that keep KV in storage, a cache service or host memory (or combine others)
STORAGE_CONNECTORS = (
    "LMCacheConnectorV1",
    "LMCacheMPConnector",
    "SharedStorageConnector",
    "OffloadingConnector",
    "MultiConnector",
    "DecodeBenchConnector",
)
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# vLLM's keys that tune its own connectors: nothing to map them to
IGNORED_KEYS = (
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_rank",
    "kv_parallel_size",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
)
KNOWN_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_load_failure_policy")


@dataclass(frozen=True)
class MappedKVConfig:
    """What a --kv-transfer-config means here: worker flags (by argparse dest) and log lines."""

    flags: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def parse_kv_transfer_config(text: str) -> MappedKVConfig:
    """argparse type of --kv-transfer-config: the JSON object, mapped; else a sentence."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, as vLLM's")
    try:
        return map_kv_transfer_config(config)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def map_kv_transfer_config(config: dict[str, Any]) -> MappedKVConfig:
    unknown = sorted(set(config) - set(KNOWN_KEYS) - set(IGNORED_KEYS))
    if unknown:
        raise ValueError(
            f"unknown key {', '.join(unknown)}; vLLM's keys are "
            f"{', '.join(KNOWN_KEYS + IGNORED_KEYS)}"
        )
    flags: dict[str, Any] = {}
    notes: list[str] = []
    if "kv_role" in config:
        role = config["kv_role"]
        if role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, not {role!r}")
        flags["role"] = ROLES[role]
    if "kv_connector" in config:
        connector = config["kv_connector"]
        if connector in STORAGE_CONNECTORS:
            raise ValueError(
                f"kv_connector {connector} keeps KV outside the workers, which tandem does not: "
                f"its PD workers hand KV over directly; use one of "
                f"{', '.join(CONNECTOR_TRANSPORTS)}"
            )
        if connector not in CONNECTOR_TRANSPORTS:
            raise ValueError(
                f"kv_connector {connector!r} is unknown; tandem takes "
                f"{', '.join(CONNECTOR_TRANSPORTS)}"
            )
        transport = CONNECTOR_TRANSPORTS[connector]
        flags["kv_transport"] = transport
        notes.append(
            f"--kv-transfer-config: {connector} maps to tandem's {transport} KV transport "
            "(--kv-transport cuda-ipc for GPU to GPU on one host)"
        )
    if "kv_ip" in config:
        if not isinstance(config["kv_ip"], str) or not config["kv_ip"]:
            raise ValueError("kv_ip must be a host name or address")
        flags["kv_host"] = config["kv_ip"]
    if "kv_port" in config:
        port = config["kv_port"]
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"kv_port must be a port number (0 to 65535), not {port!r}")
        flags["kv_port"] = port
    if "kv_load_failure_policy" in config:
        policy = config["kv_load_failure_policy"]
        if policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be recompute or fail, not {policy!r}")
        flags["kv_load_failure_policy"] = policy
    ignored = [key for key in IGNORED_KEYS if key in config]
    if ignored:
        notes.append(
            f"--kv-transfer-config: {', '.join(ignored)} ignored (they tune vLLM's connectors)"
        )
    return MappedKVConfig(flags, tuple(notes))


def apply(args: argparse.Namespace, defaults: dict[str, Any]) -> tuple[str, ...]:
    """Set the flags args.kv_transfer_config maps to; returns its log lines. A flag given with
    another value (one that is not its default) is refused, except --kv-transport, which picks
    the transport over the connector's."""
    mapped: MappedKVConfig | None = args.kv_transfer_config
    if mapped is None:
        return ()
    for dest, value in mapped.flags.items():
        given = getattr(args, dest)
        if dest == "kv_transport" and given is not None:
            continue
        if given != defaults[dest] and given != value:
            flag = "--" + dest.replace("_", "-")
            raise SystemExit(
                f"tandem worker: {flag} {given} disagrees with --kv-transfer-config, which "
                f"means {flag} {value}: give one of them"
            )
        setattr(args, dest, value)
    return mapped.notes

"""Starts a cluster's processes, waits until all are healthy, and stops every one of them.

Each child (`python -m tandem.cli worker|router ...`) runs in its own process group, so a
terminal's Ctrl-C reaches only the launcher, which then stops the groups in order: SIGTERM to all,
SIGKILL to whatever is left after `stop_timeout_s`. On Linux each child also gets
PR_SET_PDEATHSIG=SIGKILL, so it dies with the launcher even when the launcher is SIGKILLed.
A child that exits on its own stops the whole cluster, and the launcher exits non-zero naming it.

Ports: workers take `worker_port_base + i`, and `kv_port_base + i` for their KV listener, in the
order prefill, decode, both, pd. With GPUs, the workers take the GPUs in that order (mod the
number of GPUs), one each as `--device cuda:i`, two for a pd server (`--device cuda:i
--decode-device cuda:i+1`); every worker sees the same GPUs under the same indices, which CUDA
IPC between them needs. The KV transport `auto` becomes cuda-ipc on GPUs (all workers share this
host) and tcp on CPUs. The router gets pd servers as colocated (`--worker`) workers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import httpx

from tandem.launcher.cluster import WORKER_ROLES, ClusterSpec

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessPlan:
    name: str  # "prefill-0", ..., "router"
    argv: tuple[str, ...]
    url: str
    role: str  # "prefill" | "decode" | "both" | "pd" | "router"


def resolve_device(device: str) -> tuple[str, int]:
    """("cpu" or "cuda", number of GPUs); `auto` means cuda when torch sees a GPU."""
    if device == "cpu":
        return "cpu", 0
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and num_gpus == 0:
        raise RuntimeError("--device cuda was asked for, but torch sees no GPU")
    return ("cuda", num_gpus) if num_gpus else ("cpu", 0)


def plan_processes(
    spec: ClusterSpec, device: str, num_gpus: int, python: str = sys.executable
) -> list[ProcessPlan]:
    """The workers, then the router, with their command lines (nothing is started)."""
    transport = "cuda-ipc" if device == "cuda" else "tcp"
    plans: list[ProcessPlan] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    next_gpu = 0  # one GPU per worker, two per pd server (its prefill's, then its decode's)
    for role in WORKER_ROLES:
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
            elif role == "pd":
                argv += [f"cuda:{next_gpu % num_gpus}"]
                argv += ["--decode-device", f"cuda:{(next_gpu + 1) % num_gpus}"]
                next_gpu += 2
            else:
                argv.append(f"cuda:{next_gpu % num_gpus}")
                next_gpu += 1
            engine = spec.engine_of(role)
            if engine.kv_transport == "auto":
                engine = engine.model_copy(update={"kv_transport": transport})
            argv += engine.worker_flags()
            plans.append(ProcessPlan(f"{role}-{index}", tuple(argv), url, role))
            urls["both" if role == "pd" else role].append(url)  # whole requests, to a router
    router = spec.router
    argv = [python, "-m", "tandem.cli", "router", "--host", router.host]
    argv += ["--port", str(spec.ports.router)]
    for role, flag in (("prefill", "--prefill"), ("decode", "--decode"), ("both", "--worker")):
        for url in urls[role]:
            argv += [flag, url]
    if router.prefill_policy:
        argv += ["--prefill-policy", router.prefill_policy]
    if router.decode_policy:
        argv += ["--decode-policy", router.decode_policy]
    if router.allowed_origins:
        argv += ["--allowed-origins", *router.allowed_origins]
    if device == "cuda":  # the workers' loops keep awake on GPUs: the router's does as long
        from tandem.engine.config import BUSY_POLL_CUDA_S

        argv += ["--busy-poll-s", str(BUSY_POLL_CUDA_S)]
    argv += router.extra_args
    router_url = f"http://127.0.0.1:{spec.ports.router}"
    plans.append(ProcessPlan("router", tuple(argv), router_url, "router"))
    return plans


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the child die when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    prctl = libc.prctl
    parent_pid = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


class Supervisor:
    def __init__(
        self,
        plans: list[ProcessPlan],
        *,
        startup_timeout_s: float,
        stop_timeout_s: float,
        out: TextIO = sys.stdout,
    ) -> None:
        self.plans = plans
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.out = out
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._signal: int | None = None

    def _say(self, message: str) -> None:
        print(f"tandem serve: {message}", file=self.out, flush=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is not None:  # a second Ctrl-C: no more waiting
            self._kill_all(signal.SIGKILL)
        self._signal = signum

    def _start(self) -> None:
        hook = _die_with_parent_hook()
        for plan in self.plans:
            self.processes[plan.name] = subprocess.Popen(
                plan.argv,
                start_new_session=True,
                preexec_fn=hook,
            )

    def _dead_child(self) -> str | None:
        """A message naming the first child that exited, or None while all run."""
        for plan in self.plans:
            code = self.processes[plan.name].poll()
            if code is not None:
                return f"{plan.name} ({plan.url}) exited with code {code}"
        return None

    def _expected_router_counts(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0, "both": 0}
        for plan in self.plans:
            role = "both" if plan.role == "pd" else plan.role  # as the router counts them
            if role in counts:
                counts[role] += 1
        return counts

    def _is_ready(self, client: httpx.Client, plan: ProcessPlan) -> bool:
        try:
            response = client.get(plan.url + "/health")
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        if plan.role != "router":
            return True
        try:
            return response.json().get("workers") == self._expected_router_counts()
        except ValueError:
            return False

    def _wait_until_ready(self) -> str | None:
        """None once every process is healthy, else why the cluster cannot start."""
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = list(self.plans)
        with httpx.Client(timeout=0.5) as client:
            while waiting:
                if self._signal is not None:
                    return "interrupted while starting"
                dead = self._dead_child()
                if dead is not None:
                    return dead
                if time.monotonic() > deadline:
                    names = ", ".join(plan.name for plan in waiting)
                    return f"not healthy after {self.startup_timeout_s:g} s: {names}"
                waiting = [plan for plan in waiting if not self._is_ready(client, plan)]
                if waiting:
                    time.sleep(0.2)
        return None

    def _kill_all(self, signum: int) -> None:
        for process in self.processes.values():
            try:
                os.killpg(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_all(self) -> None:
        self._kill_all(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_all(signal.SIGKILL)  # stragglers, and grandchildren of exited children
        for process in self.processes.values():
            process.wait()

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self._start()
            problem = self._wait_until_ready()
            if problem is not None:
                if self._signal is not None:
                    self._say("stopping")
                    return 0
                self._say(f"the cluster did not start: {problem}; stopping everything")
                return 1
            self._say(f"ready at {self.plans[-1].url}/v1")
            while self._signal is None:
                dead = self._dead_child()
                if dead is not None:
                    self._say(f"{dead}; stopping everything")
                    return 1
                time.sleep(0.2)
            self._say("stopping")
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

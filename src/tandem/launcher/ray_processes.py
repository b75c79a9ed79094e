"""The processes of a `tandem serve --ray` cluster: the actor that hosts each one on its node,
and the launcher's supervision of them all (`tandem.launcher.ray_cluster` places them).

`ProcessHost`, one actor per planned process in its bundle of the placement group: `describe`
says where it landed (node, address, GPUs, Python); `launch` starts the process there, its
command line placed on the node (`placed_argv`), the secrets merged into its environment (never
on its command line); `status` reports an exit, or `/health` checked from the node; `stop` ends
it. The process runs in a session of its own (its group holds its engine core), with
PR_SET_PDEATHSIG=SIGKILL set from the actor's main thread, which Ray runs every call on, so it
dies with the actor however the actor ends (`ray.kill`, a crash, the launcher gone).

`RaySupervisor`, in the launcher, keeps one call in flight per actor and restarts, as
`tandem.launcher.supervisor` does on one host: a process that exits, or whose actor died (Ray
restarts the actor in its bundle, and a call in flight then runs on the new one, which has no
process), is launched again after a backoff (1 s doubling to 30 s, from 1 s again after
`backoff_reset_s` healthy), and so is one that answered no health check for
`unresponsive_timeout_s` after it was healthy (stopped first); `max_start_failures` failed
starts in a row end the cluster. It prints `ready at URL/v1` once every process is healthy and
the router's pool holds the workers.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from tandem.kv.data import installed
from tandem.launcher.plan import ProcessPlan, expected_router_counts
from tandem.launcher.ray_cluster import HostInfo, placed_argv, placed_url
from tandem.launcher.supervisor import (
    LIVENESS_CHECK_TIMEOUT_S,
    LIVENESS_INTERVAL_S,
    RestartPolicy,
    _kill_group,
    is_healthy,
)
from tandem.lifetime import die_with_parent

POLL_INTERVAL_S = 0.5


class ProcessHost:
    def __init__(self, name: str) -> None:
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines, and its repr_name
        return self.name

    def describe(self) -> HostInfo:
        import ray

        context = ray.get_runtime_context()
        return HostInfo(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(sorted(int(gpu) for gpu in ray.get_gpu_ids())),
            python=sys.executable,
            has_nixl=installed("nixl"),
        )

    def launch(self, plan: ProcessPlan, router_url: str, secrets: dict[str, str]) -> int:
        """Starts the planned process on this node; returns its pid."""
        self.stop(0.0)
        host = self.describe()
        env = {**os.environ, **secrets}
        if host.gpu_ids:  # every GPU of the node by its own index, as cuda-ipc needs
            env.pop("CUDA_VISIBLE_DEVICES", None)
        self.url = placed_url(plan, host)
        self.process = subprocess.Popen(
            placed_argv(plan, host, router_url),
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        return self.process.pid

    def status(self, check_health: bool) -> dict[str, Any]:
        """{"running": bool, "exit_code": the code of an exit seen now (reported once), and
        with `check_health`, "health": /health's HTTP status or None, "workers": the router's
        pool counts or None}."""
        answer: dict[str, Any] = {"running": False, "exit_code": None}
        if self.process is None:
            return answer
        code = self.process.poll()
        if code is not None:
            _kill_group(self.process, signal.SIGKILL)  # grandchildren holding ports or memory
            self.process.wait()
            self.process = None
            return {"running": False, "exit_code": code}
        answer["running"] = True
        if not check_health:
            return answer
        try:
            response = httpx.get(self.url + "/health", timeout=LIVENESS_CHECK_TIMEOUT_S)
        except httpx.HTTPError:
            return answer | {"health": None}
        try:
            workers = response.json().get("workers")
        except (ValueError, AttributeError):
            workers = None
        return answer | {"health": response.status_code, "workers": workers}

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the process's group, SIGKILL to what is left after `timeout_s`."""
        if self.process is None:
            return
        _kill_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(self.process, signal.SIGKILL)
        self.process.wait()
        self.process = None


# ---- the launcher's side -------------------------------------------------------------------------


@dataclass
class RayChild:
    """One planned process, its actor, and its life under supervision."""

    plan: ProcessPlan
    actor: Any
    backoff_s: float
    pending: Any = None  # the ObjectRef of the call in flight to the actor
    pending_call: str = ""  # "launch" | "status"
    called_at: float = 0.0
    running: bool = False
    started_at: float = 0.0
    healthy_since: float | None = None
    last_answer: float = 0.0  # when it last answered a health check, once healthy
    checked_at: float = 0.0  # when its health was last asked for, once healthy
    restart_at: float = 0.0
    restarts: int = 0
    failed_starts: int = 0  # in a row
    router_health: dict[str, Any] | None = None  # the router's last status


class RaySupervisor:
    def __init__(
        self,
        plans: list[ProcessPlan],
        actors: list[Any],
        router_url: str,
        secrets: dict[str, str],
        *,
        startup_timeout_s: float,
        max_start_failures: int,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        backoff_reset_s: float = 60.0,
        unresponsive_timeout_s: float = 30.0,
        out: TextIO = sys.stdout,
    ) -> None:
        self.children = [
            RayChild(plan, actor, initial_backoff_s)
            for plan, actor in zip(plans, actors, strict=True)
        ]
        self.router_url = router_url
        self.secrets = secrets
        self.startup_timeout_s = startup_timeout_s
        self.restart_policy = RestartPolicy(
            max_start_failures,
            initial_backoff_s,
            max_backoff_s,
            backoff_reset_s,
            unresponsive_timeout_s,
        )
        self.out = out
        self.router = next(child for child in self.children if child.plan.role == "router")
        self.expected_counts = expected_router_counts(plans)
        self.ready = False

    def _say(self, message: str) -> None:
        print(f"tandem serve: {message}", file=self.out, flush=True)

    def _call(self, child: RayChild) -> None:
        """Puts the child's next call to its actor in flight, if one is due."""
        now = time.monotonic()
        if child.running:  # health until healthy, the router's pool until ready, then liveness
            check_health = child.healthy_since is None or (child is self.router and not self.ready)
            if not check_health and now - child.checked_at >= LIVENESS_INTERVAL_S:
                check_health, child.checked_at = True, now
            child.pending, child.pending_call = child.actor.status.remote(check_health), "status"
        elif now >= child.restart_at:
            launch = child.actor.launch.remote(child.plan, self.router_url, self.secrets)
            child.pending, child.pending_call = launch, "launch"
        child.called_at = now

    def _ended(self, child: RayChild, why: str) -> str | None:
        """Schedules the restart of a child whose process ended; returns why the cluster must
        stop instead, when this was one failed start too many."""
        child.running = False
        delay = self.restart_policy.schedule(child, time.monotonic())
        if delay is None:
            return (
                f"{child.plan.name} failed to start {child.failed_starts} times in a row, "
                f"the last time: {why}"
            )
        child.healthy_since = None
        self._say(f"{child.plan.name} {why}; restarting in {delay:g} s (restart {child.restarts})")
        return None

    def _healthy(self, child: RayChild, status: dict[str, Any]) -> bool:
        return is_healthy(child.plan.role, status.get("health"))

    def _settle(self, child: RayChild) -> str | None:
        """Takes the answer of the child's call; returns why the cluster must stop."""
        import ray
        from ray.exceptions import RayActorError, RayError

        call, ref, child.pending = child.pending_call, child.pending, None
        try:
            answer = ray.get(ref)
        except RayActorError as exc:  # an actor Ray gave up on
            return self._ended(child, f"lost its actor: {exc}")
        except RayError as exc:
            return self._ended(child, f"failed in its actor: {getattr(exc, 'cause', exc)}")
        now = time.monotonic()
        if call == "launch":
            child.running, child.started_at, child.healthy_since = True, now, None
            return None
        if not answer["running"]:
            code = answer["exit_code"]
            why = (
                f"exited with code {code}"
                if code is not None
                else "lost its actor (Ray restarted it)"
            )
            return self._ended(child, why)
        if child is self.router and not self.ready:
            child.router_health = answer
        if child.healthy_since is not None:
            answered = self._healthy(child, answer)
            if "health" in answer and self.restart_policy.unresponsive(child, answered, now):
                child.actor.stop.remote(0.0)
                return self._ended(child, self.restart_policy.unresponsive_why())
            return None
        if self._healthy(child, answer):
            if self.restart_policy.healthy(child, now):
                self._say(f"{child.plan.name} is healthy again (restart {child.restarts})")
        elif now - child.started_at > self.startup_timeout_s:
            child.actor.stop.remote(0.0)
            return self._ended(child, f"was not healthy after {self.startup_timeout_s:g} s")
        return None

    def _is_ready(self) -> bool:
        if any(child.healthy_since is None for child in self.children):
            return False
        health = self.router.router_health or {}
        counts = health.get("workers")
        return (
            health.get("health") == 200
            and isinstance(counts, dict)
            and all(
                isinstance(counts.get(role), int) and counts[role] >= expected
                for role, expected in self.expected_counts.items()
            )
        )

    def supervise(self) -> int:
        """Runs the cluster until interrupted (KeyboardInterrupt) or a child fails to start
        `max_start_failures` times in a row (returns 1)."""
        import ray

        while True:
            for child in self.children:
                if child.pending is None:
                    self._call(child)
            in_flight = [child.pending for child in self.children if child.pending is not None]
            done = []
            if in_flight:
                done, _ = ray.wait(in_flight, num_returns=len(in_flight), timeout=POLL_INTERVAL_S)
            now = time.monotonic()
            for child in self.children:
                problem = None
                if child.pending is not None and child.pending in done:
                    problem = self._settle(child)
                elif child.pending is not None and now - child.called_at > self.startup_timeout_s:
                    child.pending = None  # an actor Ray cannot place again (its node is gone)
                    why = f"had no answer from its actor in {self.startup_timeout_s:g} s"
                    problem = self._ended(child, why)
                if problem is not None:
                    prefix = "" if self.ready else "the cluster did not start: "
                    self._say(f"{prefix}{problem}; stopping everything")
                    return 1
            if not self.ready and self._is_ready():
                self.ready = True
                self._say(f"ready at {self.router_url}/v1")
            time.sleep(POLL_INTERVAL_S / 2)

"""Starts a cluster's processes, keeps them running, and stops every one of them.

Each child (`python -m tandem.cli worker|router ...`, planned by `tandem.launcher.plan`) runs in
its own process group, so a terminal's Ctrl-C reaches only the launcher, which then stops the
groups: SIGTERM to the router, then (once it exited, or after `stop_timeout_s`) to the workers,
SIGKILL to whatever is left after their `stop_timeout_s` (a second Ctrl-C kills at once). On
Linux each child also gets PR_SET_PDEATHSIG=SIGKILL, so it dies with the launcher even when the
launcher is SIGKILLed.

Supervision. A child is *healthy* once its `GET /health` answers (a worker 200; the router 200
or 503, which it answers while no decode worker is in its pool). A child that exits is restarted
with the same command line, hence on the same ports, after a backoff that starts at
`initial_backoff_s` and doubles up to `max_backoff_s`; it starts again from `initial_backoff_s`
once the child had stayed healthy for `backoff_reset_s` before it exited; so is a child that was
healthy and then answers no health check (one every `LIVENESS_INTERVAL_S`) for
`unresponsive_timeout_s`. Before restarting, the child's process group is SIGKILLed, so no
grandchild (an engine core) keeps its ports or memory. Meanwhile the router takes the worker out
of its pool and back in once healthy. A *failed start* ends before the child was ever healthy: it
exited, or was not healthy within `startup_timeout_s` (then it is killed). `max_start_failures`
failed starts in a row of one child stop the whole cluster; the launcher exits 1 naming it.

Readiness: the launcher prints `ready at URL/v1` once, when every child is healthy and the
router's pool holds at least the workers it started, by role (workers registered by hand in the
same router add to the pool without delaying readiness).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from tandem.launcher.plan import ProcessPlan, expected_router_counts
from tandem.lifetime import die_with_parent

POLL_INTERVAL_S = 0.2
LIVENESS_INTERVAL_S = 1.0  # between two health checks of a child that was healthy
# How long one such check waits: a router streaming to many clients may answer late, not never.
LIVENESS_CHECK_TIMEOUT_S = 2.0


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the child die when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    return functools.partial(die_with_parent, os.getpid())


def is_healthy(role: str, status: int | None) -> bool:
    """Whether a process's /health status (None: no answer) says it is up: a worker's 200, the
    router's 200 or 503 (which it answers while no decode worker is in its pool)."""
    return status == 200 or (role == "router" and status == 503)


def _kill_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that ended starts again ("Supervision" above); the Ray launcher's too."""

    max_start_failures: int = 3
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    backoff_reset_s: float = 60.0
    unresponsive_timeout_s: float = 30.0

    def schedule(self, child: Any, now: float) -> float | None:
        """Schedules the restart of `child` (its backoff_s, healthy_since, failed_starts,
        restarts, restart_at), which ended at `now`: the delay before it, or None when this
        was one failed start too many."""
        if child.healthy_since is None:
            child.failed_starts += 1
            if child.failed_starts >= self.max_start_failures:
                return None
        elif now - child.healthy_since >= self.backoff_reset_s:
            child.backoff_s = self.initial_backoff_s
        delay = child.backoff_s
        child.backoff_s = min(2 * delay, self.max_backoff_s)
        child.restarts += 1
        child.restart_at = now + delay
        return delay

    def healthy(self, child: Any, now: float) -> bool:
        """Records that `child` is healthy since `now` (its failed starts in a row end); True
        when it had been restarted before, which is worth saying."""
        child.healthy_since = child.last_answer = now
        child.failed_starts = 0
        return child.restarts > 0

    def unresponsive(self, child: Any, answered: bool, now: float) -> bool:
        """Records a health check of `child` (healthy since its start, its last_answer) at
        `now`; True when it has answered none for `unresponsive_timeout_s`: it is to be killed
        and restarted."""
        if answered:
            child.last_answer = now
        return now - child.last_answer > self.unresponsive_timeout_s

    def unresponsive_why(self) -> str:
        return f"answered no health check for {self.unresponsive_timeout_s:g} s"


@dataclass
class Child:
    """One planned process and its life under supervision."""

    plan: ProcessPlan
    backoff_s: float  # the delay before its next restart
    process: subprocess.Popen[bytes] | None = None  # None while waiting to restart
    started_at: float = 0.0
    healthy_since: float | None = None  # None until healthy since its last start
    last_answer: float = 0.0  # when it last answered a health check, once healthy
    checked_at: float = 0.0  # when it was last checked, once healthy
    restart_at: float = 0.0
    restarts: int = 0
    failed_starts: int = 0  # in a row


class Supervisor:
    def __init__(
        self,
        plans: list[ProcessPlan],
        *,
        startup_timeout_s: float,
        stop_timeout_s: float,
        max_start_failures: int = 3,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        backoff_reset_s: float = 60.0,
        unresponsive_timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart_policy = RestartPolicy(
            max_start_failures,
            initial_backoff_s,
            max_backoff_s,
            backoff_reset_s,
            unresponsive_timeout_s,
        )
        self.env = dict(env) if env is not None else None
        self.out = out
        self.children = [Child(plan, initial_backoff_s) for plan in plans]
        self.router = next(child for child in self.children if child.plan.role == "router")
        self.expected_counts = expected_router_counts(plans)
        self._stopping = threading.Event()
        self._hook = _die_with_parent_hook()

    def _say(self, message: str) -> None:
        print(f"tandem serve: {message}", file=self.out, flush=True)

    def stop(self) -> None:
        """Ends `supervise` (from a signal handler or another thread); a second call kills."""
        if self._stopping.is_set():
            self._kill_all(signal.SIGKILL)
        self._stopping.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop()

    # ---- one child ----------------------------------------------------------------------------

    def _launch(self, child: Child) -> None:
        child.process = subprocess.Popen(
            child.plan.argv, start_new_session=True, preexec_fn=self._hook, env=self.env
        )
        child.started_at = time.monotonic()
        child.healthy_since = None

    def _answers(self, client: httpx.Client, child: Child, timeout_s: float | None = None) -> bool:
        """Whether the child's /health says it is up, within timeout_s (else the client's)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            status = client.get(child.plan.url + "/health", timeout=timeout).status_code
        except httpx.HTTPError:
            return False
        return is_healthy(child.plan.role, status)

    def _ended(self, child: Child, why: str) -> str | None:
        """Schedules the restart of a child that ended (`why`: how); returns why the cluster
        must stop instead, when this was one failed start too many."""
        assert child.process is not None
        _kill_group(child.process, signal.SIGKILL)  # grandchildren holding ports or memory
        child.process.wait()
        child.process = None
        delay = self.restart_policy.schedule(child, time.monotonic())
        if delay is None:
            return (
                f"{child.plan.name} ({child.plan.url}) failed to start "
                f"{child.failed_starts} times in a row, the last time: {why}"
            )
        self._say(f"{child.plan.name} {why}; restarting in {delay:g} s (restart {child.restarts})")
        return None

    def _tend(self, client: httpx.Client, child: Child) -> str | None:
        """Moves one child along (restart, health, exit); returns why the cluster must stop."""
        now = time.monotonic()
        if child.process is None:
            if now >= child.restart_at:
                self._launch(child)
            return None
        code = child.process.poll()
        if code is not None:
            return self._ended(child, f"exited with code {code}")
        if child.healthy_since is not None:
            if now - child.checked_at < LIVENESS_INTERVAL_S:
                return None
            child.checked_at = now
            answered = self._answers(client, child, LIVENESS_CHECK_TIMEOUT_S)
            if self.restart_policy.unresponsive(child, answered, now):
                return self._ended(child, self.restart_policy.unresponsive_why())
            return None
        if self._answers(client, child):
            if self.restart_policy.healthy(child, now):
                self._say(f"{child.plan.name} is healthy again (restart {child.restarts})")
        elif now - child.started_at > self.startup_timeout_s:
            return self._ended(child, f"was not healthy after {self.startup_timeout_s:g} s")
        return None

    # ---- the cluster --------------------------------------------------------------------------

    def _router_sees_workers(self, client: httpx.Client) -> bool:
        """Whether the router's pool holds at least the workers started, by role."""
        try:
            response = client.get(self.router.plan.url + "/health")
            counts = response.json().get("workers")
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        if response.status_code != 200 or not isinstance(counts, dict):
            return False
        return all(
            isinstance(counts.get(role), int) and counts[role] >= expected
            for role, expected in self.expected_counts.items()
        )

    def _is_ready(self, client: httpx.Client) -> bool:
        return all(
            child.healthy_since is not None for child in self.children
        ) and self._router_sees_workers(client)

    def supervise(self) -> int:
        """Runs the cluster until `stop` (exit status 0) or a child fails to start
        `max_start_failures` times in a row (1); every child is stopped on return."""
        ready = False
        try:
            for child in self.children:
                self._launch(child)
            with httpx.Client(timeout=0.5) as client:
                while not self._stopping.is_set():
                    for child in self.children:
                        problem = self._tend(client, child)
                        if problem is not None:
                            prefix = "" if ready else "the cluster did not start: "
                            self._say(f"{prefix}{problem}; stopping everything")
                            return 1
                    if not ready and self._is_ready(client):
                        ready = True
                        self._say(f"ready at {self.router.plan.url}/v1")
                    self._stopping.wait(POLL_INTERVAL_S)
            self._say("stopping")
            return 0
        finally:
            self._stop_all()

    def run(self) -> int:
        """`supervise`, stopped by SIGINT or SIGTERM (main thread only)."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            return self.supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _processes(self) -> list[subprocess.Popen[bytes]]:
        return [child.process for child in self.children if child.process is not None]

    def _kill_all(self, signum: int) -> None:
        for process in self._processes():
            _kill_group(process, signum)

    def _stop_all(self) -> None:
        """The router first, so that what it streams can finish on workers still serving (and
        their KV leases be collected), then the workers; each given stop_timeout_s."""
        workers = [child for child in self.children if child is not self.router]
        for group in ([self.router], workers):
            processes = [child.process for child in group if child.process is not None]
            for process in processes:
                _kill_group(process, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for process in processes:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill_all(signal.SIGKILL)  # stragglers, and grandchildren of exited children
        for process in self._processes():
            process.wait()

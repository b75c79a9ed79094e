"""The execute-model timeout: an engine whose step does not return ends its process.

A step waits on the device (a kernel, a collective, a peer's values) and nothing in it has a
timeout of its own, so a hung kernel, a tensor-parallel rank that stopped, or a driver that
never answers would hold the engine and every request on it for ever, behind an API that still
answers. `StepWatch` times each call of a step (its launch, the wait for its output) from a
thread: one that has run for TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS (default 300, vLLM's
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS) gets every thread's stack on stderr and the process exits
with code 1; the worker above it sees its engine die and exits for its supervisor to restart it.
Between steps nothing is timed, so an idle engine is never ended.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

STEP_TIMEOUT_ENV = "TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS"
STEP_TIMEOUT_S = 300.0
STEP_CHECK_S = 1.0  # how often the thread looks at the step's age


def step_timeout_s() -> float:
    value = os.environ.get(STEP_TIMEOUT_ENV, "")
    try:
        timeout = float(value) if value else STEP_TIMEOUT_S
    except ValueError:
        timeout = 0.0
    if not timeout > 0:
        raise ValueError(f"{STEP_TIMEOUT_ENV} must be a number of seconds above 0, not {value!r}")
    return timeout


class StepWatch:
    """Ends this process, every thread's stack on stderr, once one call of the step has run for
    `timeout_s` (step_timeout_s()); `waits_for` says on what, in the log line."""

    def __init__(self, waits_for: str) -> None:
        self.timeout_s = step_timeout_s()
        self.waits_for = waits_for
        self._lock = threading.Lock()  # orders a step's start and end against exit_unless...
        self._started: float | None = None  # when the running call began; None between calls
        self._exit_armed = False  # faulthandler ends the process unless the call returns
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="step-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def call(self, function: Callable[[], T]) -> T:
        with self.step():
            return function()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._lock:
            self._started = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._started = None
                if self._exit_armed:
                    faulthandler.cancel_dump_traceback_later()
                    self._exit_armed = False

    def exit_unless_the_step_returns(self, within_s: float) -> bool:
        """If a call of the step is running, end this process (every thread's stack on stderr)
        unless it returns within `within_s`, which replaces the timeout for it; False when no
        call runs."""
        with self._lock:
            if self._started is None:
                return False
            faulthandler.dump_traceback_later(within_s, exit=True)
            self._exit_armed = True
            return True

    def _watch(self) -> None:
        while not self._stopped.wait(STEP_CHECK_S):
            with self._lock:
                if self._started is None or self._exit_armed:
                    continue
                running_s = time.monotonic() - self._started
                if running_s < self.timeout_s:
                    continue
                logger.critical(
                    "the engine's step has run for %.0f s (%s=%g): %s; this process ends, "
                    "every thread's stack on stderr", running_s, STEP_TIMEOUT_ENV,
                    self.timeout_s, self.waits_for,
                )  # fmt: skip
                faulthandler.dump_traceback(all_threads=True)
                os._exit(1)

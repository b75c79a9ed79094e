"""The engine faults of the fault plug-in (TANDEM_TEST_FAULT=`where:token_id[,...]`): the engine
raises on purpose for a request whose prompt holds that token id.

    admit   admission raises once the scheduler holds the request  (the request fails alone)
    update  taking its sampled token after a step raises            (the request fails alone)
    step    the model's forward of the batch that holds it raises   (the batch fails)
    cuda    that forward raises a CUDA error                         (the engine cannot go on)
    slow    each step of a batch that holds it first sleeps SLOW_STEP_S (a request that runs
            for as long as a test needs, whatever the machine's speed)
    hang    the model runner's launch of a batch that holds it never returns (a kernel that
            never ends)
"""

from __future__ import annotations

import importlib
import time

SLOW_STEP_S = 0.02


def parse_faults(value: str) -> dict[str, int]:
    faults = {}
    for item in value.split(","):
        where, _, token_id = item.partition(":")
        faults[where.strip()] = int(token_id)
    return faults


def hang_forever() -> None:
    while True:
        time.sleep(60)


def install(core_module, faults: dict[str, int]) -> None:
    scheduler_class = core_module.Scheduler
    request_class = core_module.Request
    # the engine core's executor when it runs the model in its own process (TP size 1)
    executor_class = importlib.import_module("tandem.executor.uniprocess").UniprocessExecutor

    if "admit" in faults:
        add_request = scheduler_class.add_request

        def failing_add_request(self, request) -> None:
            add_request(self, request)
            if faults["admit"] in request.prompt_token_ids:
                raise RuntimeError("a fault injected in add_request")

        scheduler_class.add_request = failing_add_request

    if "update" in faults:
        check_stop = request_class.check_stop

        def failing_check_stop(self):
            if faults["update"] in self.prompt_token_ids:
                raise KeyError("a fault injected in check_stop")
            return check_stop(self)

        request_class.check_stop = failing_check_stop

    step_faults = {}  # token id -> (exception type, message)
    if "step" in faults:
        step_faults[faults["step"]] = (IndexError, "index out of range in self")
    if "cuda" in faults:
        step_faults[faults["cuda"]] = (RuntimeError, "CUDA error: an illegal memory access")
    slow_token_id = faults.get("slow")
    if step_faults or slow_token_id is not None:
        launch = executor_class.launch_model

        def failing_launch(self, scheduler_output):
            for item in scheduler_output.requests:
                for token_id, (error, message) in step_faults.items():
                    if token_id in item.prompt_token_ids:
                        raise error(message)
            if any(slow_token_id in item.prompt_token_ids for item in scheduler_output.requests):
                time.sleep(SLOW_STEP_S)
            return launch(self, scheduler_output)

        executor_class.launch_model = failing_launch

    if "hang" in faults:  # inside the executor's launch: where the execute-model timeout times
        runner_class = importlib.import_module("tandem.executor.runner").ModelRunner
        runner_launch = runner_class.launch

        def hanging_launch(self, scheduler_output):
            if any(faults["hang"] in item.prompt_token_ids for item in scheduler_output.requests):
                hang_forever()
            return runner_launch(self, scheduler_output)

        runner_class.launch = hanging_launch

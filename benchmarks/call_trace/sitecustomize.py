"""Call tracing for `benchmarks/trace_latency.py`: on a path of PYTHONPATH, every Python process
started with TANDEM_CALL_TRACE_DIR set (a worker's API process and its engine core processes)
records when chosen functions are entered and left, and writes the record to that directory at
exit. The times are time.perf_counter_ns(), one clock for every process of a host. A span
also records, on entering and leaving, its thread's CPU time and its counts of minor page faults
and of voluntary and involuntary context switches: a span whose wall time is far above its CPU
time waited (for the GIL, a lock, the scheduler), one whose CPU time is high ran slowly.

Generators and coroutines record only their creation ("call"): their work runs later.
"""

import os

# (module, qualified name, only the call)
TRACED = [
    ("tandem.server.openai.serving", "start_all", True),
    ("tandem.server.openai.serving", "sse", True),
    ("tandem.server.engine_client", "AsyncEngineClient.generate", True),
    ("tandem.server.pd_client", "DisaggregatedClient.generate", True),
    ("tandem.server.pd_client", "DisaggregatedClient._report_stats", False),
    ("tandem.server.metrics", "WorkerMetrics.update_from_stats", False),
    ("tandem.server.openai.serving", "PrimedStream.__init__", False),
    ("tandem.pd.text", "stop_hold_back", False),
    ("starlette.responses", "StreamingResponse.__call__", True),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send", True),
    ("zmq", "Socket.send", False),
    ("tandem.engine.processor", "InputProcessor.make_requests", False),
    ("tandem.engine.processor", "OutputProcessor.add", False),
    ("tandem.engine.processor", "OutputProcessor.process", False),
    ("tandem.engine.core_process", "handle_message", False),
    ("tandem.engine.core", "EngineCore.step_batch", False),
    ("tandem.engine.scheduler", "Scheduler.schedule", False),
    ("tandem.engine.scheduler", "Scheduler.update_from_output", False),
    ("tandem.executor.runner", "ModelRunner.launch", False),
    ("tandem.executor.runner", "ModelRunner._forward", False),
    ("tandem.executor.sampler", "Sampler.__call__", False),
    ("tandem.kv.control.plane", "ControlPlane.publish", False),
    ("tandem.kv.connector.scheduler", "PDConnectorScheduler.request_finished", False),
    ("tandem.kv.connector.worker", "PDConnectorWorker._load", False),
    ("tandem.kv.connector.worker", "PDConnectorWorker._await_handoff", False),
    ("tandem.kv.data.cuda_ipc", "CudaIpcDataPlane.start_queued_reads", False),
    ("tandem.kv.connector.worker", "PDConnectorWorker._confirm_read", False),
    ("tandem.engine.core", "EngineCore.take_finished_transfers", False),
    ("tandem.executor.cuda_graphs", "DecodeGraphs.load", False),
    ("tandem.executor.cuda_graphs", "DecodeGraphs.replay", False),
    ("tandem.kv.control.server", "KVServer.announce", False),
    ("tandem.kv.control.server", "KVServer._serve_await", False),
    ("tandem.kv.control.client", "KVClient.await_held_announcement", False),
    ("tandem.kv.data.cuda_ipc", "BlockCopier.launch", False),
    ("tandem.executor.input_staging", "InputStaging.upload", False),
    ("tandem.kv.data.cuda_ipc", "copy_blocks_kernel", False),
    ("torch.cuda.streams", "Stream.wait_event", False),
    ("torch.cuda.streams", "Stream.wait_stream", False),
    ("torch.cuda.streams", "Event.record", False),
]


def _install(directory: str) -> None:
    import atexit
    import functools
    import importlib
    import inspect
    import json
    import multiprocessing
    import resource
    import sys
    import threading
    import time

    events: list[tuple] = []
    clock = time.perf_counter_ns

    def thread_state() -> tuple[int, int, int, int]:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return time.thread_time_ns(), usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw

    def traced(label: str, function, call_only: bool):
        if call_only:

            @functools.wraps(function)
            def record_call(*args, **kwargs):
                events.append((clock(), threading.current_thread().name, label, "call"))
                return function(*args, **kwargs)

            return record_call

        @functools.wraps(function)
        def record_span(*args, **kwargs):
            thread = threading.current_thread().name
            events.append((clock(), thread, label, "in", *thread_state()))
            try:
                return function(*args, **kwargs)
            finally:
                events.append((clock(), thread, label, "out", *thread_state()))

        return record_span

    for module_name, qualified_name, call_only in TRACED:
        try:
            owner = importlib.import_module(module_name)
            *path, name = qualified_name.split(".")
            for part in path:
                owner = getattr(owner, part)
            wrapped = traced(qualified_name, getattr(owner, name), call_only)
            if isinstance(inspect.getattr_static(owner, name), staticmethod):
                wrapped = staticmethod(wrapped)
            setattr(owner, name, wrapped)
        except (ImportError, AttributeError) as exc:
            print(f"call trace: {module_name}.{qualified_name} not traced: {exc}", file=sys.stderr)

    def write() -> None:
        record = {
            "pid": os.getpid(),
            "parent": os.getppid(),
            "process": multiprocessing.current_process().name,
            "argv": sys.argv,
            "events": events,
        }
        with open(os.path.join(directory, f"trace-{os.getpid()}.json"), "w") as file:
            json.dump(record, file)

    atexit.register(write)


if directory := os.environ.get("TANDEM_CALL_TRACE_DIR"):
    _install(directory)

"""The API process's handle on the engine core process.

It owns the tokenizer and the output processor: requests go to the core as token ids; token ids
come back and are detokenized here, so the core's step loop never does text work. Each live
request has an asyncio queue that the output loop fills with `SequenceDelta`s. Everything that
crosses to the core and back is a typed message of `tandem.engine.messages` (msgpack).

A request the engine fails (or whose output cannot be detokenized here) ends with an error delta
(status 500) and is aborted in the core; the others go on. The engine process is watched (its
sentinel): the moment it dies, this client is unhealthy, every request in flight ends with a 503
error delta, new ones are refused (`EngineDeadError`, 503), nothing more is sent to the engine,
and `death_listener` is told (the worker then exits, for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from tandem.engine.config import EngineConfig
from tandem.engine.core_process import run_engine_core
from tandem.engine.messages import (
    OUTPUT_DECODER,
    AbortRequests,
    AddRequests,
    EngineInfo,
    EngineInput,
    EngineOutput,
    Fatal,
    NewRequest,
    Outputs,
    Ready,
    ReleaseLease,
    ReleaseRemote,
    SetTokenizer,
    Shutdown,
    StartFailed,
    encode,
)
from tandem.engine.outputs import EngineCoreOutput, TokenLogprobs
from tandem.engine.processor import (
    InputProcessor,
    OutputProcessor,
    SequenceDelta,
    child_request_id,
)
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import tokenizer_json
from tandem.kv.params import (
    HandedOutLeases,
    KVTransferParams,
    WorkerKV,
    check_kv_transfer_params,
    typed,
)

logger = logging.getLogger(__name__)

ENGINE_DIED = "the engine process died; retry"
LAST_OUTPUTS_WAIT_MS = 50  # for what a dead engine sent last (its failed step's errors)


class EngineStartError(RuntimeError):
    """The engine core process could not start; the message says why."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine process is gone: this worker takes no more requests (503) and exits soon."""


class RequestStream:
    """One submitted request's deltas (all its output sequences share the queue); `close()`
    aborts in the core what is still live and forgets the request here."""

    def __init__(self, client: AsyncEngineClient, request_id: str, child_ids: list[str]) -> None:
        self.client = client
        self.request_id = request_id
        self.child_ids = child_ids
        self.queue: asyncio.Queue[SequenceDelta] = asyncio.Queue()
        self.pending = set(child_ids)  # sequences not finished
        self.unstarted: set[str] = set()  # sequences submitted that have no output yet

    @property
    def finished(self) -> bool:
        """Every sequence finished and every delta read."""
        return not self.pending and self.queue.empty()

    async def next(self) -> SequenceDelta:
        delta = await self.queue.get()
        child_id = child_request_id(self.request_id, delta.index)
        if child_id in self.unstarted:
            self.unstarted.discard(child_id)
            self.client._num_unstarted -= 1
        if delta.finish_reason is not None:
            self.pending.discard(child_id)
        return delta

    async def close(self) -> None:
        client = self.client
        if client._children.get(self.request_id) is not self.child_ids:
            return  # closed already
        client._num_unstarted -= len(self.unstarted)
        self.unstarted.clear()
        for child_id in self.child_ids:
            client._queues.pop(child_id, None)
            client.outputs.discard(child_id)
        del client._children[self.request_id]
        if self.pending:
            await client._send(AbortRequests(list(self.pending)))


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, kv_config: Any = None, start_timeout: float = 600):
        self.config = config
        self.kv_config = kv_config
        self.start_timeout = start_timeout
        self.info: EngineInfo | None = None
        self.stats: dict[str, Any] = {}
        self.tokenizer = None
        self.sampling_defaults: dict[str, Any] = {}  # the model's generation config's
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.kv_worker: WorkerKV | None = None  # what a request's kv_transfer_params must fit
        # the lease ids this (prefill) worker's answers gave out, for POST /v1/kv/release
        self.leases = HandedOutLeases(kv_config.lease_timeout_s if kv_config else 0.0)
        self._queues: dict[str, asyncio.Queue] = {}  # child request id -> deltas
        self._children: dict[str, list[str]] = {}  # request id -> child ids
        self._num_unstarted = 0
        self._process: multiprocessing.Process | None = None
        self._output_task: asyncio.Task | None = None
        self._context = zmq.asyncio.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="tandem-")
        self.healthy = False
        self.dead = False  # the engine process died
        self.stats_listener: Callable[[dict[str, Any]], None] | None = None
        # told, with the cause, once the engine process has died (not when shut down)
        self.death_listener: Callable[[str], None] | None = None
        self._died: asyncio.Future | None = None  # done when the engine process died
        self._death_cause: str | None = None  # what the engine said before it went, if it did
        self._stopping = False
        self._death_task: asyncio.Task | None = None

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self, front_end: Awaitable[tuple[Any, dict[str, Any]]] | None = None) -> None:
        """Start the core process and load the front end (tokenizer, sampling defaults) while it
        starts, or take `front_end`, loaded by whoever shares it."""
        self._died = asyncio.get_running_loop().create_future()
        input_address = f"ipc://{self._socket_dir}/in"
        output_address = f"ipc://{self._socket_dir}/out"
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(self.config, self.kv_config, input_address, output_address, os.getpid()),
            name="tandem-engine-core",
            daemon=True,
        )
        self._process.start()
        # readable once the process has ended (at once if it has already)
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_engine_exit)
        # The tokenizer loads here while the core process loads the model: both take seconds.
        if front_end is None:
            front_end = asyncio.to_thread(self.load_front_end)
        self.info, (self.tokenizer, self.sampling_defaults) = await asyncio.gather(
            self._wait_ready(), front_end
        )
        self.inputs = InputProcessor(
            self.tokenizer, self.info.max_model_len, self.info.vocab_size, self.info.eos_token_ids
        )
        # The prompt-length bound reads the whole vocabulary: now, not in the first request.
        await asyncio.to_thread(lambda: self.inputs.bytes_per_token)
        if (as_json := await asyncio.to_thread(tokenizer_json, self.tokenizer)) is not None:
            await self._send(SetTokenizer(as_json, sorted(self.inputs.eos_token_ids)))
        self.outputs = OutputProcessor(self.tokenizer)
        kv = self.kv_config
        self.kv_worker = WorkerKV(
            kv.role if kv else None,
            kv.transport if kv else None,
            self.config.block_size,
            self.inputs.vocab_size,
            self.info.kv_layout,
        )
        self._output_task = asyncio.create_task(self._output_loop())
        if self.dead:
            raise EngineStartError("the engine process exited right after it started")
        self.healthy = True

    def load_front_end(self) -> tuple[Any, dict[str, Any]]:
        """The model's tokenizer and its generation config's sampling defaults, from one look-up
        of the model (for a GGUF file that reads its metadata: seconds)."""
        from tandem.models.source import load_tokenizer, resolve_model, sampling_defaults

        try:
            config = self.config
            source = resolve_model(config.model)
            tokenizer = load_tokenizer(source, config.tokenizer, config.trust_remote_code)
            return tokenizer, sampling_defaults(source)
        except Exception as exc:
            raise EngineStartError(
                f"the tokenizer or the generation config could not load: {exc}"
            ) from exc

    async def _wait_ready(self) -> EngineInfo:
        deadline = asyncio.get_running_loop().time() + self.start_timeout
        while True:
            if await self._output.poll(timeout=500):
                message = OUTPUT_DECODER.decode(await self._output.recv())
                if isinstance(message, Ready):
                    return message.info
                if isinstance(message, StartFailed):
                    raise EngineStartError(message.message)
            if not self._process.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self._process.exitcode} while starting"
                )
            if asyncio.get_running_loop().time() > deadline:
                raise EngineStartError(f"the engine did not start within {self.start_timeout} s")

    async def settle_leases(self, timeout_s: float) -> None:
        """Wait, at most timeout_s, until no block of this engine is leased to a decode worker
        (collected, released or expired), from the engine's stats (sent at least every
        STATS_INTERVAL_S)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.stats.get("kv_blocks_leased") and not self.dead and loop.time() < deadline:
            await asyncio.sleep(0.1)

    async def shutdown(self) -> None:
        self.healthy = False
        self._stopping = True
        self._fail_in_flight("the server is shutting down; retry")
        if self._process is not None and self._process.is_alive():
            await self._send(Shutdown())
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        if self._output_task is not None:
            self._output_task.cancel()
        self._context.destroy(linger=0)
        for name in ("in", "out"):
            path = os.path.join(self._socket_dir, name)
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(self._socket_dir)

    # -- requests --------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return uuid.uuid4().hex

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[SequenceDelta]:
        """Deltas of every output sequence of the request, as they come; aborts the request in
        the core if the consumer stops early. `kv_transfer_params` are a request body's, typed
        here (KVParamsError names a field this worker cannot take)."""
        kv_params = None if kv_transfer_params is None else typed(kv_transfer_params)
        stream = await self.submit(request_id, prompt_token_ids, params, kv_params)
        try:
            while not stream.finished:
                yield await stream.next()
        finally:
            await stream.close()

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_params: KVTransferParams | None = None,
    ) -> RequestStream:
        """Send the request to the core; its deltas are the stream's. Admission errors (a full
        queue, a bad value, params this worker cannot take, a dead engine) raise here. Whoever
        submits closes the stream."""
        if self.dead:
            raise EngineDeadError(ENGINE_DIED)
        max_waiting = self.config.max_waiting
        if params.n > max_waiting:  # each sample waits on its own: n counts against the queue
            raise ValueError(f"n must be at most {max_waiting}, the size of this server's queue")
        if self._num_unstarted + params.n > max_waiting:
            raise QueueFullError(f"{self._num_unstarted} requests are already waiting; retry later")
        if kv_params is not None:
            check_kv_transfer_params(kv_params, self.kv_worker, len(prompt_token_ids))
        first_token_id = kv_params.first_token_id if kv_params else None
        # A handoff's first token comes from the engine once the prefill announced it.
        remote_prefill = bool(kv_params and kv_params.do_remote_prefill) and not (
            kv_params.is_handoff
        )
        unused_lease = None
        if remote_prefill and params.n > 1:  # n samples, n first tokens: all computed here
            unused_lease, kv_params, remote_prefill = kv_params, None, False
        requests = self.inputs.make_requests(request_id, prompt_token_ids, params, kv_params)
        stream = RequestStream(self, request_id, [r.request_id for r in requests])
        self._children[request_id] = stream.child_ids
        to_submit: list[Request] = []
        for index, request in enumerate(requests):
            self._queues[request.request_id] = stream.queue
            self.outputs.add(request_id, request, index)
            if remote_prefill:
                request.output_token_ids.append(first_token_id)
                delta = self._continue_remote(request, first_token_id)
                stream.queue.put_nowait(delta)
                if delta.finish_reason is not None:  # done on its first token: load nothing
                    stream.pending.discard(request.request_id)
                    continue
            to_submit.append(request)
        self._num_unstarted += len(to_submit)
        stream.unstarted.update(r.request_id for r in to_submit)
        try:
            if remote_prefill and not to_submit:
                unused_lease = kv_params
            if unused_lease is not None:
                await self._send(ReleaseRemote(unused_lease))
            if to_submit:
                await self._send(AddRequests([NewRequest.of(r) for r in to_submit]))
        except BaseException:
            await stream.close()
            raise
        return stream

    def _continue_remote(self, request: Request, first_token_id: int) -> SequenceDelta:
        """The first token of a remotely prefilled request is already known: emit it now."""
        first = EngineCoreOutput(
            request.request_id,
            [first_token_id],
            handed_over_logprobs(request, first_token_id),
            num_prompt_tokens=request.num_prompt_tokens,
        )
        status = request.check_stop()
        if status is not None:
            first.finish_reason = status.value
            first.stop_reason = request.stop_reason
        deltas, _ = self.outputs.process([first])
        return deltas[0]

    async def abort(self, request_id: str) -> None:
        child_ids = self._children.get(request_id, [])
        if child_ids:
            await self._send(AbortRequests(child_ids))

    async def release_kv(self, remote_request_id: str) -> bool:
        """Free a lease this worker handed out now; False for an id it does not know (never
        handed out, released, or past its lease's timeout)."""
        if not self.leases.pop(remote_request_id):
            return False
        await self._send(ReleaseLease(remote_request_id))
        return True

    # -- the output loop -------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            data = await self._output.recv()
            try:
                to_abort = self._take(OUTPUT_DECODER.decode(data))
            except Exception:  # never the end of this loop: every request would hang
                logger.exception("the engine's outputs could not be taken")
                continue
            if to_abort:
                await self._send(AbortRequests(to_abort))

    def _take(self, message: EngineOutput) -> list[str]:
        """Hand one message of the engine's outputs to their streams; the child ids to abort
        in the core (a stop string ended them, or their output could not be detokenized)."""
        if isinstance(message, Fatal):  # the engine's last words: its failed step's outputs
            self._death_cause, core_outputs = message.reason, message.outputs
        elif isinstance(message, Outputs):
            core_outputs, self.stats = message.outputs, message.stats
        else:
            return []
        to_abort: list[str] = []
        for output in core_outputs:
            try:
                deltas, stopped = self.outputs.process([output])
            except Exception as exc:  # fails this request alone (an abort ends its lease too)
                logger.exception("the output of %s could not be detokenized", output.request_id)
                error = f"the output of this request could not be detokenized ({exc!r})"
                self._deliver_error(output.request_id, error)
                self.outputs.discard(output.request_id)
                to_abort.append(output.request_id)
                continue
            to_abort.extend(stopped)
            for delta in deltas:
                if delta.kv_transfer_params is not None:  # a prefill leg's lease
                    self.leases.add(delta.kv_transfer_params.remote_request_id)
                queue = self._queues.get(child_request_id(delta.request_id, delta.index))
                if queue is not None:
                    queue.put_nowait(delta)
        if self.stats_listener is not None and isinstance(message, Outputs):
            # After the readers these deltas woke: the metrics wait, the tokens do not.
            asyncio.get_running_loop().call_soon(self.stats_listener, self.stats)
        return to_abort

    async def _send(self, message: EngineInput) -> None:
        """Send a message to the engine; nothing once it is dead. A send that must wait (a full
        queue, or an engine that has just died) gives up when the engine is found dead."""
        if self.dead:
            return
        sending = self._input.send(encode(message))
        if not sending.done():
            await asyncio.wait({sending, self._died}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                sending.cancel()
                return
        sending.result()

    def _on_engine_exit(self) -> None:
        """The engine process has ended (its sentinel is readable)."""
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._stopping:
            return
        self.healthy = False
        self.dead = True
        self._died.set_result(None)
        if self._output_task is not None:  # it had started: what is in flight fails now
            self._death_task = asyncio.get_running_loop().create_task(self._engine_died())

    async def _engine_died(self) -> None:
        """What the engine sent before it went is taken; every request still in flight ends
        with a 503; the death listener is told."""
        self._output_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._output_task
        try:  # its last messages may still be on their way through the socket
            while await self._output.poll(timeout=LAST_OUTPUTS_WAIT_MS):
                self._take(OUTPUT_DECODER.decode(await self._output.recv()))
        except Exception:  # what is left fails below all the same
            logger.exception("the engine's last outputs could not be taken")
        self._fail_in_flight(ENGINE_DIED)
        cause = f"exit code {self._process.exitcode}"
        if self._death_cause is not None:
            cause += f": {self._death_cause}"
        if self.death_listener is not None:
            self.death_listener(cause)

    def _fail_in_flight(self, message: str) -> None:
        """End every unfinished sequence with a 503 error delta: the server cannot finish it."""
        for child_id in list(self._queues):
            if self.outputs is not None and child_id in self.outputs.states:
                self._deliver_error(child_id, message, 503)
                self.outputs.discard(child_id)

    def _deliver_error(self, child_id: str, message: str, status: int = 500) -> None:
        queue = self._queues.get(child_id)
        if queue is None:
            return
        request_id, _, index = child_id.rpartition("-")
        queue.put_nowait(
            SequenceDelta(
                request_id, int(index), "", [], None, "error", error=message, error_status=status
            )
        )


def handed_over_logprobs(request: Request, first_token_id: int) -> list[TokenLogprobs] | None:
    """The first token's logprobs from the prefill's lease, as many top ones as the request
    asks for (None: not asked for, or the lease has none)."""
    wanted = request.sampling_params.logprobs
    given = request.kv_transfer_params and request.kv_transfer_params.first_token_logprobs
    if wanted is None or not given:
        return None
    return [TokenLogprobs(first_token_id, given.logprob, given.top[:wanted], given.rank)]

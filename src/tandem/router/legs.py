"""One upstream call of a request (a leg) and how it ends when its worker is lost.

No leg has a read timeout: a request that takes long (a long generation, a long queue) is never
cut while its worker lives, as with vLLM's own server. A leg ends early only when the pool
gives its worker up for lost (`Worker.when_lost()`, workers.py): `send_leg` then stops waiting
for the answer's head with `WorkerLost`, and an open `Leg` cuts its response, so that a read in
progress raises and `Leg.failure` tells it apart from a worker that broke the connection.
Connecting keeps its timeout.

Invariant: every worker counted in flight by `WorkerPool.begin` is finished exactly once
(`Leg.close`); a leg or response given up while it opens is closed once it opens (`give_up`).
"""

from __future__ import annotations

import asyncio

import aiohttp

from tandem.router.workers import Worker, WorkerPool


class NoWorker(Exception):
    """No worker of the leg's pool could take it."""


class WorkerLost(aiohttp.ClientConnectionError):
    """A leg's worker was given up for lost while the leg waited on it."""


def worker_title(leg_name: str, worker: Worker) -> str:
    """How messages name a leg's worker: the decode worker URL (a plain leg's: the worker URL)."""
    return f"the {'' if leg_name == 'plain' else leg_name + ' '}worker {worker.url}"


def lost_message(leg_name: str, worker: Worker, reason: str) -> str:
    return f"{worker_title(leg_name, worker)} stopped answering ({reason}); request given up"


class Leg:
    """One upstream call: the worker it went to and its (streamed) response. If the pool
    gives the worker up for lost meanwhile, the response is cut: a read in progress raises."""

    def __init__(
        self,
        pool: WorkerPool,
        worker: Worker,
        response: aiohttp.ClientResponse,
        name: str,
        prompt_tokens: int = 0,
    ) -> None:
        self.worker = worker
        self.response = response
        self.name = name
        self.lost_reason: str | None = None
        self._pool = pool
        self._prompt_tokens = prompt_tokens  # counted on the worker until `prefilled`
        self._closed = False
        self._lost = worker.when_lost()
        self._lost.add_done_callback(self._on_worker_lost)

    @property
    def closed(self) -> bool:
        return self._closed

    def _on_worker_lost(self, lost: asyncio.Future[str]) -> None:
        self.lost_reason = lost.result()
        self.response.close()

    def failure(self, exc: BaseException) -> WorkerLost | BaseException:
        """What a read of this leg that raised `exc` means: WorkerLost if its worker was
        lost, else `exc`."""
        if self.lost_reason is None:
            return exc
        return WorkerLost(lost_message(self.name, self.worker, self.lost_reason))

    def prefilled(self) -> None:
        """The worker has computed the leg's prompt (its first byte is here). A stream calls
        it on every event: only the first takes the count back."""
        if self._prompt_tokens:
            self._pool.prefilled(self.worker, self._prompt_tokens)
            self._prompt_tokens = 0

    def close(self) -> None:
        """Finish the leg; a response not read to its end is cut, which aborts it upstream."""
        if self._closed:
            return
        self._closed = True
        self._lost.remove_done_callback(self._on_worker_lost)
        self.response.close()
        self._pool.finish(self.worker, self._prompt_tokens)
        self._prompt_tokens = 0


async def send_leg(
    session: aiohttp.ClientSession,
    worker: Worker,
    leg_name: str,
    path: str,
    payload: bytes,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> aiohttp.ClientResponse:
    """The worker's answer to a leg (its head), as `session.post` gives it; WorkerLost if the
    pool gives the worker up before it answers. The post runs as a task of its own, which the
    worker's loss cancels (about 10 µs a leg)."""
    sending = asyncio.ensure_future(
        session.post(worker.url + path, data=payload, headers=headers, timeout=timeout)
    )
    lost = worker.when_lost()
    stop_sending = lambda _: sending.cancel()  # noqa: E731 (a done callback)
    lost.add_done_callback(stop_sending)
    try:
        return await sending
    except asyncio.CancelledError:  # the worker was lost, or the client left
        give_up(sending)
        if not lost.done() or _cancelled_from_outside():
            raise
        raise WorkerLost(lost_message(leg_name, worker, lost.result())) from None
    finally:
        lost.remove_done_callback(stop_sending)


def _cancelled_from_outside() -> bool:
    """Whether the running task itself is being cancelled (Python 3.11 and later can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


Opening = asyncio.Future[Leg] | asyncio.Future[aiohttp.ClientResponse]


def give_up(opening: Opening) -> None:
    """Cancels a leg (or a worker's response) still opening, and closes it if it opens all the
    same (which aborts it)."""
    if not opening.done():
        opening.cancel()
    opening.add_done_callback(_close_opened)


def _close_opened(task: Opening) -> None:
    """Closes a leg (or a response) whose opening finished after it was given up."""
    if not task.cancelled() and task.exception() is None and not task.result().closed:
        task.result().close()

"""The worker's side of registration: announce this worker to a router, then keep it fresh.

    sender = HeartbeatSender(router_url, worker_url, role, model, token)
    sender.start()   # once the worker's /health answers 200
    ...
    sender.stop()    # on shutdown: stops the heartbeats and deregisters

A daemon thread posts `/internal/workers/register` first and `/internal/workers/heartbeat` every
`interval_s` after (both carry `{"url", "role", "model"}` and `Authorization: Bearer <token>`; a
heartbeat also re-registers a worker the router forgot, e.g. after a router restart). It never
raises into the worker: failures are logged once per change of state, and retried on the next
beat.
"""

from __future__ import annotations

import logging
import threading

import httpx

logger = logging.getLogger("tandem.registration")


class HeartbeatSender:
    def __init__(
        self,
        router_url: str,
        worker_url: str,
        role: str,
        model: str,
        token: str | None,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self.announcement = {"url": worker_url.rstrip("/"), "role": role, "model": model}
        self.interval_s = interval_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem: str | None = ""

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tandem-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the heartbeats and deregisters; returns within about two timeouts."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._timeout_s)
            self._thread = None
        try:
            with httpx.Client(timeout=self._timeout_s) as client:
                client.post(
                    self.router_url + "/internal/workers/deregister",
                    json=self.announcement,
                    headers=self._headers,
                )
        except Exception as exc:  # the worker is shutting down; a lost deregister only delays
            logger.info("could not deregister from %s: %r", self.router_url, exc)

    def _run(self) -> None:
        path = "/internal/workers/register"
        try:
            with httpx.Client(timeout=self._timeout_s) as client:
                while not self._stopping.is_set():
                    if self._beat(client, path):
                        path = "/internal/workers/heartbeat"
                    self._stopping.wait(self.interval_s)
        except Exception:  # never let the thread die with a traceback in the worker's logs
            logger.exception("the heartbeat thread stopped")

    def _beat(self, client: httpx.Client, path: str) -> bool:
        try:
            response = client.post(
                self.router_url + path, json=self.announcement, headers=self._headers
            )
            problem = (
                None if response.status_code == 200 else f"{response.status_code} {response.text}"
            )
        except httpx.HTTPError as exc:
            problem = repr(exc)
        if problem != self._last_problem:
            if problem is None:
                logger.info("registered with the router %s", self.router_url)
            else:
                logger.warning(
                    "the router %s refused or missed a heartbeat: %s", self.router_url, problem
                )
            self._last_problem = problem
        return problem is None

"""A model-free worker that speaks the worker side of docs/protocol.md.

It stands in for `tandem worker` wherever the router must run without an engine: the router's
and the launcher's tests, and `benchmarks/router_overhead.py --fake-workers`, which measures the
router's own cost against workers that answer at once. Run it with
`python tests/fake_worker.py --role prefill|decode|both --port P`.

Its "model" echoes words: the completion of a prompt is the prompt's words in order, cycled, one
word (with a leading space) per token, until `max_tokens` (default 16), or until the next word is
`STOP`, which acts as EOS (finish_reason "stop"). The completion of "a b c" with max_tokens=5 is
" a b c a b"; a prompt that starts with STOP ends on its first token. For chat, the prompt is the
last message's content.

Legs are told apart by `kv_transfer_params` (prefill: `do_remote_decode`, decode:
`do_remote_prefill`, plain: none), and the role is strict so misrouting fails loudly: a prefill
worker takes prefill legs only, a decode worker decode legs and plain requests, a both worker
plain requests only, an auto worker all three. A prefill leg must have the protocol's shape
(stream false, no stream_options, n 1) and samples one token whatever its max_tokens, as a
tandem prefill worker does; a decode leg's kv_transfer_params must match its prompt. A decode
leg told `first_token_sent` streams no text for the first token but what a stop string's
hold-back kept out of the client's first chunk (tandem.pd.text), as a tandem decode worker does.
A model other than its own gets a 404; a bad value of another field it reads (max_tokens, n,
stream, the prompt) a 400, as from a worker.

Test hooks: `GET /fake/stats` (the requests seen, leases released, streams and answers aborted),
`POST /fake/control` (health status, refusal status, delays, the load report /health carries,
exit). A delay of the whole answers (`answer_delay_s`) makes a long generation; one of `/health`
(`health_delay_s`) longer than the router's health timeout makes a wedged worker. With an API
key it wants the key as a tandem worker does (the test hooks stay open).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.access import OPEN_PATHS, api_key_from_env, guard
from tandem.pd.text import shown_first_text, stop_hold_back

EOS_WORD = "STOP"
DEFAULT_MAX_TOKENS = 16
FAKE_MAX_MODEL_LEN = 4096


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 49152


def echo_completion(words: list[str], max_tokens: int) -> tuple[list[str], str]:
    """The fake model: (token texts, finish_reason) for a prompt's words."""
    pieces: list[str] = []
    for index in range(max_tokens):
        word = words[index % len(words)] if words else EOS_WORD
        if word == EOS_WORD:
            return pieces, "stop"
        pieces.append(" " + word)
    return pieces, "length"


def body_problem(endpoint: str, body: dict[str, Any]) -> str | None:
    """What a tandem worker would refuse (a 400) among the fields this fake reads."""

    def count(name: str, most: int) -> bool:
        value = body.get(name)
        return value is None or (type(value) is int and 1 <= value <= most)

    if not (count("max_tokens", 4096) and count("max_completion_tokens", 4096)):
        return "max_tokens must be a count of tokens"
    if not count("n", 16) or not isinstance(body.get("stream", False), bool):
        return "n must be a small count and stream true or false"
    if endpoint == "chat":
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)):
            return "messages must be a list of messages"
        return None
    prompt = body.get("prompt", "")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt):
        return None
    return "prompt must be a string or a list of them or of token ids"


def prompt_words(endpoint: str, body: dict[str, Any]) -> list[str]:
    if endpoint == "chat":
        content = body["messages"][-1].get("content") or ""
        return str(content).split()
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(token) for token in prompt)
    return str(prompt).split()


@dataclass
class FakeControl:
    health_status: int = 200
    refuse_status: int | None = None
    token_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    answer_delay_s: float = 0.0  # before a whole (non-streamed) decode or plain answer
    health_delay_s: float = 0.0
    load: dict[str, int] | None = None  # the load report its /health carries, if any


@dataclass
class FakeStats:
    requests: list[dict[str, Any]] = field(default_factory=list)
    leased: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    completed_streams: int = 0
    aborted_streams: int = 0
    aborted_prefills: int = 0
    aborted_answers: int = 0


def _error(status: int, message: str) -> JSONResponse:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    return JSONResponse({"error": error}, status)


def create_fake_worker(
    role: str,
    model: str,
    control: FakeControl | None = None,
    api_key: str | None = None,
    cluster_token: str | None = None,  # passes the API-key check, as with a tandem worker
) -> FastAPI:
    control = control or FakeControl()
    stats = FakeStats()
    app = FastAPI()
    guard(app, api_key, OPEN_PATHS | {"/fake/stats", "/fake/control"}, cluster_token=cluster_token)
    app.state.control = control
    app.state.stats = stats

    def check_leg(kind: str, body: dict[str, Any], words: list[str]) -> str | None:
        """Why this worker must refuse the leg, or None."""
        allowed = {
            "prefill": ("prefill",),
            "decode": ("decode", "plain"),
            "both": ("plain",),
            "auto": ("prefill", "decode", "plain"),
        }
        if kind not in allowed[role]:
            return f"a {role} worker got a {kind} request"
        if kind == "prefill":
            if body.get("stream") is not False or body.get("stream_options"):
                return "a prefill leg needs stream=false and no stream_options"
            if body.get("n") not in (None, 1):
                return "a prefill leg needs n=1"
        if kind == "decode":
            kv = body["kv_transfer_params"]
            first = token_id(words[0]) if words else None
            if not kv.get("remote_request_id") or kv.get("first_token_id") != first:
                return "the decode leg's kv_transfer_params do not match its prompt"
            if kv.get("num_prompt_tokens") != len(words):
                return "the decode leg's kv_transfer_params do not match its prompt length"
        return None

    def completion(endpoint: str, body: dict[str, Any], pieces: list[str], finish: str) -> dict:
        num_choices = body.get("n") or 1
        text = "".join(pieces)
        if endpoint == "chat":
            choices = [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for index in range(num_choices)
            ]
        else:
            choices = [
                {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
                for index in range(num_choices)
            ]
        return {
            "id": f"fake-{uuid.uuid4().hex}",
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
        }

    def usage(words: list[str], pieces: list[str], finish: str) -> dict[str, int]:
        completion_tokens = len(pieces) + (1 if finish == "stop" else 0)
        return {
            "prompt_tokens": len(words),
            "completion_tokens": completion_tokens,
            "total_tokens": len(words) + completion_tokens,
        }

    async def stream(
        endpoint: str, body: dict[str, Any], words: list[str], pieces: list[str], finish: str
    ) -> AsyncIterator[str]:
        completion_id = f"fake-{uuid.uuid4().hex}"
        base = {"id": completion_id, "created": int(time.time()), "model": model}
        num_choices = body.get("n") or 1

        def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> str:
            if endpoint == "chat":
                delta: dict[str, Any] = {} if text is None else {"content": text}
                if role:
                    delta["role"] = "assistant"
                choices = [
                    {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                    for i in range(num_choices)
                ]
                payload = dict(base, object="chat.completion.chunk", choices=choices)
            else:
                choices = [
                    {
                        "index": i,
                        "text": text or "",
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                    for i in range(num_choices)
                ]
                payload = dict(base, object="text_completion", choices=choices)
            return f"data: {_dumps(payload)}\n\n"

        finished = False
        streamed = list(pieces)
        if streamed and (body.get("kv_transfer_params") or {}).get("first_token_sent"):
            hold_back = stop_hold_back(
                body.get("stop"), bool(body.get("include_stop_str_in_output"))
            )
            streamed[0] = streamed[0][len(shown_first_text(streamed[0], hold_back)) :]
        try:
            if endpoint == "chat":
                yield chunk("", None, role=True)
            for piece in streamed:
                if control.token_delay_s:
                    await asyncio.sleep(control.token_delay_s)
                if piece:
                    yield chunk(piece, None)
            yield chunk(None, finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                object_name = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
                payload = dict(base, object=object_name, choices=[])
                payload["usage"] = usage(words, pieces, finish)
                yield f"data: {_dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if finished:
                stats.completed_streams += 1
            else:
                stats.aborted_streams += 1

    async def serve(endpoint: str, request: Request) -> Response:
        body = await request.json()
        kv = body.get("kv_transfer_params")
        kind = "plain"
        if kv and kv.get("do_remote_decode"):
            kind = "prefill"
        elif kv and kv.get("do_remote_prefill"):
            kind = "decode"
        stats.requests.append({"kind": kind, "endpoint": endpoint, "body": body})
        if control.refuse_status is not None:
            return _error(control.refuse_status, "the fake worker refuses requests now")
        if body.get("model") not in (None, model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        problem = body_problem(endpoint, body)
        if problem is not None:
            return _error(400, problem)
        words = prompt_words(endpoint, body)
        problem = check_leg(kind, body, words)
        if problem is not None:
            return _error(400, problem)

        if kind == "prefill":
            if not await stays_connected(request, control.prefill_delay_s):
                stats.aborted_prefills += 1
                return Response(status_code=499)
            pieces, finish = echo_completion(words, 1)
            answer = completion(endpoint, body, pieces, finish)
            answer["usage"] = usage(words, pieces, finish)
            answer["kv_transfer_params"] = None
            if finish != "stop":
                lease = f"lease-{uuid.uuid4().hex}"
                stats.leased.append(lease)
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": f"fake-{role}",
                    "remote_request_id": lease,
                    "remote_block_ids": [0],
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                    "tp_size": 1,
                    "kv_transport": "fake",
                    "first_token_id": token_id(words[0]),
                    "num_prompt_tokens": len(words),
                    "block_size": 16,
                    "kv_layout": "fake",
                }
            return JSONResponse(answer)

        max_tokens = body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if body.get("max_completion_tokens") is not None:
            max_tokens = body["max_completion_tokens"]
        pieces, finish = echo_completion(words, max_tokens)
        if body.get("stream"):
            return StreamingResponse(
                stream(endpoint, body, words, pieces, finish), media_type="text/event-stream"
            )
        if not await stays_connected(request, control.answer_delay_s):
            stats.aborted_answers += 1
            return Response(status_code=499)
        answer = completion(endpoint, body, pieces, finish)
        answer["usage"] = usage(words, pieces, finish)
        return JSONResponse(answer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve("chat", request)

    @app.post("/v1/kv/release")
    async def release(request: Request) -> Response:
        stats.released.append((await request.json())["remote_request_id"])
        return JSONResponse({"released": True})

    started = int(time.time())

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"object": "model", "created": started, "owned_by": "tandem"}
        data = [dict(card, id=model, max_model_len=FAKE_MAX_MODEL_LEN)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        await asyncio.sleep(control.health_delay_s)
        answer: dict[str, Any] = {"role": role}
        if control.load is not None:
            answer["load"] = control.load
        return JSONResponse(answer, control.health_status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(f"fake_worker_requests_total {len(stats.requests)}\n")

    @app.get("/fake/stats")
    async def get_stats() -> Response:
        return JSONResponse(asdict(stats))

    @app.post("/fake/control")
    async def set_control(request: Request) -> Response:
        changes = await request.json()
        exit_code = changes.pop("exit", None)
        for name, value in changes.items():
            setattr(control, name, value)
        if exit_code is not None:
            asyncio.get_running_loop().call_later(0.05, os._exit, int(exit_code))
        return JSONResponse(asdict(control))

    return app


async def stays_connected(request: Request, seconds: float) -> bool:
    """Waits `seconds`; False as soon as the client disconnects."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            return False
        await asyncio.sleep(0.01)
    return True


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A model-free tandem worker for tests.")
    parser.add_argument("--role", choices=("prefill", "decode", "both", "auto"), default="both")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prefill-delay", type=float, default=0.0)
    parser.add_argument("--router", help="register with this router and send heartbeats")
    parser.add_argument("--cluster-token", default=os.environ.get("TANDEM_CLUSTER_TOKEN"))
    parser.add_argument("--api-key", default=api_key_from_env())
    args = parser.parse_args(argv)
    return serve_fake_worker(
        args.role,
        args.model,
        args.host,
        args.port,
        FakeControl(token_delay_s=args.token_delay, prefill_delay_s=args.prefill_delay),
        router_url=args.router,
        cluster_token=args.cluster_token,
        api_key=args.api_key,
    )


def serve_fake_worker(
    role: str,
    model: str,
    host: str,
    port: int,
    control: FakeControl | None = None,
    router_url: str | None = None,
    cluster_token: str | None = None,
    api_key: str | None = None,
) -> int:
    """Runs a fake worker until SIGINT/SIGTERM; with `router_url`, registers once listening."""
    import uvicorn

    from tandem.router.registration import HeartbeatSender

    app = create_fake_worker(role, model, control, api_key, cluster_token)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    if router_url is None:
        server.run()
        return 0

    sender = HeartbeatSender(router_url, f"http://{host}:{port}", role, model, cluster_token or "")

    async def serve_and_register() -> None:
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        sender.start()
        try:
            await serving
        finally:
            await asyncio.get_running_loop().run_in_executor(None, sender.stop)

    asyncio.run(serve_and_register())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

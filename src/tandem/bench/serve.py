"""`tandem bench serve`: drive an OpenAI-compatible server at a load point, or a sweep of them.

One call: sample the prompts once (each point its own), send the warm-up requests, then for each
load point send its prompts (arrivals from a Poisson / gamma process at `request_rate`, at most
`max_concurrency` in flight), collect one `RequestRecord` per prompt, summarize, print, and
write the JSON.

Invariants:
* Every point sends prompts of its own, drawn with the warm-ups' from one sample of the dataset
  (the same for a given seed), so no prompt of one point is in a server's prefix cache when the
  next point starts; the points' prompts follow one distribution, and the arrival schedule of a
  rate is the same for a given seed, so points differ only in load.
* A point's `duration` runs from its first dispatch to the end of its last request.
* Warm-up requests are never part of any point; a failed warm-up stops the run (the server or the
  flags are wrong and every number would be meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from rich.console import Console

from tandem.bench.client import (
    CHAT_ENDPOINT,
    RequestRecord,
    RequestSettings,
    send_request,
)
from tandem.bench.datasets import DatasetOptions, SampleRequest, Tokenizer, sample_requests
from tandem.bench.errors import BenchError
from tandem.bench.metrics import compute_metrics, parse_goodput
from tandem.bench.report import ProgressBar, make_console, print_point_summary, print_sweep_summary
from tandem.bench.results import (
    per_request_arrays,
    rate_value,
    request_entries,
    write_json,
)

IDLE_CONNECTION_S = 3.0  # how long an idle connection to the server is kept for reuse


@dataclass(frozen=True)
class LoadPoint:
    """One load setting: arrival rate (requests/s, inf = all at once) and a concurrency cap."""

    request_rate: float = math.inf
    max_concurrency: int | None = None

    @property
    def tag(self) -> str:
        """File-name part, as in vLLM's result names: `infqps-concurrency8`, `2.0qps`."""
        concurrency = f"-concurrency{self.max_concurrency}" if self.max_concurrency else ""
        return f"{rate_value(self.request_rate)}qps{concurrency}"


def flag_words(values: str | Sequence[str]) -> list[str]:
    """A multi-value flag's values, given space-separated (`1 4 16`, as the shell splits them),
    comma-separated (`1,4,16`) or both."""
    texts = [values] if isinstance(values, str) else list(values)
    return [word.strip() for text in texts for word in text.split(",") if word.strip()]


def parse_rates(values: str | Sequence[str]) -> list[float]:
    words = flag_words(values)
    try:
        rates = [float(word) for word in words]
    except ValueError:
        rates = []
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--request-rate takes positive numbers or inf, got {' '.join(words)!r}")
    return rates


def parse_concurrencies(values: str | Sequence[str]) -> list[int]:
    words = flag_words(values)
    try:
        concurrencies = [int(word) for word in words]
    except ValueError:
        concurrencies = []
    if not concurrencies or any(value < 1 for value in concurrencies):
        raise ValueError(f"--max-concurrency takes positive integers, got {' '.join(words)!r}")
    return concurrencies


def load_points(
    request_rate: str | Sequence[str], max_concurrency: str | Sequence[str] | None
) -> tuple[str | None, list[LoadPoint]]:
    """The sweep described by the two flags, and which flag is swept (None for a single point).

    Either flag may list several values (space- or comma-separated); not both.
    """
    rates = parse_rates(request_rate)
    concurrencies: list[int | None] = (
        list(parse_concurrencies(max_concurrency)) if max_concurrency else [None]
    )
    if len(rates) > 1 and len(concurrencies) > 1:
        raise ValueError("sweep either --request-rate or --max-concurrency, not both at once")
    if len(concurrencies) > 1:
        return "max_concurrency", [LoadPoint(rates[0], value) for value in concurrencies]
    if len(rates) > 1:
        return "request_rate", [LoadPoint(rate, concurrencies[0]) for rate in rates]
    return None, [LoadPoint(rates[0], concurrencies[0])]


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send times in seconds after the first request (which goes at 0).

    Gaps are gamma-distributed with mean 1/rate and shape `burstiness` (1: Poisson arrivals; below
    1 burstier; inf: evenly spaced), then rescaled so the mean gap is exactly 1/rate.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate) or num_requests < 2:
        return [0.0] * num_requests
    num_gaps = num_requests - 1
    if math.isinf(burstiness):
        gaps = np.full(num_gaps, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_gaps)
        gaps *= (num_gaps / request_rate) / gaps.sum()
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(frozen=True)
class ServeOptions:
    """Everything one `tandem bench serve` call needs, resolved from the flags once."""

    base_url: str
    endpoint: str
    model: str | None
    dataset: DatasetOptions
    points: list[LoadPoint]
    sweep_parameter: str | None = None
    label: str | None = None
    tokenizer_id: str | None = None
    burstiness: float = 1.0
    num_warmups: int = 1
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (90.0, 99.0)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    request_timeout_s: float = 3600.0
    api_key: str | None = None
    result_dir: Path | None = None
    result_filename: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    show_progress: bool = True

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def backend(self) -> str:
        return "openai-chat" if self.chat else "openai"


@dataclass
class SweepOutcome:
    """The point results in sweep order and the files written."""

    results: list[dict[str, Any]]
    files: list[Path]


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists under `GET /v1/models`."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            payload = await response.json(content_type=None)
        return str(payload["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError) as exc:
        raise BenchError(
            f"could not read the model name from {base_url}/v1/models ({exc}); pass --model"
        ) from exc


def sample_points(
    options: ServeOptions, tokenizer: Tokenizer | None
) -> tuple[list[SampleRequest], list[list[SampleRequest]]]:
    """The warm-up prompts and each load point's `num_prompts`, cut from one sample."""
    per_point, num_warmups = options.dataset.num_prompts, options.num_warmups
    total = num_warmups + per_point * len(options.points)
    drawn = sample_requests(replace(options.dataset, num_prompts=total), tokenizer)
    points = [drawn[num_warmups + i * per_point :][:per_point] for i in range(len(options.points))]
    return drawn[:num_warmups], points


async def warm_up(
    session: aiohttp.ClientSession,
    settings: RequestSettings,
    samples: Sequence[SampleRequest],
    max_concurrency: int | None,
) -> None:
    num_warmups = len(samples)
    limit = asyncio.Semaphore(max_concurrency or num_warmups)

    async def one(index: int) -> RequestRecord:
        async with limit:
            return await send_request(session, settings, samples[index], -1 - index)

    records = await asyncio.gather(*(one(index) for index in range(num_warmups)))
    failures = [record.error for record in records if not record.success]
    if failures:
        raise BenchError(
            f"{len(failures)} of {num_warmups} warm-up requests to {settings.api_url} failed, "
            f"first: {failures[0]} (check --base-url, --endpoint and --model)"
        )


async def run_point(
    session: aiohttp.ClientSession,
    settings: RequestSettings,
    samples: Sequence[SampleRequest],
    point: LoadPoint,
    offsets: Sequence[float],
    progress: ProgressBar,
) -> tuple[list[RequestRecord], float, float]:
    """Send every sample at its offset; return the records, the start time and the duration."""
    limit = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    num_failed = 0

    async def one(index: int) -> RequestRecord:
        nonlocal num_failed
        async with limit if limit is not None else contextlib.nullcontext():
            record = await send_request(session, settings, samples[index], index)
        num_failed += not record.success
        progress.request_done(num_failed)
        return record

    progress.start_point(point.tag, len(samples))
    start = time.perf_counter()
    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    records = list(await asyncio.gather(*tasks))
    return records, start, time.perf_counter() - start


def point_result(
    options: ServeOptions,
    model: str,
    point: LoadPoint,
    samples: Sequence[SampleRequest],
    records: Sequence[RequestRecord],
    start: float,
    duration: float,
) -> dict[str, Any]:
    dataset = asdict(options.dataset)
    dataset.pop("chat")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": options.backend,
        "endpoint": options.endpoint,
        "label": options.label or options.backend,
        "base_url": options.base_url,
        "model_id": model,
        "tokenizer_id": options.tokenizer_id,
        **dataset,
        "request_rate": rate_value(point.request_rate),
        "burstiness": options.burstiness,
        "max_concurrency": point.max_concurrency,
        "ignore_eos": options.ignore_eos,
        "temperature": options.temperature,
        "num_warmups": options.num_warmups,
        "goodput_slos_ms": options.goodput_slos_ms or None,
        **options.metadata,
    }
    result.update(compute_metrics(records, duration, options.percentiles, options.goodput_slos_ms))
    result.update(per_request_arrays(records))
    result["requests"] = request_entries(records, samples, start)
    return result


def result_stem(options: ServeOptions, model: str) -> str:
    if options.result_filename:
        return options.result_filename.removesuffix(".json")
    label = options.label or options.backend
    return f"{label}-{model.rsplit('/', 1)[-1]}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def write_outcome(options: ServeOptions, model: str, results: list[dict[str, Any]]) -> list[Path]:
    if options.result_dir is None:
        return []
    stem = result_stem(options, model)
    if options.sweep_parameter is None:
        path = options.result_dir / f"{stem}.json"
        write_json(path, results[0])
        return [path]
    files = []
    for point, result in zip(options.points, results, strict=True):
        files.append(options.result_dir / f"{stem}-{point.tag}.json")
        write_json(files[-1], result)
    combined = options.result_dir / f"{stem}-sweep.json"
    write_json(
        combined,
        {
            "label": options.label or options.backend,
            "model_id": model,
            "base_url": options.base_url,
            "sweep_parameter": options.sweep_parameter,
            "sweep_values": [result[options.sweep_parameter] for result in results],
            "points": results,
        },
    )
    return [*files, combined]


async def run_sweep(
    options: ServeOptions,
    tokenizer: Tokenizer | None = None,
    console: Console | None = None,
    after_point: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> SweepOutcome:
    """Run every load point of `options` against the server; raise BenchError on user errors.
    `after_point` sees each point's result once the point is done, before it is printed and
    written, and may add to it (`tandem bench compare`: what the router decided meanwhile)."""
    console = console or make_console()
    try:
        warmup_samples, point_samples = sample_points(options, tokenizer)
    except (ValueError, OSError) as exc:
        raise BenchError(str(exc)) from exc
    # An idle connection goes back before the server closes it (uvicorn: after 5 s): reusing one
    # the server is closing fails its request with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else None
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        model = options.model or await resolve_model(session, options.base_url)
        settings = RequestSettings(
            api_url=f"{options.base_url}{options.endpoint}",
            model=model,
            chat=options.chat,
            ignore_eos=options.ignore_eos,
            temperature=options.temperature,
            extra_body=options.extra_body,
        )
        if options.num_warmups > 0:
            console.print(f"warming up with {options.num_warmups} request(s)")
            await warm_up(session, settings, warmup_samples, options.points[0].max_concurrency)
        results = []
        with ProgressBar(console, options.show_progress) as progress:
            for point, samples in zip(options.points, point_samples, strict=True):
                rng = np.random.default_rng(options.dataset.seed)
                offsets = arrival_offsets(len(samples), point.request_rate, options.burstiness, rng)
                records, start, duration = await run_point(
                    session, settings, samples, point, offsets, progress
                )
                results.append(
                    point_result(options, model, point, samples, records, start, duration)
                )
                if after_point is not None:
                    await after_point(results[-1])
                print_point_summary(console, results[-1], options.percentiles)
    if len(results) > 1:
        print_sweep_summary(console, results)
    files = write_outcome(options, model, results)
    for path in files:
        console.print(f"wrote {path}")
    return SweepOutcome(results, files)


def options_from_args(
    args: argparse.Namespace,
    *,
    base_url: str,
    model: str | None,
    label: str | None,
    result_dir: Path | None,
    result_filename: str | None,
) -> ServeOptions:
    """Resolve the flags of `tandem bench serve` / `compare` into `ServeOptions`."""
    try:
        sweep_parameter, points = load_points(args.request_rate, args.max_concurrency)
        percentiles = tuple(float(word) for word in args.metric_percentiles.split(",") if word)
        goodput = parse_goodput(args.goodput or [])
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if not isinstance(extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    metadata = dict(item.partition("=")[::2] for item in args.metadata or [])
    dataset = DatasetOptions(
        dataset_name=args.dataset_name,
        num_prompts=args.num_prompts,
        seed=args.seed,
        chat=args.endpoint == CHAT_ENDPOINT,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        random_vocab_min=args.random_vocab_min,
        random_vocab_max=args.random_vocab_max,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.prefix_repetition_output_len,
    )
    return ServeOptions(
        base_url=base_url.rstrip("/"),
        endpoint=args.endpoint,
        model=model,
        dataset=dataset,
        points=points,
        sweep_parameter=sweep_parameter,
        label=label,
        tokenizer_id=args.tokenizer,
        burstiness=args.burstiness,
        num_warmups=args.num_warmups,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra_body,
        percentiles=percentiles,
        goodput_slos_ms=goodput,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        result_dir=result_dir,
        result_filename=result_filename,
        metadata=metadata,
        show_progress=not args.disable_tqdm,
    )


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """The `--tokenizer`: a folder or name for transformers' AutoTokenizer, or a .gguf file whose
    embedded tokenizer is used; None without one. Never downloads."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            gguf_path = Path(path)
            return AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BenchError(f"could not load the tokenizer {path!r}: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    """`tandem bench serve`."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    saving = args.result_dir is not None or args.save_result or args.result_filename is not None
    options = options_from_args(
        args,
        base_url=base_url,
        model=args.served_model_name or args.model,
        label=args.label,
        result_dir=Path(args.result_dir or ".") if saving else None,
        result_filename=args.result_filename,
    )
    outcome = asyncio.run(run_sweep(options, load_tokenizer(args.tokenizer)))
    return int(any(result["completed"] == 0 for result in outcome.results))

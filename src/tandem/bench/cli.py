"""`tandem bench serve | plot | compare`: the serving benchmark and its pictures.

Only argparse (and the package's light top level) is imported here; the benchmark modules
(aiohttp, numpy, rich, matplotlib) load inside the sub-commands' functions. Flag names follow
`vllm bench serve` where it has them; their multi-value flags take values space-separated, and
comma-separated as before.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tandem import DEFAULT_MODEL

DATASET_CHOICES = ("random", "sharegpt", "prefix")
ENDPOINT_CHOICES = ("/v1/completions", "/v1/chat/completions")
CONFIGURATION_CHOICES = ("colocated", "pd", "adaptive")
X_METRIC_CHOICES = ("output_throughput", "request_throughput", "total_token_throughput")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASET_CHOICES, default="random")
    group.add_argument("--dataset-path", help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    group.add_argument("--num-prompts", type=int, default=1000, help="requests per load point")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--tokenizer",
        help="tokenizer folder for transformers' AutoTokenizer, or a .gguf file; without it, "
        "completions prompts are token ids and chat prompts random words",
    )
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1",
    )
    group.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by all")
    group.add_argument("--random-vocab-min", type=int, default=1000, help="lowest random token id")
    group.add_argument(
        "--random-vocab-max", type=int, default=20000, help="random token ids stay below this"
    )
    group.add_argument(
        "--sharegpt-output-len", type=int, help="fixed output length instead of the answer's"
    )
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)


def add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load and requests")
    group.add_argument("--endpoint", choices=ENDPOINT_CHOICES, default="/v1/completions")
    group.add_argument(
        "--request-rate",
        nargs="+",
        default=["inf"],
        metavar="RATE",
        help="requests/s (Poisson arrivals, inf = all at once); several values sweep: 1 2 4 "
        "(or 1,2,4)",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, below 1 burstier, above 1 steadier",
    )
    group.add_argument(
        "--max-concurrency",
        nargs="+",
        metavar="N",
        help="most requests in flight; several values sweep: 1 8 32 128 (or 1,8,32,128)",
    )
    group.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests first")
    group.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--extra-body", help="JSON object merged into every request body")
    group.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    group.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY, which tandem's "
        "servers read too)",
    )


def add_result_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("results")
    group.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    group.add_argument(
        "--metric-percentiles", default="90,99", help="percentiles reported besides the median"
    )
    group.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="copied into the JSON")
    group.add_argument("--disable-tqdm", action="store_true", help="no live progress bar")


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="benchmark a running OpenAI-compatible server",
        description="Send a dataset of streamed requests at one load point or a sweep of them; "
        "print a summary and write JSON results.",
    )
    parser.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    parser.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    parser.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--served-model-name", help="model name to request, if not --model")
    parser.add_argument("--label", help="names the result set (default: the backend)")
    parser.add_argument("--result-dir", help="write JSON results in this folder")
    parser.add_argument("--result-filename", help="file name (a sweep adds point suffixes)")
    parser.add_argument("--save-result", action="store_true", help="write JSON results")
    add_dataset_arguments(parser)
    add_traffic_arguments(parser)
    add_result_arguments(parser)
    parser.set_defaults(func=run_serve)


def add_plot_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="plot latency against throughput for result sets",
        description="TTFT and TPOT (p50 solid, p99 dashed) against throughput, one line per "
        "result set (a sweep file, a point file, or a folder of point files).",
    )
    parser.add_argument("results", nargs="+", help="result files or folders")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title")
    parser.add_argument("--x-metric", choices=X_METRIC_CHOICES, default="output_throughput")
    parser.add_argument(
        "--goodput-panel",
        action="store_true",
        help="a first panel: goodput (req/s within the SLOs of --goodput) against the swept load",
    )
    parser.set_defaults(func=run_plot)


def add_compare_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="colocated vs PD vs adaptive: start each cluster with `tandem serve`, sweep, plot",
        description="On the same GPUs, one cluster at a time: start it with `tandem serve`, "
        "sweep it, stop it. colocated: --both W --prefill 0 --decode 0; pd: --prefill P "
        "--decode D; adaptive: --auto W --prefill 0 --decode 0 --disaggregation conditional "
        "--config RESULT_DIR/adaptive-cluster.yaml (auto workers whose roles the router's "
        "planner sets, short prompts served whole, prefix-aware decode routing, set in that "
        "file). W = P + D. Prints a table of req/s, goodput and TTFT / TPOT p99 per "
        "configuration and load; writes each sweep's JSON, compare.json and one picture "
        "(goodput against load, latency against throughput).",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"passed to `tandem serve --model` (default: {DEFAULT_MODEL}, as for tandem serve)",
    )
    parser.add_argument("--served-model-name", help="model name to request (default: --model)")
    parser.add_argument(
        "--configurations",
        nargs="+",
        choices=CONFIGURATION_CHOICES,
        default=list(CONFIGURATION_CHOICES),
        metavar="NAME",
        help="which clusters run, in this order: colocated, pd, adaptive (default: all three)",
    )
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers of pd")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers of pd")
    parser.add_argument(
        "--num-colocated", type=int, help="workers of the colocated cluster (default: P + D)"
    )
    parser.add_argument(
        "--num-auto", type=int, help="auto workers of the adaptive cluster (default: P + D)"
    )
    parser.add_argument(
        "--port", type=int, help="router port (default: one free below the ephemeral range)"
    )
    parser.add_argument(
        "--serve-command",
        help="command that starts a cluster (default: this Python's `-m tandem.cli serve`)",
    )
    parser.add_argument("--serve-args", default="", help="extra flags for every cluster")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--result-dir", default="bench-compare", help="folder for all outputs")
    parser.add_argument("-o", "--output", help="PNG file (default: RESULT_DIR/compare.png)")
    parser.add_argument("--title")
    parser.add_argument("--x-metric", choices=X_METRIC_CHOICES, default="output_throughput")
    add_dataset_arguments(parser)
    add_traffic_arguments(parser)
    add_result_arguments(parser)
    parser.set_defaults(func=run_compare)


def add_parser(subparsers: Any) -> None:
    """Register `tandem bench` and its sub-commands."""
    parser = subparsers.add_parser("bench", help="serving benchmark and plots")
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(bench_subparsers)
    add_plot_parser(bench_subparsers)
    add_compare_parser(bench_subparsers)


def report_errors(run: Any, args: argparse.Namespace) -> int:
    from tandem.bench.errors import BenchError

    try:
        return int(run(args))
    except BenchError as exc:
        print(f"tandem bench: error: {exc}", file=sys.stderr)
        return 2


def run_serve(args: argparse.Namespace) -> int:
    from tandem.bench import serve

    return report_errors(serve.main, args)


def run_plot(args: argparse.Namespace) -> int:
    from tandem.bench import plot

    return report_errors(plot.main, args)


def run_compare(args: argparse.Namespace) -> int:
    from tandem.bench import compare

    return report_errors(compare.main, args)

"""`tandem bench compare`: the same sweep against colocated, fixed PD and adaptive clusters.

The configurations, on the same GPUs (W = P + D workers unless --num-colocated / --num-auto):
* colocated: `tandem serve --both W --prefill 0 --decode 0`;
* pd: `tandem serve --prefill P --decode D` (a fixed split);
* adaptive: `tandem serve --config RESULT_DIR/adaptive-cluster.yaml --auto W --prefill 0
  --decode 0 --disaggregation conditional --decode-policy prefix-aware`: auto workers whose
  roles the router's planner sets, requests with a short uncached prompt (or a long prefill
  queue) served whole on their decode worker, decode on the worker holding most of the prompt,
  and the file sets what `tandem serve` has no flag for (the auto workers' KV transport, as
  without a file).
For each chosen configuration in turn: start `tandem serve` in its own process group, wait for
`GET /health` == 200 on the router port, run the sweep of `tandem bench serve`, then stop the
whole group (SIGINT, then SIGTERM, then SIGKILL, each after a grace period). Only one cluster runs
at a time, so all get the same hardware. Writes RESULT_DIR/<label>*.json, <label>-serve.log,
compare.json (configuration x load: req/s, goodput, TTFT and TPOT p99, the commands, and what
each cluster's router decided over its sweep and during each load point, the first with the
warm-up: requests served disaggregated or whole, by reason, and the planner's role changes) and
the picture (goodput against load, TTFT and TPOT against throughput), and prints the summary
table.

Invariant: a cluster this command started is stopped before the command returns, whatever
happened in between. One that exits during its sweep is named (console, compare.json) and the
command exits 1 once the others have run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.errors import BenchError
from tandem.bench.plot import plot_result_sets
from tandem.bench.report import make_console, print_comparison_summary
from tandem.bench.results import ResultSet, comparison_rows, comparison_summary, write_json
from tandem.bench.serve import load_tokenizer, options_from_args, run_sweep

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
STOP_GRACE_S = 30.0
HEALTH_POLL_S = 0.5
ADAPTIVE_CLUSTER_FILE = "adaptive-cluster.yaml"
ADAPTIVE_CLUSTER_YAML = """\
# The adaptive configuration of tandem bench compare: what tandem serve has no flag for.
roles:
  decode: {engine: {kv_transport: auto}}  # auto workers take the decode role's KV transport
"""


@dataclass(frozen=True)
class Cluster:
    """One cluster to benchmark: its label, the `tandem serve` flags that shape it, and the files
    (path, text) to write before it starts."""

    label: str
    shape_flags: tuple[str, ...]
    num_workers: int
    files: tuple[tuple[Path, str], ...] = ()


# the adaptive cluster's flags besides its auto workers: no fixed roles, requests with a short
# uncached prompt served whole, decode on the worker holding most of the prompt
ADAPTIVE_FLAGS = ("--prefill", "0", "--decode", "0", "--disaggregation", "conditional")
ADAPTIVE_FLAGS += ("--decode-policy", "prefix-aware")


def clusters_for(args: argparse.Namespace, result_dir: Path) -> list[Cluster]:
    """The chosen configurations (`args.configurations`, in that order, each once)."""
    num_workers = args.num_prefill + args.num_decode
    num_colocated = args.num_colocated or num_workers
    num_auto = args.num_auto or num_workers
    adaptive_file = result_dir / ADAPTIVE_CLUSTER_FILE
    clusters = {
        "colocated": Cluster(
            "colocated",
            ("--both", str(num_colocated), "--prefill", "0", "--decode", "0"),
            num_colocated,
        ),
        "pd": Cluster(
            "pd",
            ("--prefill", str(args.num_prefill), "--decode", str(args.num_decode)),
            num_workers,
        ),
        "adaptive": Cluster(
            "adaptive",
            ("--config", str(adaptive_file), "--auto", str(num_auto), *ADAPTIVE_FLAGS),
            num_auto,
            ((adaptive_file, ADAPTIVE_CLUSTER_YAML),),
        ),
    }
    return [clusters[label] for label in dict.fromkeys(args.configurations)]


PORT_TRIES = 1000


def ephemeral_port_floor() -> int:
    """The first port the kernel hands out to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def cluster_port(num_workers: int) -> int:
    """A router port P for `tandem serve`, whose workers then listen on P+100+i and their KV
    on P+200+i: all of them free now and below the ephemeral range, where no outgoing connection
    (the router's health checks start before the workers listen) can take one first: a 4-GPU
    sweep lost two workers whose ports, picked in that range, were found taken."""
    ceiling = ephemeral_port_floor() - 200 - num_workers
    for _ in range(PORT_TRIES):
        router = random.randrange(min(10000, ceiling // 2), ceiling)
        ports = [
            router,
            *(router + offset + i for offset in (100, 200) for i in range(num_workers)),
        ]
        try:
            with contextlib.ExitStack() as held:
                for port in ports:
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            return router
        except OSError:
            continue
    raise BenchError(
        f"found no router port below {ceiling} with {num_workers} free worker and KV ports "
        f"after it in {PORT_TRIES} tries; pass --port"
    )


def group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the group led by `process` is still there (reaping the leader)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the process group of `process`: SIGINT, then SIGTERM, then SIGKILL."""
    for stop_signal in STOP_SIGNALS:
        if not group_alive(process):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, stop_signal)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(process):
            time.sleep(0.1)
    process.wait()


def workers_in_pool(metrics_text: str) -> int | None:
    """How many workers the router has in its pool (its `tandem_router_worker_healthy` gauges);
    None for a router that shows no such gauge (another project's)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "tandem_router_worker_healthy":
            return int(sum(sample.value for sample in family.samples))
    return None


def cluster_ready(base_url: str, num_workers: int) -> bool:
    """The router answers /health with 200 and has all `num_workers` workers in its pool (its
    /health alone passes with one worker that can decode: a sweep begun then would measure part
    of the cluster)."""
    with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{base_url}/health", timeout=5.0).status_code != 200:
            return False
        metrics = httpx.get(f"{base_url}/metrics", timeout=5.0)
        in_pool = workers_in_pool(metrics.text) if metrics.status_code == 200 else None
        return in_pool is None or in_pool >= num_workers
    return False


def wait_healthy(
    process: subprocess.Popen[bytes],
    base_url: str,
    num_workers: int,
    timeout_s: float,
    log_path: Path,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(
                f"the cluster exited with code {process.returncode} before it was healthy; "
                f"see {log_path}"
            )
        if cluster_ready(base_url, num_workers):
            return
        time.sleep(HEALTH_POLL_S)
    raise BenchError(
        f"the cluster at {base_url} did not have its {num_workers} workers healthy within "
        f"{timeout_s:.0f} s; see {log_path} (raise --startup-timeout if the model is slow to load)"
    )


@contextlib.contextmanager
def running_cluster(
    command: list[str], base_url: str, num_workers: int, log_path: Path, startup_timeout_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `command` in a new process group, yield its process once it is healthy with all
    `num_workers` workers, always stop the group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_healthy(process, base_url, num_workers, startup_timeout_s, log_path)
            yield process
        finally:
            stop_group(process)


ROUTER_DECISIONS = {  # compare.json's key -> the router's counter and the labels that key it
    "pd_decisions": ("tandem_router_pd_decisions", ("decision", "reason")),
    "role_changes": ("tandem_router_role_changes", ("duty",)),
}


def router_decisions(metrics_text: str) -> dict[str, dict[str, float]]:
    """The router's decision counters in a /metrics text: {"pd_decisions": {"disaggregated/
    long-prompt": n, ...}, "role_changes": {"prefill": n, ...}} (only the labels it counted)."""
    families = {family.name: family for family in text_string_to_metric_families(metrics_text)}
    decisions: dict[str, dict[str, float]] = {}
    for key, (name, labels) in ROUTER_DECISIONS.items():
        family = families.get(name)
        samples = family.samples if family is not None else []
        decisions[key] = {
            "/".join(sample.labels[label] for label in labels): sample.value
            for sample in samples
            if sample.name == f"{name}_total"
        }
    return decisions


def scrape_router_decisions(base_url: str) -> dict[str, dict[str, float]] | None:
    """What the router at base_url decided so far (None: its /metrics did not answer)."""
    try:
        response = httpx.get(f"{base_url}/metrics", timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return router_decisions(response.text)


def decisions_between(
    before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    """What the router decided between two scrapes (`router_decisions`): each count that rose,
    by how much; None where a scrape did not answer."""
    if before is None or after is None:
        return None
    return {
        key: {
            label: count - before.get(key, {}).get(label, 0.0)
            for label, count in counts.items()
            if count > before.get(key, {}).get(label, 0.0)
        }
        for key, counts in after.items()
    }


class DecisionsPerPoint:
    """A sweep's `after_point`: what the router decided during each load point (the first with
    the warm-up), from a scrape before the sweep and one after each point."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latest = scrape_router_decisions(base_url)

    async def __call__(self, point: dict[str, Any]) -> None:
        before, self.latest = (
            self.latest,
            await asyncio.to_thread(scrape_router_decisions, self.base_url),
        )
        point["router_decisions"] = decisions_between(before, self.latest)


def serve_command_of(args: argparse.Namespace) -> list[str]:
    if args.serve_command:
        return shlex.split(args.serve_command)
    return [sys.executable, "-m", "tandem.cli", "serve"]


def main(args: argparse.Namespace) -> int:
    """`tandem bench compare`."""
    console = make_console()
    result_dir = Path(args.result_dir)
    tokenizer = load_tokenizer(args.tokenizer)
    result_sets, commands, decisions, exit_codes = [], {}, {}, {}
    for cluster in clusters_for(args, result_dir):
        port = args.port or cluster_port(cluster.num_workers)
        base_url = f"http://127.0.0.1:{port}"
        command = [
            *serve_command_of(args),
            "--model",
            args.model,
            *cluster.shape_flags,
            "--port",
            str(port),
            *shlex.split(args.serve_args),
        ]
        options = options_from_args(
            args,
            base_url=base_url,
            model=args.served_model_name or args.model,
            label=cluster.label,
            result_dir=result_dir,
            result_filename=cluster.label,
        )
        for path, text in cluster.files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        console.print(f"[bold]{cluster.label}[/bold]: {shlex.join(command)}")
        log_path = result_dir / f"{cluster.label}-serve.log"
        with running_cluster(
            command, base_url, cluster.num_workers, log_path, args.startup_timeout
        ) as process:
            per_point = DecisionsPerPoint(base_url)
            outcome = asyncio.run(run_sweep(options, tokenizer, console, per_point))
            decisions[cluster.label] = per_point.latest
            if process.poll() is not None:
                exit_codes[cluster.label] = process.returncode
                console.print(
                    f"[red]{cluster.label}: the cluster exited with code {process.returncode} "
                    f"during its sweep; its requests failed from then on; see {log_path}[/red]"
                )
        console.print(f"{cluster.label}: the router decided {decisions[cluster.label]}")
        result_sets.append(ResultSet(cluster.label, outcome.results))
        commands[cluster.label] = command
    rows = comparison_rows(result_sets)
    print_comparison_summary(console, rows)
    if not args.goodput:
        console.print("no goodput without SLOs: pass --goodput ttft:MS tpot:MS")
    summary_path = result_dir / "compare.json"
    summary = comparison_summary(result_sets, commands, rows, decisions, exit_codes)
    write_json(summary_path, summary)
    output = Path(args.output) if args.output else result_dir / "compare.png"
    plot_result_sets(result_sets, output, args.title, args.x_metric, goodput_panel=True)
    console.print(f"wrote {summary_path}")
    console.print(f"wrote {output}")
    return 1 if exit_codes else 0  # a cluster that died mid-sweep makes its numbers no measure

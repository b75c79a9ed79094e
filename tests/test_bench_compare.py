"""`tandem bench compare`'s parts without a cluster: the configurations it plans, the goodput
per configuration and rate, the summary table, the picture's lines and the router's decisions
read from its metrics."""

from __future__ import annotations

import argparse
import asyncio
import io
import socket
from pathlib import Path

import pytest
from rich.console import Console

from tandem.bench import compare
from tandem.bench.client import RequestRecord
from tandem.bench.compare import clusters_for, router_decisions
from tandem.bench.errors import BenchError
from tandem.bench.metrics import compute_metrics
from tandem.bench.plot import result_figure
from tandem.bench.report import print_comparison_summary
from tandem.bench.results import ResultSet, comparison_rows
from tandem.cli import build_parser
from tandem.router.metrics import RouterMetrics


def compare_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "compare", *flags])


def test_default_plan_is_three_configurations_on_the_same_workers(tmp_path: Path) -> None:
    clusters = clusters_for(compare_args("--num-prefill", "1", "--num-decode", "2"), tmp_path)
    adaptive_file = tmp_path / "adaptive-cluster.yaml"
    assert [(cluster.label, cluster.shape_flags) for cluster in clusters] == [
        ("colocated", ("--both", "3", "--prefill", "0", "--decode", "0")),
        ("pd", ("--prefill", "1", "--decode", "2")),
        (
            "adaptive",
            ("--config", str(adaptive_file), "--auto", "3", "--prefill", "0", "--decode", "0")
            + ("--disaggregation", "conditional", "--decode-policy", "prefix-aware"),
        ),
    ]
    assert [path for cluster in clusters for path, _ in cluster.files] == [adaptive_file]
    assert [cluster.num_workers for cluster in clusters] == [3, 3, 3]


def test_workers_in_pool_is_read_from_the_routers_gauges() -> None:
    """The count a sweep waits for: the router's workers in its pool, none while it shows no
    gauge of them (another project's router: its /health alone is waited for)."""
    metrics = RouterMetrics()
    assert compare.workers_in_pool(metrics.render().decode()) == 0
    metrics.healthy.labels("http://a", "auto").set(1)
    metrics.healthy.labels("http://b", "auto").set(0)  # out of the pool
    metrics.healthy.labels("http://c", "auto").set(1)
    assert compare.workers_in_pool(metrics.render().decode()) == 2
    assert compare.workers_in_pool("# HELP x y\n# TYPE x counter\nx_total 1.0\n") is None


def test_cluster_port_leaves_out_taken_and_ephemeral_ports(monkeypatch) -> None:
    """The router port and the workers' (+100) and KV listeners' (+200) are free and below the
    ephemeral range; a candidate whose worker port is taken is passed over."""
    floor = compare.ephemeral_port_floor()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy_worker_port = taken.getsockname()[1]
        # the first candidate's second worker port is the taken one; the others are free
        # (unless another process holds one of theirs: then the next is taken)
        fallbacks = [busy_worker_port - 101 + 7 * k for k in range(1, 9)]
        candidates = iter([busy_worker_port - 101, *fallbacks])
        seen_ranges = []

        def randrange(low: int, high: int) -> int:
            seen_ranges.append((low, high))
            return next(candidates)

        monkeypatch.setattr(compare.random, "randrange", randrange)
        monkeypatch.setattr(compare, "ephemeral_port_floor", lambda: 65000)
        port = compare.cluster_port(num_workers=2)  # worker ports P+100, P+101
    assert port in fallbacks
    assert seen_ranges[0] == (10000, 65000 - 202) and len(set(seen_ranges)) == 1
    assert 1024 < floor <= 65535


def test_cluster_port_gives_up_with_a_clear_error(monkeypatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        monkeypatch.setattr(compare.random, "randrange", lambda low, high: busy)
        monkeypatch.setattr(compare, "PORT_TRIES", 3)
        with pytest.raises(BenchError, match="found no router port .* in 3 tries; pass --port"):
            compare.cluster_port(num_workers=1)


def test_configurations_flag_picks_and_orders_them(tmp_path: Path) -> None:
    args = compare_args("--configurations", "adaptive", "pd", "adaptive", "--num-auto", "4")
    clusters = clusters_for(args, tmp_path)
    assert [cluster.label for cluster in clusters] == ["adaptive", "pd"]
    assert clusters[0].shape_flags[3] == "4"
    with pytest.raises(SystemExit):
        compare_args("--configurations", "disaggregated")


def test_adaptive_launch_is_what_tandem_serve_plans(tmp_path: Path) -> None:
    """The adaptive flags and file, read by the real `tandem serve`, give two auto workers on
    cuda-ipc and a router with conditional disaggregation and prefix-aware decode routing."""
    from tandem.launcher.cli import cluster_data
    from tandem.launcher.cluster import parse_cluster
    from tandem.launcher.plan import plan_processes

    (adaptive,) = clusters_for(compare_args("--configurations", "adaptive"), tmp_path)
    for path, text in adaptive.files:
        path.write_text(text)
    serve_args = build_parser().parse_args(
        ["serve", "--model", "smollm2-135m-instruct", *adaptive.shape_flags, "--port", "9000"]
    )
    spec = parse_cluster(cluster_data(serve_args), serve_args.config)
    plans = plan_processes(spec, "cuda", 2)
    workers = [plan for plan in plans if plan.role != "router"]
    assert [plan.role for plan in workers] == ["auto", "auto"]
    for plan in workers:
        assert plan.argv[plan.argv.index("--kv-transport") + 1] == "cuda-ipc"
    router = next(plan.argv for plan in plans if plan.role == "router")
    assert router[router.index("--decode-policy") + 1] == "prefix-aware"
    assert router[router.index("--disaggregation") + 1] == "conditional"
    assert router.count("--auto") == 2 and "--prefill" not in router and "--decode" not in router


def records(ttfts_ms: list[float | None], tpot_ms: float) -> list[RequestRecord]:
    """One request per TTFT (None: failed), each of 3 tokens TPOT `tpot_ms` apart, from t=10 s."""
    made = []
    for index, ttft_ms in enumerate(ttfts_ms):
        if ttft_ms is None:
            made.append(RequestRecord(index, 10.0, 10.5, [], False, "HTTP 500"))
            continue
        first = 10.0 + ttft_ms / 1000
        times = [first + step * tpot_ms / 1000 for step in range(3)]
        made.append(
            RequestRecord(index, 10.0, times[-1], times, True, prompt_tokens=8, output_tokens=3)
        )
    return made


def test_goodput_per_configuration_and_rate_matches_hand_counts() -> None:
    slos = {"ttft": 500.0, "tpot": 25.0}
    measured = {  # (configuration, rate): records, duration (s)
        # 2 of 4 within TTFT 500 (600 misses, one failed) at TPOT 20: 2 / 2 s, 2 of 4 sent.
        ("colocated", 1.0): (records([100, 450, 600, None], 20), 2.0),
        # TPOT 30 misses its SLO whatever the TTFT: none.
        ("pd", 1.0): (records([100, 200, 300, 400], 30), 2.0),
        # all 4 within both: 4 / 2.5 s.
        ("adaptive", 1.0): (records([100, 200, 300, 499], 24), 2.5),
    }
    sets = [
        ResultSet(
            configuration,
            [{"request_rate": rate, **compute_metrics(recs, duration, (99,), slos)}],
        )
        for (configuration, rate), (recs, duration) in measured.items()
    ]
    rows = {row["configuration"]: row for row in comparison_rows(sets)}
    expected = {  # goodput req/s, within SLO, req/s, TTFT p99 ms, TPOT p99 ms
        "colocated": (1.0, 0.5, 1.5, 450 + 0.98 * 150, 20.0),
        "pd": (0.0, 0.0, 2.0, 300 + 0.97 * 100, 30.0),
        "adaptive": (1.6, 1.0, 1.6, 300 + 0.97 * 199, 24.0),
    }
    for configuration, (goodput, attainment, throughput, ttft_p99, tpot_p99) in expected.items():
        row = rows[configuration]
        assert row["request_rate"] == 1.0
        assert row["request_goodput"] == pytest.approx(goodput)
        assert row["slo_attainment"] == pytest.approx(attainment)
        assert row["request_throughput"] == pytest.approx(throughput)
        assert row["p99_ttft_ms"] == pytest.approx(ttft_p99)
        assert row["p99_tpot_ms"] == pytest.approx(tpot_p99)
    output = io.StringIO()
    print_comparison_summary(Console(file=output, width=200), list(rows.values()))
    lines = output.getvalue().splitlines()
    colocated = next(line for line in lines if "colocated" in line)
    assert [cell.strip() for cell in colocated.split("│")[1:-1]] == [
        "colocated", "1.00", "-", "1", "1.50", "1.00", "50.00", "597.00", "20.00", ""
    ]  # fmt: skip


def sweep_point(rate: float | str, goodput: float | None) -> dict:
    return {
        "request_rate": rate,
        "max_concurrency": None,
        "request_goodput": goodput,
        "goodput_slos_ms": {"ttft": 1000.0, "tpot": 25.0},
        "output_throughput": 100.0,
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "median_tpot_ms": 1.0,
        "p99_tpot_ms": 2.0,
    }


def test_goodput_panel_has_one_line_per_configuration() -> None:
    goodputs = {"colocated": (0.9, 1.5, 0.4), "pd": (0.8, 1.2, 1.0), "adaptive": (1.0, 1.9, None)}
    rates = (1.0, 2.0, 4.0)
    sets = [
        ResultSet(label, [sweep_point(r, g) for r, g in zip(rates, values, strict=True)])
        for label, values in goodputs.items()
    ]
    figure = result_figure(sets, goodput_panel=True)
    goodput_axis, ttft_axis, tpot_axis = figure.axes
    lines = {line.get_label(): line for line in goodput_axis.lines}
    assert list(lines) == ["colocated", "pd", "adaptive"]
    assert list(lines["colocated"].get_xdata()) == [1.0, 2.0, 4.0]
    assert list(lines["colocated"].get_ydata()) == [0.9, 1.5, 0.4]
    assert list(lines["adaptive"].get_xdata()) == [1.0, 2.0]  # no goodput at 4 req/s: left out
    assert goodput_axis.get_xlabel() == "request rate (req/s)"
    assert goodput_axis.get_title() == "SLO: TTFT ≤ 1000 ms, TPOT ≤ 25 ms"
    assert len(ttft_axis.lines) == len(tpot_axis.lines) == 6  # p50 and p99 of each
    width, height = figure.get_size_inches() * figure.dpi
    assert (width, height) == (1800, 500)


def test_an_unlimited_rate_is_the_last_tick_of_the_goodput_panel() -> None:
    sets = [ResultSet("pd", [sweep_point(rate, 1.0) for rate in (2.0, "inf", 0.5)])]
    (goodput_axis, *_) = result_figure(sets, goodput_panel=True).axes
    assert list(goodput_axis.lines[0].get_xdata()) == [0.0, 1.0, 2.0]
    assert [tick.get_text() for tick in goodput_axis.get_xticklabels()] == ["0.5", "2.0", "inf"]


def test_the_router_s_decisions_are_read_from_its_metrics():
    """What a router counted (its own metrics object, rendered as /metrics serves it) comes back
    keyed by label; a counter it never counted is an empty dict."""
    metrics = RouterMetrics()
    assert router_decisions(metrics.render().decode()) == {"pd_decisions": {}, "role_changes": {}}
    metrics.pd_decisions.labels("disaggregated", "long_prompt").inc(5)
    metrics.pd_decisions.labels("whole", "short_prompt").inc(2)
    metrics.role_changes.labels("prefill").inc()
    metrics.requests.labels("completions", "ok").inc(7)  # not a decision
    assert router_decisions(metrics.render().decode()) == {
        "pd_decisions": {"disaggregated/long_prompt": 5.0, "whole/short_prompt": 2.0},
        "role_changes": {"prefill": 1.0},
    }


def test_each_point_gets_what_the_router_decided_during_it(monkeypatch) -> None:
    """A scrape before the sweep and one after each point: a point's decisions are the counts
    that rose since the last scrape; the summary shows its role changes."""
    metrics = RouterMetrics()
    monkeypatch.setattr(
        compare, "scrape_router_decisions", lambda url: router_decisions(metrics.render().decode())
    )
    per_point = compare.DecisionsPerPoint("http://router")
    metrics.pd_decisions.labels("whole", "no_prefill_worker").inc(4)  # the warm-up, point 1
    points = [sweep_point(3.0, 2.9), sweep_point(4.5, 3.8)]
    asyncio.run(per_point(points[0]))
    metrics.pd_decisions.labels("whole", "no_prefill_worker").inc(2)
    metrics.pd_decisions.labels("disaggregated", "long_prompt").inc(7)
    metrics.role_changes.labels("prefill").inc()
    asyncio.run(per_point(points[1]))
    assert points[0]["router_decisions"] == {
        "pd_decisions": {"whole/no_prefill_worker": 4.0},
        "role_changes": {},
    }
    assert points[1]["router_decisions"] == {
        "pd_decisions": {"whole/no_prefill_worker": 2.0, "disaggregated/long_prompt": 7.0},
        "role_changes": {"prefill": 1.0},
    }
    assert per_point.latest == router_decisions(metrics.render().decode())  # the sweep's total
    assert compare.decisions_between(None, per_point.latest) is None  # a scrape unanswered
    output = io.StringIO()
    rows = comparison_rows([ResultSet("adaptive", points)])
    print_comparison_summary(Console(file=output, width=200), rows)
    cells = [
        line.split("│")[-2].strip() for line in output.getvalue().splitlines() if "adaptive" in line
    ]
    assert cells == ["", "prefill 1"]

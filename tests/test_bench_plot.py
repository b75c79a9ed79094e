"""`tandem bench plot`: result files in, a PNG of the fixed size out."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from tandem.bench.results import load_result_sets
from tandem.cli import main


def point(label: str, concurrency: int, throughput: float, ttft: float | None) -> dict:
    return {
        "label": label,
        "request_rate": "inf",
        "max_concurrency": concurrency,
        "completed": 0 if ttft is None else 8,
        "output_throughput": throughput,
        "request_throughput": throughput / 100,
        "total_token_throughput": throughput * 3,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": None if ttft is None else 2 * ttft,
        "median_tpot_ms": None if ttft is None else ttft / 10,
        "p99_tpot_ms": None if ttft is None else ttft / 5,
    }


@pytest.fixture
def result_paths(tmp_path: Path) -> tuple[Path, Path]:
    sweep = tmp_path / "pd-sweep.json"
    pd_points = [point("pd", 1, 100.0, 20.0), point("pd", 8, 600.0, 35.0)]
    sweep.write_text(json.dumps({"label": "pd", "points": pd_points}))
    folder = tmp_path / "colocated"
    folder.mkdir()
    for concurrency, throughput, ttft in ((32, 900.0, 120.0), (1, 110.0, 25.0), (8, 500.0, None)):
        path = folder / f"colocated-c{concurrency}.json"
        path.write_text(json.dumps(point("colocated", concurrency, throughput, ttft)))
    (folder / "colocated-sweep.json").write_text(json.dumps({"label": "x", "points": []}))
    return sweep, folder


def test_load_result_sets_groups_and_orders_points(result_paths: tuple[Path, Path]) -> None:
    sweep, folder = result_paths
    sets = load_result_sets([sweep, folder])
    assert [result_set.label for result_set in sets] == ["pd", "colocated"]
    assert [p["max_concurrency"] for p in sets[0].points] == [1, 8]
    assert [p["max_concurrency"] for p in sets[1].points] == [1, 8, 32]  # the sweep file skipped


def test_plot_writes_a_png_of_the_fixed_size(result_paths: tuple[Path, Path]) -> None:
    sweep, folder = result_paths
    output = sweep.parent / "pictures" / "pd-vs-colocated.png"
    assert main(["bench", "plot", str(sweep), str(folder), "-o", str(output)]) == 0
    image = matplotlib.image.imread(output)
    assert image.shape == (500, 1200, 4)
    assert image.std() > 0  # something was drawn
    request_axis = sweep.parent / "requests.png"
    flags = ["--x-metric", "request_throughput", "--title", "PD vs colocated"]
    assert main(["bench", "plot", str(sweep), "-o", str(request_axis), *flags]) == 0
    assert matplotlib.image.imread(request_axis).shape == (500, 1200, 4)
    with_goodput = sweep.parent / "goodput.png"
    assert main(["bench", "plot", str(sweep), "-o", str(with_goodput), "--goodput-panel"]) == 0
    assert matplotlib.image.imread(with_goodput).shape == (500, 1800, 4)  # one panel more


def test_plot_rejects_files_that_are_not_results(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    assert main(["bench", "plot", str(other), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a tandem bench result file" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_title_names_model_workload_and_date(tmp_path: Path) -> None:
    """The title named only the labels; a second line now says what ran (the PNG's Title
    metadata holds the same text as the picture)."""
    from PIL import Image

    run = {
        "model_id": "smollm2-135m-instruct",
        "dataset_name": "random",
        "random_input_len": 512,
        "random_output_len": 64,
        "random_range_ratio": 0.0,
        "num_prompts": 100,
        "endpoint": "/v1/completions",
    }
    colocated = tmp_path / "colocated.json"
    points = [point("colocated", 1, 100.0, 20.0), point("colocated", 4, 300.0, 30.0)]
    points = [{**p, **run, "date": "20261125-101500"} for p in points]
    colocated.write_text(json.dumps({"label": "colocated", "points": points}))
    pd = tmp_path / "pd.json"
    pd_point = {**point("pd", 1, 120.0, 15.0), **run, "date": "20261126-000500"}
    pd.write_text(json.dumps(pd_point))
    output = tmp_path / "title.png"
    assert main(["bench", "plot", str(colocated), str(pd), "-o", str(output)]) == 0
    assert Image.open(output).text["Title"] == (
        "colocated vs pd\n"
        "smollm2-135m-instruct · random 512 in / 64 out tokens, 100 prompts · "
        "2026-11-25 / 2026-11-26"
    )
    chat = {**pd_point, "dataset_name": "sharegpt", "endpoint": "/v1/chat/completions"}
    pd.write_text(json.dumps(chat))
    assert main(["bench", "plot", str(pd), "-o", str(output), "--title", "Chat"]) == 0
    assert Image.open(output).text["Title"] == (
        "Chat\nsmollm2-135m-instruct · sharegpt, chat, 100 prompts · 2026-11-26"
    )

"""lm-evaluation-harness against tandem, as its users run it: the `local-completions` model on
the OpenAI completions endpoint, over the default model (SmolLM2-135M-Instruct), with tasks
defined here from data the test writes (no hub).

* `tandem_capitals`, multiple choice: lm-eval scores each choice's log-likelihood from the
  prompt's logprobs (echo with logprobs), the `loglikelihood` requests of most benchmarks.
* `tandem_capitals_gen`, generate until a newline: greedy answers, as generative benchmarks ask
  for them; one prompt per request, so that the PD cluster serves them disaggregated.

Both tasks run through a PD cluster (`tandem serve`: router, one prefill and one decode worker)
and through a colocated worker, and must give the same scores and the same per-item results;
and both agree with an independent reference: transformers' forward of the same weights,
scoring each (context, continuation) pair lm-eval sent and generating each answer greedily.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import DEFAULT_MODEL
from worker_fixtures import WorkerProcess, free_port, free_port_block, start_worker

# minutes on two cores: `make test-all` runs it (see the Makefile)
pytestmark = pytest.mark.slow

lm_eval = pytest.importorskip("lm_eval")

CAPITALS = [  # country, the right answer, three wrong ones
    ("France", "Paris", "Lyon", "Marseille", "Nice"),
    ("Germany", "Berlin", "Munich", "Hamburg", "Cologne"),
    ("Italy", "Rome", "Milan", "Naples", "Turin"),
    ("Spain", "Madrid", "Barcelona", "Seville", "Valencia"),
    ("Japan", "Tokyo", "Osaka", "Kyoto", "Nagoya"),
    ("Russia", "Moscow", "Kazan", "Omsk", "Samara"),
    ("Egypt", "Cairo", "Giza", "Luxor", "Aswan"),
    ("Canada", "Ottawa", "Toronto", "Vancouver", "Montreal"),
    ("Australia", "Canberra", "Sydney", "Melbourne", "Perth"),
    ("Brazil", "Brasilia", "Rio", "Salvador", "Recife"),
]
NUM_GENERATED = 4  # items of the generative task
MAX_GEN_TOKS = 8
TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_target: {target}
{rest}
"""
MULTIPLE_CHOICE = """\
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATIVE = f"""\
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
STARTUP_TIMEOUT_S = 300.0


def write_tasks(directory: Path) -> Path:
    """The two tasks' YAML files and their JSON-lines data, in `directory`."""
    rows = []
    for index, (country, right, *wrong) in enumerate(CAPITALS):
        choices = [right, *wrong]
        choices = choices[index % 4 :] + choices[: index % 4]  # the answer in every position
        rows.append(
            {"country": country, "choices": [f" {c}" for c in choices], "answer": (-index) % 4}
        )
    data = directory / "capitals.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    generative = directory / "capitals_gen.jsonl"
    generative.write_text(
        "".join(
            json.dumps({"country": country, "capital": f" {right}"}) + "\n"
            for country, right, *_ in CAPITALS[:NUM_GENERATED]
        )
    )
    tasks = {
        "tandem_capitals": (data, "multiple_choice", '"{{answer}}"', MULTIPLE_CHOICE),
        "tandem_capitals_gen": (generative, "generate_until", '"{{capital}}"', GENERATIVE),
    }
    for name, (path, output_type, target, rest) in tasks.items():
        task = TASK.format(name=name, data=path, output_type=output_type, target=target, rest=rest)
        (directory / f"{name}.yaml").write_text(task)
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer as a Hugging Face directory, for lm-eval to tokenize with."""
    from tandem.models.source import load_tokenizer, resolve_model

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(resolve_model(DEFAULT_MODEL)).save_pretrained(directory)
    return directory


def start_serve(log_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    """`tandem serve` over the default model on CPU: a router, one prefill and one decode
    worker, on free ports; returns at once."""
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "serve", DEFAULT_MODEL, "--device", "cpu"]
    argv += ["--port", str(port), "--worker-port-base", str(free_port_block(2))]
    argv += ["--kv-port-base", str(free_port_block(2)), "--num-kv-blocks", "256"]
    argv += ["--disable-log-requests"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    source_dir = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_dir, env.get("PYTHONPATH")]))
    log_path = log_dir / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    return process, f"http://127.0.0.1:{port}", log_path


def wait_for_serve(process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "ready at" not in log_path.read_text(errors="replace"):
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-4000:]
        time.sleep(0.25)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The PD cluster's router and a colocated worker, started together."""
    log_dir = tmp_path_factory.mktemp("lm-eval-servers")
    serve, router_url, serve_log = start_serve(log_dir)
    worker: WorkerProcess | None = None
    try:
        worker = start_worker(log_dir, "--num-kv-blocks", "256", "--disable-log-requests")
        wait_for_serve(serve, serve_log)
        worker.wait_healthy(STARTUP_TIMEOUT_S)
        yield {"pd": router_url, "colocated": worker.url}
    finally:
        serve.terminate()  # the launcher stops its router and workers
        serve.wait(timeout=60)
        if worker is not None:
            worker.stop()


@pytest.fixture(scope="module")
def reference_model():
    """transformers' Llama over the default model's weights (read from its GGUF file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.models import gguf_loader

    path = gguf_loader.resolve_default_model()
    model = LlamaForCausalLM(LlamaConfig(**gguf_loader.read_gguf_config(path)))
    missing, unexpected = model.load_state_dict(
        dict(gguf_loader.iter_gguf_weights(path)), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    return model.float().eval()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread: on a small shared machine, more threads only contend."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def evaluate(base_url: str, task_dir: Path, tokenizer_dir: Path, task: str, batch_size: int):
    """lm-eval's results and per-item samples of one task, served at base_url."""
    from lm_eval.tasks import TaskManager

    model_args = {
        "base_url": f"{base_url}/v1/completions",
        "model": DEFAULT_MODEL,
        "tokenizer": str(tokenizer_dir),
        "tokenizer_backend": "huggingface",
        "max_retries": 1,
    }
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=batch_size,
        log_samples=True,
    )


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


def per_item(outcome: dict, task: str) -> list[tuple]:
    """(doc id, what lm-eval read from the answers) of each item, in order."""
    samples = sorted(outcome["samples"][task], key=lambda sample: sample["doc_id"])
    return [(sample["doc_id"], sample["filtered_resps"]) for sample in samples]


def test_multiple_choice_scores_agree_through_pd_colocated_and_the_reference(
    servers, task_dir, tokenizer_dir, reference_model
):
    import torch

    outcomes = {
        name: evaluate(url, task_dir, tokenizer_dir, "tandem_capitals", batch_size=8)
        for name, url in servers.items()
    }
    scores = {name: o["results"]["tandem_capitals"]["acc,none"] for name, o in outcomes.items()}
    assert scores["pd"] == scores["colocated"]
    items = {name: per_item(outcome, "tandem_capitals") for name, outcome in outcomes.items()}
    assert len(items["pd"]) == len(CAPITALS)
    for (doc_id, pd), (_, colocated) in zip(items["pd"], items["colocated"], strict=True):
        for (pd_loglik, _), (colocated_loglik, _) in zip(pd, colocated, strict=True):
            assert pd_loglik == pytest.approx(colocated_loglik, abs=1e-4), doc_id

    # the reference: each pair's log-likelihood under transformers, tokenized as lm-eval does
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    right = 0
    for sample in sorted(outcomes["pd"]["samples"]["tandem_capitals"], key=lambda s: s["doc_id"]):
        logliks = []
        for (context, continuation), (served, _) in zip(
            sample["arguments"], sample["filtered_resps"], strict=True
        ):
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            with torch.no_grad(), one_thread():
                logprobs = reference_model(torch.tensor([whole])).logits[0].log_softmax(-1)
            expected = sum(
                logprobs[position - 1, whole[position]].item()
                for position in range(len(context_ids), len(whole))
            )
            assert served == pytest.approx(expected, abs=2e-3), (sample["doc_id"], continuation)
            logliks.append(expected)
        right += logliks.index(max(logliks)) == int(sample["target"])
    assert scores["pd"] == pytest.approx(right / len(CAPITALS))
    assert scores["pd"] >= 0.5  # the model knows most capitals: the scoring is not noise


def test_generated_answers_agree_through_pd_colocated_and_the_reference(
    servers, task_dir, tokenizer_dir, reference_model
):
    import torch
    from transformers import AutoTokenizer

    outcomes = {
        name: evaluate(url, task_dir, tokenizer_dir, "tandem_capitals_gen", batch_size=1)
        for name, url in servers.items()
    }
    items = {name: per_item(o, "tandem_capitals_gen") for name, o in outcomes.items()}
    assert items["pd"] == items["colocated"] and len(items["pd"]) == NUM_GENERATED
    results = {name: o["results"]["tandem_capitals_gen"] for name, o in outcomes.items()}
    assert results["pd"]["exact_match,none"] == results["colocated"]["exact_match,none"]

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    samples = sorted(outcomes["pd"]["samples"]["tandem_capitals_gen"], key=lambda s: s["doc_id"])
    for sample in samples:
        context = sample["arguments"][0][0]
        prompt = torch.tensor([tokenizer(context, add_special_tokens=False).input_ids])
        with torch.no_grad(), one_thread():
            generated = reference_model.generate(
                prompt, max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=0
            )
        text = tokenizer.decode(generated[0, prompt.shape[1] :], skip_special_tokens=True)
        assert sample["filtered_resps"][0] == text.split("\n")[0], sample["doc_id"]

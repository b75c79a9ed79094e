"""A worker's start-up log: the model's load and the worker's readiness come with their durations,
and a worker whose GGUF file another process has converted already reads everything from the cache
(nothing converted again, the cached files untouched). Its stop leaves nothing in the log from the
interpreter's teardown (the API process no longer loads Triton, whose bindings reported a hundred
lines of "leaked" objects at every exit). Its API process, the tokenizer loaded from the cache
and requests served, never loads torch (2 to 3 s of a start on two cores), and its engine on the
CPU never loads Triton (0.4 s), whose kernels run only on CUDA."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import torch

from process_tree import children_of
from tandem.attention.base import get_backend
from tandem.models.gguf_cache import GGUFCache
from tandem.models.loader import load_model
from tandem.models.source import load_tokenizer, resolve_model
from tiny_gguf import write_tiny_llama_gguf
from worker_fixtures import running_worker

DURATION = r"(\d+\.\d) s"


def test_worker_logs_durations_and_reads_the_cache(tmp_path, monkeypatch):
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    # The conversions a first start does, here by another process (this one), as a CPU worker.
    source = resolve_model(str(model))
    load_tokenizer(source)
    load_model(source, get_backend("torch"), torch.float32, torch.device("cpu"))
    entry = GGUFCache().entry(model)
    written = {path.name: path.stat().st_mtime_ns for path in entry.iterdir()}
    assert {"config.json", "tokenizer", "model.float32.safetensors"} <= set(written)

    with running_worker(tmp_path, "--num-kv-blocks", "16", model=str(model)) as worker:
        for body in (
            {"prompt": "hello", "max_tokens": 4},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True},
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = httpx.post(worker.url + path, json=body, timeout=60)
            assert response.status_code == 200, response.text
        api_process_maps = Path(f"/proc/{worker.process.pid}/maps").read_text()
        children_maps = [
            Path(f"/proc/{pid}/maps").read_text() for pid in children_of(worker.process.pid)
        ]
        log = worker.log_path.read_text()
    after_stop = worker.log_path.read_text()[len(log) :]
    assert "Application shutdown complete" in after_stop, after_stop
    assert "leaked" not in after_stop and "Traceback" not in after_stop, after_stop

    ready = re.search(rf"INFO tandem\.worker: worker ready on \S+ \(role both\) in {DURATION}", log)
    assert ready, log
    loaded = re.search(rf"model built and its weights loaded in {DURATION}", log)
    assert loaded, log
    assert float(loaded.group(1)) <= float(ready.group(1))
    for what in ("config", "tokenizer", "weights"):
        assert re.search(rf"{what} loaded from the cache in {DURATION}", log), (what, log)
    assert "converting" not in log
    assert {path.name: path.stat().st_mtime_ns for path in entry.iterdir()} == written
    assert "libtorch" not in api_process_maps
    engines = [maps for maps in children_maps if "libtorch" in maps]
    assert len(engines) == 1, len(children_maps)
    assert "libtriton" not in engines[0]

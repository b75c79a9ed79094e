from __future__ import annotations

import os

# pytest-xdist's processes share the machine's cores: each, and what it starts, runs torch with
# its share of them (one each on two cores and two processes), as the workers that the tests
# start do (worker_fixtures). Thread pools contending for the cores made the suite slower.
if num_processes := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))

import pytest  # noqa: E402
import torch  # noqa: E402

if num_processes:  # had a plug-in imported torch already
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The test files that take longest on two cores (1 to 3 minutes each, `--durations=0`), longest
# first. `make test` hands files to its two processes in collection order
# (--no-loadscope-reorder), so these start first and the short ones fill in after, instead of
# one of these starting last while the other process idles.
LONGEST_FILES = (
    "test_server_openai.py",
    "test_pd_default_model.py",
    "test_pd_one_server.py",
    "test_pd_tensor_parallel.py",
    "test_kv_library_planes.py",
    "test_ray_cluster.py",
    "test_pd_failures.py",
    "test_deepseek.py",
    "test_launcher_serve.py",
    "test_serve_cluster.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> directory of a tiny random checkpoint, made once per test session."""
    from tiny_models import SHAPES, make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(name, root / name) for name in SHAPES}

from __future__ import annotations

import pytest
import torch

# The test files that take longest on two cores (1 to 3 minutes each), longest first. `make test`
# hands files to its two processes in collection order (--no-loadscope-reorder), so these start
# first and the short ones fill in after, instead of one of these starting last while the other
# process idles.
LONGEST_FILES = (
    "test_server_openai.py",
    "test_serve_cluster.py",
    "test_pd_tensor_parallel.py",
    "test_kv_library_planes.py",
    "test_pd_one_server.py",
    "test_launcher_serve.py",
    "test_ray_cluster.py",
    "test_pd_default_model.py",
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

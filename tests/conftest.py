from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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

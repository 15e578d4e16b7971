import os

import pytest

import samoyeds


def _gpu_ready() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return samoyeds.cuda_available() and torch.cuda.is_available()


GPU = _gpu_ready()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of samoyeds")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    import numpy as np
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)

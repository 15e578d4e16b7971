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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only the K-th of N equal shares of the collected tests (K from 1; every "
                          "N-th test in collection order), so that the GPU suite fits the device's "
                          "per-call time limit in N calls")


def _shard(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard: expected K/N with 1 <= K <= N, got {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard: expected K/N with 1 <= K <= N, got {spec!r}")
    keep = [it for i, it in enumerate(items) if i % n == k - 1]
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % n != k - 1])
    items[:] = keep


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
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

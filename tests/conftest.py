"""Shared pools of worker ranks: spawned once per session, reused by tests."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

from keras_torch_distribution.testing import ProcessGroupPool  # noqa: E402

_pools = {}


def _pool(world_size):
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = ProcessGroupPool(world_size, timeout=180)
        _pools[world_size] = pool
    return pool


@pytest.fixture
def pool2():
    """Two gloo ranks (a world of 2). A failed test replaces the pool."""
    return _pool(2)


@pytest.fixture
def pool4():
    """Four gloo ranks (a world of 4), for 2x2 meshes."""
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()

"""Shared pools of worker ranks: spawned once per session, reused by tests.

Tests live in unit/ (the pytest process only), multiprocess/ (pools of gloo
ranks) and e2e/ (`ktd run`, torchrun, scripts, examples/). What several test
files use is in helpers.py, which every test imports as `helpers`: this
folder is put on sys.path here, before any test module is imported and
before a pool starts (spawned workers get this process's sys.path, and
import test modules and `helpers` by name to unpickle worker functions).
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "2")

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

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

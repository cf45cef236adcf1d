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

from helpers import POOL_TIMEOUT_S  # noqa: E402
from keras_torch_distribution.testing import ProcessGroupPool  # noqa: E402

_pools = {}


# KTD_TEST_DEVICE=cuda (tools/gpu-check's multiprocess section, on a machine
# with a GPU per rank): the pools' ranks keep CUDA and each uses the GPU of
# its LOCAL_RANK (NCCL); otherwise they are CPU processes (gloo).
_TEST_DEVICE = os.environ.get("KTD_TEST_DEVICE", "cpu")
if _TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(
        f"KTD_TEST_DEVICE={_TEST_DEVICE!r}: expected 'cpu' (the default: gloo "
        "ranks) or 'cuda' (one GPU per rank); unset it or set one of those."
    )
_POOL_ENV = (
    {"KTD_DEVICE": None, "CUDA_VISIBLE_DEVICES": None}
    if _TEST_DEVICE == "cuda"
    else {}
)


def _pool(world_size):
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = ProcessGroupPool(
            world_size, timeout=POOL_TIMEOUT_S, env=_POOL_ENV
        )
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

"""`keras.distribution.initialize()` on gloo ranks (CPU): unseeded models
agree across ranks once it ran (and differ without it), and it starts the
group from a file URL, host:port, one address per process, torchrun's and
Keras' environment variables; it is idempotent, refuses arguments that
disagree with the running group, and a second group rebuilds the meshes.

Worker functions are module-level (the pool pickles them by name), return
plain Python / numpy values, and every assertion runs in the pytest process.
`fresh_pool2` is a pool of two uninitialized workers for the `initialize`
tests (module-scoped: started once for this file); the session pool `pool2`
comes from conftest.
"""

import os

import numpy as np
import pytest

from helpers import POOL_TIMEOUT_S
from helpers import assert_error
from helpers import error_of
from helpers import free_port
from keras_torch_distribution.testing import ProcessGroupPool
from keras_torch_distribution.testing import environment

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# Worker functions
# ---------------------------------------------------------------------------


def _unseeded_model_weights():
    import keras

    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)]
    )
    return [w.copy() for w in model.get_weights()]


def _forget_seeds():
    """Seed Python's, numpy's and torch's RNGs from the OS, as a freshly
    started process has them, and forget any Keras seed."""
    import random

    import keras
    import torch

    random.seed()
    np.random.seed()
    torch.seed()
    keras.backend.clear_session()  # drops the global Keras seed


def _unseeded_weights_without_initialize():
    _forget_seeds()
    return _unseeded_model_weights()


def _destroy():
    import torch.distributed as dist

    from keras_torch_distribution._distributed import layouts

    if dist.is_initialized():
        dist.destroy_process_group()
    layouts.torch_meshes.clear()


def _initialize_explicit(job_addresses, world, rank_by_pid=None):
    """initialize() with explicit arguments, then idempotency checks; the
    group is destroyed at the end so that the next test can start another."""
    import keras
    import numpy as np
    import torch.distributed as dist

    from keras_torch_distribution._backend import distribution_lib

    rank = rank_by_pid[os.getpid()]
    _forget_seeds()
    try:
        before = dist.is_initialized()
        keras.distribution.initialize(
            job_addresses=job_addresses, num_processes=world, process_id=rank
        )
        first = (dist.get_rank(), dist.get_world_size())
        keras.distribution.initialize()  # again, no arguments: harmless
        keras.distribution.initialize(
            job_addresses=job_addresses, num_processes=world, process_id=rank
        )
        again = (dist.get_rank(), dist.get_world_size())
        wrong_world = error_of(
            keras.distribution.initialize,
            job_addresses=job_addresses,
            num_processes=world + 1,
            process_id=rank,
        )
        wrong_rank = error_of(
            keras.distribution.initialize,
            job_addresses=job_addresses,
            num_processes=world,
            process_id=1 - rank,
        )
        weights = _unseeded_model_weights()
        summed = (
            keras.distribution.distribute_tensor(
                np.full((2,), rank + 1.0, "float32"),
                keras.distribution.TensorLayout(
                    ("batch",), keras.distribution.DeviceMesh((2,), ["batch"])
                ),
            )
            .full_tensor()
            .numpy()
        )
        return {
            "before": before,
            "first": first,
            "again": again,
            "devices": keras.distribution.list_devices(),
            "process_id": distribution_lib.process_id(),
            "wrong_world": wrong_world,
            "wrong_rank": wrong_rank,
            "weights": weights,
            "summed": summed,
        }
    finally:
        _destroy()


_TORCHRUN_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_KERAS_KEYS = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


def _initialize_from_keras_env(address, world, rank_by_pid):
    """Keras' own variables (read by keras.distribution.initialize)."""
    rank = rank_by_pid[os.getpid()]
    _forget_seeds()
    values = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": address,
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(world),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
    }
    with environment(values):
        return _initialize_and_describe()


def _initialize_and_describe(wrong_world=None):
    """initialize() from the environment, twice; then what it set up."""
    import keras
    import torch.distributed as dist

    try:
        keras.distribution.initialize()
        keras.distribution.initialize()  # harmless
        result = {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "devices": keras.distribution.list_devices(),
            "weights": _unseeded_model_weights(),
        }
        if wrong_world is not None:
            result["wrong_world"] = error_of(
                keras.distribution.initialize, num_processes=wrong_world
            )
        return result
    finally:
        _destroy()


def _initialize_from_torchrun_env(port, world, rank_by_pid):
    rank = rank_by_pid[os.getpid()]
    _forget_seeds()
    values = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    with environment(values):
        return _initialize_and_describe(wrong_world=world + 1)


def _reinitialize(first_url, second_url, rank_by_pid):
    """Destroy the process group and start another: meshes cached for the
    first group must not be reused (their groups are dead)."""
    import keras
    import numpy as np
    import torch.distributed as dist

    rank = rank_by_pid[os.getpid()]
    value = np.arange(6, dtype="float32").reshape(3, 2)
    gathered = []
    meshes = []
    try:
        for url in (first_url, second_url):
            keras.distribution.initialize(
                job_addresses=url, num_processes=2, process_id=rank
            )
            mesh = keras.distribution.DeviceMesh((2,), ["batch"])
            meshes.append(mesh.backend_mesh)
            layout = keras.distribution.TensorLayout(("batch", None), mesh)
            gathered.append(
                keras.distribution.distribute_tensor(value, layout)
                .full_tensor()
                .numpy()
            )
            dist.destroy_process_group()  # the mesh cache is left as it is
        return meshes[0] is not meshes[1], gathered
    finally:
        _destroy()


def _torchrun_env_mismatch(world, rank_by_pid):
    """WORLD_SIZE from torchrun disagrees with num_processes: refused before
    any rendezvous (so nothing hangs)."""
    import keras
    import torch.distributed as dist

    rank = rank_by_pid[os.getpid()]
    with environment({"RANK": str(rank), "WORLD_SIZE": str(world)}):
        found = error_of(keras.distribution.initialize, num_processes=world + 2)
        devices = error_of(keras.distribution.list_devices)
        return found, devices, dist.is_initialized()


def _pid():
    return os.getpid()


def _leftover_env():
    import torch.distributed as dist

    return (
        dist.is_initialized(),
        {key: os.environ.get(key) for key in _TORCHRUN_KEYS + _KERAS_KEYS},
    )


# ---------------------------------------------------------------------------
# On the session pool
# ---------------------------------------------------------------------------


def test_unseeded_model_agrees_on_session_pool(pool2):
    first, second = pool2.run(_unseeded_model_weights)
    assert len(first) == 4
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# initialize(), on workers that did not initialize
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_pool2():
    pool = ProcessGroupPool(2, timeout=POOL_TIMEOUT_S, initialize=False)
    try:
        yield pool
    finally:
        pool.close()


def _ranks(pool):
    pids = pool.run(_pid)
    return {pid: rank for rank, pid in enumerate(pids)}


def _check_initialized(results, world=2):
    for rank, result in enumerate(results):
        assert result["before"] is False
        assert result["first"] == result["again"] == (rank, world)
        assert result["process_id"] == rank
        assert result["devices"] == [f"cpu:{r}" for r in range(world)]
        assert_error(
            result["wrong_world"],
            "ValueError",
            (
                rf"initialize\(num_processes={world + 1}\) but "
                rf"torch.distributed already runs {world} processes"
            ),
        )
        assert_error(
            result["wrong_rank"],
            "ValueError",
            (
                rf"initialize\(process_id={1 - rank}\) but this process "
                rf"already is rank {rank}"
            ),
        )
        np.testing.assert_array_equal(result["summed"], [1.0, 2.0])
    # Unseeded initializers agree across ranks once initialize() ran.
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_unseeded_weights_differ_without_initialize(fresh_pool2):
    # The control for the seed checks below: fresh processes disagree.
    first, second = fresh_pool2.run(_unseeded_weights_without_initialize)
    assert not np.array_equal(first[0], second[0])


def test_initialize_with_file_url(fresh_pool2, tmp_path):
    ranks = _ranks(fresh_pool2)
    url = f"file://{tmp_path / 'rendezvous'}"
    results = fresh_pool2.run(_initialize_explicit, url, 2, ranks)
    _check_initialized(results)


def test_initialize_with_host_port(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    results = fresh_pool2.run(
        _initialize_explicit, f"127.0.0.1:{free_port()}", 2, ranks
    )
    _check_initialized(results)


def test_initialize_with_one_address_per_process(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    addresses = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    results = fresh_pool2.run(_initialize_explicit, addresses, 2, ranks)
    _check_initialized(results)


def test_initialize_from_torchrun_env(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    environments = fresh_pool2.run(_leftover_env)
    results = fresh_pool2.run(
        _initialize_from_torchrun_env, free_port(), 2, ranks
    )
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["devices"] == ["cpu:0", "cpu:1"]
        assert_error(
            result["wrong_world"],
            "ValueError",
            (
                r"initialize\(num_processes=3\) but torch.distributed already "
                r"runs 2 processes"
            ),
        )
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)
    # Nothing leaks into the workers: no group, torchrun's variables restored.
    for (initialized, env), (_, env_before) in zip(
        fresh_pool2.run(_leftover_env), environments
    ):
        assert not initialized
        assert env == env_before


def test_reinitialize_rebuilds_meshes(fresh_pool2, tmp_path):
    ranks = _ranks(fresh_pool2)
    urls = [f"file://{tmp_path / name}" for name in ("first", "second")]
    value = np.arange(6, dtype="float32").reshape(3, 2)
    for rebuilt, gathered in fresh_pool2.run(_reinitialize, *urls, ranks):
        assert rebuilt
        for array in gathered:
            np.testing.assert_array_equal(array, value)


def test_initialize_from_keras_env(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    environments = fresh_pool2.run(_leftover_env)
    results = fresh_pool2.run(
        _initialize_from_keras_env, f"127.0.0.1:{free_port()}", 2, ranks
    )
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["devices"] == ["cpu:0", "cpu:1"]
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)
    for (initialized, env), (_, env_before) in zip(
        fresh_pool2.run(_leftover_env), environments
    ):
        assert not initialized
        assert env == env_before


def test_torchrun_env_mismatch_is_refused(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    for found, devices, initialized in fresh_pool2.run(
        _torchrun_env_mismatch, 2, ranks
    ):
        assert_error(
            found,
            "ValueError",
            (
                r"initialize\(num_processes=4\) but torchrun started "
                r"WORLD_SIZE=2 processes"
            ),
        )
        assert_error(
            devices,
            "IncompleteEnvironmentError",  # a RuntimeError
            (
                r"WORLD_SIZE=2 says this process is one of 2, but the "
                r"environment lacks MASTER_ADDR, MASTER_PORT to join the "
                r"others.*ktd run -n 2"
            ),
        )
        assert not initialized

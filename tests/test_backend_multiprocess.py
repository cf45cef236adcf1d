"""Multi-process tests of the foundation on gloo ranks (CPU).

Worker functions are module-level (the pool pickles them by name), return
plain Python / numpy values, and every assertion runs in the pytest process.
The session pools `pool2` / `pool4` come from conftest; `fresh_pool2` is a
pool of two uninitialized workers for the `initialize` tests.
"""

import os
import re
import socket

import numpy as np
import pytest

from keras_torch_distribution.testing import ProcessGroupPool
from keras_torch_distribution.testing import environment

pytestmark = pytest.mark.slow

FULL_SHAPES = [(6, 4), (5, 3), (1, 3), (7, 2, 3)]


def _error_of(function, *args, **kwargs):
    """(type name, message) of what `function` raised, or None."""
    try:
        function(*args, **kwargs)
    except (ValueError, RuntimeError, TypeError) as error:
        return type(error).__name__, str(error)
    return None


def _assert_error(found, kind, pattern):
    assert found is not None, f"expected {kind} matching {pattern!r}, nothing raised"
    assert found[0] == kind, found
    assert re.search(pattern, found[1], re.S), found[1]


# ---------------------------------------------------------------------------
# Worker functions
# ---------------------------------------------------------------------------


def _devices_and_ranks():
    import keras
    import torch.distributed as dist

    from keras_torch_distribution import distribution_lib

    dp = keras.distribution.DataParallel()
    return {
        "devices": keras.distribution.list_devices(),
        "cpu_devices": keras.distribution.list_devices("cpu"),
        "count": keras.distribution.get_device_count(),
        "process_id": distribution_lib.process_id(),
        "num_processes": distribution_lib.num_processes(),
        "torch_rank": dist.get_rank(),
        "torch_world": dist.get_world_size(),
        "dp_num_processes": dp.num_processes,
        "dp_replicas": dp.num_model_replicas,
        "dp_shard_id": dp.data_shard_id,
    }


def _all_reduce_on(torch_mesh, axis_name):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=torch_mesh.get_group(axis_name))
    return float(value.item())


def _mesh_caching():
    import keras
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras_torch_distribution import layouts

    devices = keras.distribution.list_devices()
    mesh_a = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    mesh_b = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    same_config = mesh_a.backend_mesh is mesh_b.backend_mesh
    same_twice = mesh_a.backend_mesh is layouts.to_torch_mesh(mesh_a)

    dp = keras.distribution.DataParallel()
    dp_mesh = dp.device_mesh.backend_mesh
    dp_is_batch_mesh = dp_mesh is mesh_a.backend_mesh

    grid = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    mp = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(grid)
    )
    mp_mesh = mp.device_mesh.backend_mesh
    other_names = keras.distribution.DeviceMesh((2,), ["model"], devices)
    distinct = len(
        {id(dp_mesh), id(mp_mesh), id(other_names.backend_mesh)}
    )

    # Switch back and forth; every rank must stay in step.
    sums = []
    for _ in range(2):
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        current = keras.distribution.distribution().device_mesh.backend_mesh
        sums.append(("dp", current is dp_mesh, _all_reduce_on(current, "batch")))
        grid_again = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(grid_again)
        layout_map[".*"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
        current = keras.distribution.distribution().device_mesh.backend_mesh
        sums.append(
            (
                "mp",
                current is mp_mesh,
                _all_reduce_on(current, "model"),
                _all_reduce_on(current, "batch"),
            )
        )
    keras.distribution.set_distribution(None)

    # DTensor collectives on both meshes after the switching.
    full = torch.arange(8.0).reshape(2, 4)
    on_dp = distribute_tensor(full, dp_mesh, [Shard(0)])
    on_mp = distribute_tensor(full, mp_mesh, [Replicate(), Shard(1)])
    gathered = [
        on_dp.full_tensor().numpy(),
        on_mp.full_tensor().numpy(),
        on_dp.redistribute(dp_mesh, [Replicate()]).to_local().numpy(),
    ]
    return {
        "same_config": same_config,
        "same_twice": same_twice,
        "dp_is_batch_mesh": dp_is_batch_mesh,
        "distinct": distinct,
        "sums": sums,
        "gathered": gathered,
        "full": full.numpy(),
        "mp_shape": tuple(mp_mesh.shape),
        "mp_names": tuple(mp_mesh.mesh_dim_names),
    }


def _reordered_devices():
    """Devices out of rank order along an axis are refused (torch's groups
    order members by rank, DTensor by mesh coordinate)."""
    import keras

    devices = keras.distribution.list_devices()
    reversed_mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices[::-1])
    grid = keras.distribution.DeviceMesh((2, 1), ["batch", "model"], devices[::-1])
    return (
        _error_of(lambda: reversed_mesh.backend_mesh),
        _error_of(lambda: grid.backend_mesh),
    )


def _layout_cases(mesh_shape, axis_names, cases, devices=None):
    """For each (tensor shape, layout axes): our placements, local block and
    round trip, against torch's `distribute_tensor` of the same full tensor."""
    import keras
    import numpy as np
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_torch_distribution import distribution_lib
    from keras_torch_distribution import layouts

    mesh = keras.distribution.DeviceMesh(
        mesh_shape, list(axis_names), devices or keras.distribution.list_devices()
    )
    results = []
    for shape, axes in cases:
        full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
        if any(isinstance(a, (tuple, list)) for a in axes):
            # Keras' TensorLayout refuses tuples of axes; go through ours.
            torch_layout = layouts.TorchLayout(
                mesh.backend_mesh, layouts.placements_for(axes, axis_names), axes
            )
            ours = distribution_lib.distribute_tensor(full, torch_layout)
        else:
            layout = keras.distribution.TensorLayout(axes, mesh)
            torch_layout = layout.backend_layout
            ours = keras.distribution.distribute_tensor(full, layout)
        reference = distribute_tensor(full, mesh.backend_mesh, torch_layout.placements)
        box = layouts.local_box(shape, mesh.backend_mesh, torch_layout.placements)
        results.append(
            {
                "shape": shape,
                "axes": axes,
                "placements": [repr(p) for p in torch_layout.placements],
                "box_shape": tuple(hi - lo for lo, hi in box),
                "local_shape": tuple(ours.to_local().shape),
                "reference_shape": tuple(reference.to_local().shape),
                "same_local": bool(torch.equal(ours.to_local(), reference.to_local())),
                "same_placements": tuple(ours.placements) == tuple(reference.placements),
                "global_shape": tuple(ours.shape),
                "round_trip": bool(torch.equal(ours.full_tensor(), full)),
                "same_mesh": ours.device_mesh is mesh.backend_mesh,
            }
        )
    return results


def _round_trips():
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    rows = keras.distribution.TensorLayout(("batch", None), mesh)
    cols = keras.distribution.TensorLayout((None, "batch"), mesh)
    whole = keras.distribution.TensorLayout((None, None), mesh)
    out = {}

    full = np.arange(15, dtype="float32").reshape(5, 3)  # 5 rows over 2: uneven
    by_rows = keras.distribution.distribute_tensor(full, rows)
    out["numpy_rows"] = (
        isinstance(by_rows, DTensor),
        tuple(by_rows.placements) == (Shard(0),),
        by_rows.to_local().numpy(),
        by_rows.full_tensor().numpy(),
    )
    torch_input = torch.from_numpy(full.copy())
    from_torch = keras.distribution.distribute_tensor(torch_input, cols)
    out["torch_cols"] = (from_torch.to_local().numpy(), from_torch.full_tensor().numpy())
    keras_input = keras.ops.convert_to_tensor(full)
    from_keras = keras.distribution.distribute_tensor(keras_input, rows)
    out["keras_rows"] = from_keras.full_tensor().numpy()

    # Relayout of an existing DTensor: same mesh (redistribute) ...
    relaid = keras.distribution.distribute_tensor(by_rows, cols)
    replicated = keras.distribution.distribute_tensor(by_rows, whole)
    same = keras.distribution.distribute_tensor(by_rows, rows)
    out["relayout"] = (
        tuple(relaid.placements) == (Shard(1),),
        relaid.to_local().numpy(),
        relaid.full_tensor().numpy(),
        tuple(replicated.placements) == (Replicate(),),
        replicated.to_local().numpy(),
        same is by_rows,
    )
    # ... and onto another mesh.
    grid = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    on_grid = keras.distribution.distribute_tensor(
        by_rows, keras.distribution.TensorLayout(("model", None), grid)
    )
    out["other_mesh"] = (
        on_grid.device_mesh is grid.backend_mesh,
        [repr(p) for p in on_grid.placements],
        on_grid.to_local().numpy(),
        on_grid.full_tensor().numpy(),
    )

    # A Partial DTensor is reduced.
    partial = DTensor.from_local(
        torch.full((4, 2), float(rank + 1)), mesh.backend_mesh, [Partial()], run_check=False
    )
    reduced = keras.distribution.distribute_tensor(partial, whole)
    partial2 = DTensor.from_local(
        torch.arange(8.0).reshape(4, 2) * (rank + 1),
        mesh.backend_mesh,
        [Partial()],
        run_check=False,
    )
    scattered = keras.distribution.distribute_tensor(partial2, rows)
    out["partial"] = (
        [repr(p) for p in reduced.placements],
        reduced.to_local().numpy(),
        [repr(p) for p in scattered.placements],
        scattered.to_local().numpy(),
        scattered.full_tensor().numpy(),
    )

    # Integer and 1-D values, a dim smaller than the axis, an empty tensor.
    ints = np.arange(3, dtype="int64")
    ints_dt = keras.distribution.distribute_tensor(
        ints, keras.distribution.TensorLayout(("batch",), mesh)
    )
    one_row = np.ones((1, 4), dtype="float32")
    one_dt = keras.distribution.distribute_tensor(one_row, rows)
    empty = np.zeros((0, 4), dtype="float32")
    empty_dt = keras.distribution.distribute_tensor(empty, rows)
    out["small"] = (
        str(ints_dt.dtype),
        ints_dt.to_local().numpy(),
        ints_dt.full_tensor().numpy(),
        tuple(one_dt.to_local().shape),
        one_dt.full_tensor().numpy(),
        tuple(empty_dt.to_local().shape),
        tuple(empty_dt.full_tensor().shape),
    )
    return out


def _error_cases():
    import keras
    import numpy as np

    from keras_torch_distribution import layouts

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    errors = {}
    errors["rank"] = _error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4,), "float32"),
        keras.distribution.TensorLayout(("batch", None), mesh),
    )
    errors["rank_dtensor"] = _error_of(
        keras.distribution.distribute_tensor,
        keras.distribution.distribute_tensor(
            np.zeros((4, 2), "float32"),
            keras.distribution.TensorLayout(("batch", None), mesh),
        ),
        keras.distribution.TensorLayout(("batch", None, None), mesh),
    )
    errors["too_few_devices"] = _error_of(
        lambda: keras.distribution.DeviceMesh((1,), ["batch"], devices[:1]).backend_mesh
    )
    errors["too_many_devices"] = _error_of(
        lambda: keras.distribution.DeviceMesh(
            (2, 2), ["batch", "model"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        ).backend_mesh
    )
    errors["too_few_in_layout"] = _error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4, 2), "float32"),
        keras.distribution.TensorLayout(
            ("batch", None), keras.distribution.DeviceMesh((1,), ["batch"], devices[:1])
        ),
    )
    errors["repeated_device"] = _error_of(
        lambda: keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:0"]).backend_mesh
    )
    errors["foreign_device"] = _error_of(
        lambda: keras.distribution.DeviceMesh((2,), ["batch"], ["tpu:0", "tpu:1"]).backend_mesh
    )
    errors["repeated_axis_name"] = _error_of(
        lambda: keras.distribution.DeviceMesh((1, 2), ["x", "x"], devices).backend_mesh
    )
    errors["unknown_axis_keras"] = _error_of(
        keras.distribution.TensorLayout, ("model", None), mesh
    )
    errors["unknown_axis_ours"] = _error_of(
        layouts.placements_for, ("model", None), list(mesh.axis_names)
    )
    errors["unknown_axis_layout_map"] = _error_of(
        keras.distribution.LayoutMap(mesh).__setitem__, "kernel", (None, "model")
    )
    errors["no_mesh"] = _error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4, 2), "float32"),
        keras.distribution.TensorLayout(("batch", None)),
    )
    errors["gpu_mesh"] = _error_of(
        lambda: keras.distribution.DeviceMesh((2,), ["batch"], ["gpu:0", "gpu:1"]).backend_mesh
    )
    # The pool still works after the errors: every rank stayed in step.
    after = keras.distribution.distribute_tensor(
        np.arange(4, dtype="float32"), keras.distribution.TensorLayout(("batch",), mesh)
    ).full_tensor().numpy()
    return errors, after


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

    from keras_torch_distribution import layouts

    if dist.is_initialized():
        dist.destroy_process_group()
    layouts.torch_meshes.clear()


def _initialize_explicit(job_addresses, world, rank_by_pid=None):
    """initialize() with explicit arguments, then idempotency checks; the
    group is destroyed at the end so that the next test can start another."""
    import keras
    import numpy as np
    import torch.distributed as dist

    from keras_torch_distribution import distribution_lib

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
        wrong_world = _error_of(
            keras.distribution.initialize,
            job_addresses=job_addresses,
            num_processes=world + 1,
            process_id=rank,
        )
        wrong_rank = _error_of(
            keras.distribution.initialize,
            job_addresses=job_addresses,
            num_processes=world,
            process_id=1 - rank,
        )
        weights = _unseeded_model_weights()
        summed = keras.distribution.distribute_tensor(
            np.full((2,), rank + 1.0, "float32"),
            keras.distribution.TensorLayout(
                ("batch",), keras.distribution.DeviceMesh((2,), ["batch"])
            ),
        ).full_tensor().numpy()
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


_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
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
            result["wrong_world"] = _error_of(
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
                keras.distribution.distribute_tensor(value, layout).full_tensor().numpy()
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
        found = _error_of(keras.distribution.initialize, num_processes=world + 2)
        devices = _error_of(keras.distribution.list_devices)
        return found, devices, dist.is_initialized()


def _pid():
    return os.getpid()


def _leftover_env():
    import torch.distributed as dist

    return (
        dist.is_initialized(),
        {key: os.environ.get(key) for key in _TORCHRUN_KEYS + _KERAS_KEYS},
    )


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------
# Tests on the session pools
# ---------------------------------------------------------------------------


def test_devices_and_ranks_on_two_processes(pool2):
    results = pool2.run(_devices_and_ranks)
    for rank, result in enumerate(results):
        assert result["devices"] == ["cpu:0", "cpu:1"]
        assert result["cpu_devices"] == ["cpu:0", "cpu:1"]
        assert result["count"] == 2
        assert result["process_id"] == result["torch_rank"] == rank
        assert result["num_processes"] == result["torch_world"] == 2
        assert result["dp_num_processes"] == 2
        assert result["dp_replicas"] == 2
        assert result["dp_shard_id"] == rank


def test_devices_on_four_processes(pool4):
    results = pool4.run(_devices_and_ranks)
    for rank, result in enumerate(results):
        assert result["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        assert result["count"] == 4
        assert result["process_id"] == rank
        assert result["num_processes"] == 4


def test_mesh_cache_and_switching_meshes(pool2):
    for rank, result in enumerate(pool2.run(_mesh_caching)):
        assert result["same_config"]
        assert result["same_twice"]
        assert result["dp_is_batch_mesh"]
        assert result["distinct"] == 3
        assert result["mp_shape"] == (1, 2)
        assert result["mp_names"] == ("batch", "model")
        # On the (1, 2) mesh the "batch" axis holds one rank: its sum is its own.
        assert result["sums"] == [
            ("dp", True, 3.0),
            ("mp", True, 3.0, float(rank + 1)),
        ] * 2
        for gathered in result["gathered"]:
            np.testing.assert_array_equal(gathered, result["full"])


def test_devices_out_of_rank_order_are_refused(pool2):
    for reversed_1d, reversed_2d in pool2.run(_reordered_devices):
        _assert_error(
            reversed_1d,
            "ValueError",
            r"DeviceMesh devices \['cpu:1', 'cpu:0'\] \(as a grid of ranks \[1, 0\]\) "
            r"do not increase along mesh axis 'batch'.*list_devices\(\)",
        )
        _assert_error(
            reversed_2d, "ValueError", r"ranks \[\[1\], \[0\]\]\) do not increase along mesh axis 'batch'"
        )


def _check_layout_results(results, expected_placements):
    for rank_results in results:
        assert len(rank_results) == len(expected_placements)
        for case, expected in zip(rank_results, expected_placements):
            where = f"shape={case['shape']} axes={case['axes']}"
            assert case["placements"] == expected, where
            assert case["same_placements"], where
            assert case["local_shape"] == case["reference_shape"], where
            assert case["box_shape"] == case["reference_shape"], where
            assert case["same_local"], where
            assert case["global_shape"] == tuple(case["shape"]), where
            assert case["round_trip"], where
            assert case["same_mesh"], where


R, S0, S1, S2 = "Replicate()", "Shard(dim=0)", "Shard(dim=1)", "Shard(dim=2)"


def test_layouts_on_1d_mesh(pool2):
    cases, expected = [], []
    for shape in FULL_SHAPES:
        cases += [
            (shape, ("batch",) + (None,) * (len(shape) - 1)),
            (shape, (None, "batch") + (None,) * (len(shape) - 2)),
            (shape, (None,) * len(shape)),
        ]
        expected += [[S0], [S1], [R]]
    cases.append(((7, 2, 3), (None, None, "batch")))
    expected.append([S2])
    results = pool2.run(_layout_cases, (2,), ("batch",), cases)
    _check_layout_results(results, expected)
    # The uneven case: 5 rows over 2 ranks gives 3 and 2 (torch.chunk).
    by_rank = [r[3]["local_shape"] for r in results]
    assert by_rank == [(3, 3), (2, 3)]
    # 1 row over 2 ranks: one rank holds it, the other an empty block.
    assert [r[6]["local_shape"] for r in results] == [(1, 3), (0, 3)]


@pytest.mark.parametrize("mesh_shape", [(2, 1), (1, 2)])
def test_layouts_on_2d_mesh_of_two(pool2, mesh_shape):
    cases, expected = [], []
    for shape in [(6, 4), (5, 3)]:
        for axes, placements in AXES_2X2[:-1]:  # all but the tuple-of-one axis
            cases.append((shape, axes))
            expected.append(placements)
    results = pool2.run(_layout_cases, mesh_shape, ("batch", "model"), cases)
    _check_layout_results(results, expected)


AXES_2X2 = [
    (("batch", "model"), [S0, S1]),
    (("model", "batch"), [S1, S0]),
    (("batch", None), [S0, R]),
    ((None, "model"), [R, S1]),
    ((None, None), [R, R]),
    ((("batch", "model"), None), [S0, S0]),
    ((None, ("batch", "model")), [S1, S1]),
    ((("model",), "batch"), [S1, S0]),
]


@pytest.mark.parametrize(
    "devices",
    [None, ["cpu:0", "cpu:2", "cpu:1", "cpu:3"]],
    ids=["row_major", "column_major"],
)
def test_layouts_on_2x2_mesh(pool4, devices):
    cases, expected = [], []
    for shape in [(8, 4), (5, 3), (3, 5), (2, 1)]:
        for axes, placements in AXES_2X2:
            cases.append((shape, axes))
            expected.append(placements)
    results = pool4.run(_layout_cases, (2, 2), ("batch", "model"), cases, devices)
    _check_layout_results(results, expected)
    # 5 rows over the 4 ranks, nested batch-major: 2, 1, 1, 1 (torch's rule).
    index = AXES_2X2.index(((("batch", "model"), None), [S0, S0])) + len(AXES_2X2)
    shapes = [r[index]["local_shape"] for r in results]
    if devices is None:
        assert shapes == [(2, 3), (1, 3), (1, 3), (1, 3)]
    else:  # ranks 0, 2 on the first batch row; rank 1 at coordinate (1, 0)
        assert shapes == [(2, 3), (1, 3), (1, 3), (1, 3)][:1] + [(1, 3)] * 3


def test_distribute_tensor_round_trips(pool2):
    results = pool2.run(_round_trips)
    full = np.arange(15, dtype="float32").reshape(5, 3)
    for rank, out in enumerate(results):
        is_dtensor, sharded_rows, local, gathered = out["numpy_rows"]
        assert is_dtensor and sharded_rows
        np.testing.assert_array_equal(local, full[:3] if rank == 0 else full[3:])
        np.testing.assert_array_equal(gathered, full)

        local, gathered = out["torch_cols"]
        np.testing.assert_array_equal(local, full[:, :2] if rank == 0 else full[:, 2:])
        np.testing.assert_array_equal(gathered, full)
        np.testing.assert_array_equal(out["keras_rows"], full)

        is_cols, local, gathered, is_replicated, replicated, unchanged = out["relayout"]
        assert is_cols and is_replicated and unchanged
        np.testing.assert_array_equal(local, full[:, :2] if rank == 0 else full[:, 2:])
        np.testing.assert_array_equal(gathered, full)
        np.testing.assert_array_equal(replicated, full)

        on_grid_mesh, placements, local, gathered = out["other_mesh"]
        assert on_grid_mesh
        assert placements == ["Replicate()", "Shard(dim=0)"]
        np.testing.assert_array_equal(local, full[:3] if rank == 0 else full[3:])
        np.testing.assert_array_equal(gathered, full)

        reduced_placements, reduced, scattered_placements, scattered, gathered = out["partial"]
        assert reduced_placements == ["Replicate()"]
        np.testing.assert_array_equal(reduced, np.full((4, 2), 3.0, "float32"))
        assert scattered_placements == ["Shard(dim=0)"]
        total = np.arange(8, dtype="float32").reshape(4, 2) * 3
        np.testing.assert_array_equal(scattered, total[:2] if rank == 0 else total[2:])
        np.testing.assert_array_equal(gathered, total)

        dtype, local, gathered, one_local, one_full, empty_local, empty_full = out["small"]
        assert dtype == "torch.int64"
        np.testing.assert_array_equal(local, [0, 1] if rank == 0 else [2])
        np.testing.assert_array_equal(gathered, np.arange(3))
        assert one_local == ((1, 4) if rank == 0 else (0, 4))
        np.testing.assert_array_equal(one_full, np.ones((1, 4), "float32"))
        assert empty_local == (0, 4) and empty_full == (0, 4)


def test_error_cases(pool2):
    for errors, after in pool2.run(_error_cases):
        _assert_error(
            errors["rank"],
            "ValueError",
            r"Layout axes \('batch', None\) have 2 entries, but the tensor has "
            r"shape \(4,\) \(rank 1\)\. Give the layout one entry",
        )
        _assert_error(
            errors["rank_dtensor"],
            "ValueError",
            r"Layout axes \('batch', None, None\) have 3 entries, but the tensor has "
            r"shape \(4, 2\)",
        )
        _assert_error(
            errors["too_few_devices"],
            "ValueError",
            r"DeviceMesh shape=\(1,\) has 1 devices, but 2 processes run\..*"
            r"product is 2",
        )
        _assert_error(
            errors["too_many_devices"],
            "ValueError",
            r"DeviceMesh shape=\(2, 2\) has 4 devices, but 2 processes run",
        )
        _assert_error(
            errors["too_few_in_layout"], "ValueError", r"has 1 devices, but 2 processes run"
        )
        _assert_error(
            errors["repeated_device"],
            "ValueError",
            r"devices \['cpu:0', 'cpu:0'\] do not name each of the 2 processes once",
        )
        _assert_error(
            errors["foreign_device"], "ValueError", r"Device 'tpu:0' is not a device of this package"
        )
        _assert_error(
            errors["repeated_axis_name"], "ValueError", r"axis_names \['x', 'x'\] repeat a name"
        )
        _assert_error(errors["unknown_axis_keras"], "ValueError", r"Invalid axis names.*model")
        _assert_error(
            errors["unknown_axis_ours"],
            "ValueError",
            r"name the mesh axis 'model', which the mesh does not have; its axes are \['batch'\]",
        )
        _assert_error(errors["unknown_axis_layout_map"], "ValueError", r"Invalid axis names")
        _assert_error(
            errors["no_mesh"], "ValueError", r"TensorLayout axes=\('batch', None\) has no device mesh"
        )
        _assert_error(
            errors["gpu_mesh"], "ValueError", r"are GPUs, but CUDA is not available"
        )
        np.testing.assert_array_equal(after, np.arange(4, dtype="float32"))


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
    pool = ProcessGroupPool(2, timeout=120, initialize=False)
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
        _assert_error(
            result["wrong_world"],
            "ValueError",
            rf"initialize\(num_processes={world + 1}\) but torch.distributed already runs {world} processes",
        )
        _assert_error(
            result["wrong_rank"],
            "ValueError",
            rf"initialize\(process_id={1 - rank}\) but this process already is rank {rank}",
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
    results = fresh_pool2.run(_initialize_explicit, f"127.0.0.1:{_free_port()}", 2, ranks)
    _check_initialized(results)


def test_initialize_with_one_address_per_process(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    addresses = f"127.0.0.1:{_free_port()},127.0.0.1:{_free_port()}"
    results = fresh_pool2.run(_initialize_explicit, addresses, 2, ranks)
    _check_initialized(results)


def test_initialize_from_torchrun_env(fresh_pool2):
    ranks = _ranks(fresh_pool2)
    environments = fresh_pool2.run(_leftover_env)
    results = fresh_pool2.run(_initialize_from_torchrun_env, _free_port(), 2, ranks)
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["devices"] == ["cpu:0", "cpu:1"]
        _assert_error(
            result["wrong_world"],
            "ValueError",
            r"initialize\(num_processes=3\) but torch.distributed already runs 2 processes",
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
        _initialize_from_keras_env, f"127.0.0.1:{_free_port()}", 2, ranks
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
    for found, devices, initialized in fresh_pool2.run(_torchrun_env_mismatch, 2, ranks):
        _assert_error(
            found,
            "ValueError",
            r"initialize\(num_processes=4\) but torchrun started WORLD_SIZE=2 processes",
        )
        _assert_error(
            devices,
            "RuntimeError",
            r"WORLD_SIZE=2 processes, but torch.distributed is not initialized yet.*initialize\(\)",
        )
        assert not initialized

"""Devices, ranks and meshes on gloo ranks (CPU): what list_devices and
DataParallel report on 2 and 4 processes, the cache of torch meshes while
distributions switch, and devices out of rank order.

Worker functions are module-level (the pool pickles them by name), return
plain Python / numpy values, and every assertion runs in the pytest process.
The session pools `pool2` / `pool4` come from conftest.
"""

import numpy as np
import pytest

from helpers import assert_error
from helpers import error_of

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# Worker functions
# ---------------------------------------------------------------------------


def _devices_and_ranks():
    import keras
    import torch.distributed as dist

    from keras_torch_distribution._backend import distribution_lib

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

    from keras_torch_distribution._distributed import layouts

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
    distinct = len({id(dp_mesh), id(mp_mesh), id(other_names.backend_mesh)})

    # Switch back and forth; every rank must stay in step.
    sums = []
    for _ in range(2):
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        current = keras.distribution.distribution().device_mesh.backend_mesh
        sums.append(
            ("dp", current is dp_mesh, _all_reduce_on(current, "batch"))
        )
        grid_again = keras.distribution.DeviceMesh(
            (1, 2), ["batch", "model"], devices
        )
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
    reversed_mesh = keras.distribution.DeviceMesh(
        (2,), ["batch"], devices[::-1]
    )
    grid = keras.distribution.DeviceMesh(
        (2, 1), ["batch", "model"], devices[::-1]
    )
    return (
        error_of(lambda: reversed_mesh.backend_mesh),
        error_of(lambda: grid.backend_mesh),
    )


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
        # On the (1, 2) mesh the "batch" axis holds one rank: its sum is its
        # own.
        assert (
            result["sums"]
            == [
                ("dp", True, 3.0),
                ("mp", True, 3.0, float(rank + 1)),
            ]
            * 2
        )
        for gathered in result["gathered"]:
            np.testing.assert_array_equal(gathered, result["full"])


def test_devices_out_of_rank_order_are_refused(pool2):
    for reversed_1d, reversed_2d in pool2.run(_reordered_devices):
        assert_error(
            reversed_1d,
            "ValueError",
            (
                r"DeviceMesh devices \['cpu:1', 'cpu:0'\] \(as a grid of ranks "
                r"\[1, 0\]\) do not increase along mesh axis "
                r"'batch'.*list_devices\(\)"
            ),
        )
        assert_error(
            reversed_2d,
            "ValueError",
            r"ranks \[\[1\], \[0\]\]\) do not increase along mesh axis 'batch'",
        )

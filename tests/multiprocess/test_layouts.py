"""Layouts and `distribute_tensor` on gloo ranks (CPU): placements on 1-D,
2-D and 2x2 meshes against torch's own `distribute_tensor`, round trips
(numpy, torch and Keras inputs, relayouts, Partial values, small and empty
tensors), and the errors of meshes and layouts that do not fit.

Worker functions are module-level (the pool pickles them by name), return
plain Python / numpy values, and every assertion runs in the pytest process.
The session pools `pool2` / `pool4` come from conftest.
"""

import numpy as np
import pytest

from helpers import assert_error
from helpers import error_of

pytestmark = pytest.mark.slow

FULL_SHAPES = [(6, 4), (5, 3), (1, 3), (7, 2, 3)]


# ---------------------------------------------------------------------------
# Worker functions
# ---------------------------------------------------------------------------


def _layout_cases(mesh_shape, axis_names, cases, devices=None):
    """For each (tensor shape, layout axes): our placements, local block and
    round trip, against torch's `distribute_tensor` of the same full tensor."""
    import keras
    import numpy as np
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_torch_distribution._backend import distribution_lib
    from keras_torch_distribution._distributed import layouts

    mesh = keras.distribution.DeviceMesh(
        mesh_shape,
        list(axis_names),
        devices or keras.distribution.list_devices(),
    )
    results = []
    for shape, axes in cases:
        full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(
            shape
        )
        if any(isinstance(a, (tuple, list)) for a in axes):
            # Keras' TensorLayout refuses tuples of axes; go through ours.
            torch_layout = layouts.TorchLayout(
                mesh.backend_mesh,
                layouts.placements_for(axes, axis_names),
                axes,
            )
            ours = distribution_lib.distribute_tensor(full, torch_layout)
        else:
            layout = keras.distribution.TensorLayout(axes, mesh)
            torch_layout = layout.backend_layout
            ours = keras.distribution.distribute_tensor(full, layout)
        reference = distribute_tensor(
            full, mesh.backend_mesh, torch_layout.placements
        )
        box = layouts.local_box(
            shape, mesh.backend_mesh, torch_layout.placements
        )
        results.append(
            {
                "shape": shape,
                "axes": axes,
                "placements": [repr(p) for p in torch_layout.placements],
                "box_shape": tuple(hi - lo for lo, hi in box),
                "local_shape": tuple(ours.to_local().shape),
                "reference_shape": tuple(reference.to_local().shape),
                "same_local": bool(
                    torch.equal(ours.to_local(), reference.to_local())
                ),
                "same_placements": tuple(ours.placements)
                == tuple(reference.placements),
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
    out["torch_cols"] = (
        from_torch.to_local().numpy(),
        from_torch.full_tensor().numpy(),
    )
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
        torch.full((4, 2), float(rank + 1)),
        mesh.backend_mesh,
        [Partial()],
        run_check=False,
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

    from keras_torch_distribution._distributed import layouts

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    errors = {}
    errors["rank"] = error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4,), "float32"),
        keras.distribution.TensorLayout(("batch", None), mesh),
    )
    errors["rank_dtensor"] = error_of(
        keras.distribution.distribute_tensor,
        keras.distribution.distribute_tensor(
            np.zeros((4, 2), "float32"),
            keras.distribution.TensorLayout(("batch", None), mesh),
        ),
        keras.distribution.TensorLayout(("batch", None, None), mesh),
    )
    errors["too_few_devices"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (1,), ["batch"], devices[:1]
            ).backend_mesh
        )
    )
    errors["too_many_devices"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (2, 2), ["batch", "model"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
            ).backend_mesh
        )
    )
    errors["too_few_in_layout"] = error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4, 2), "float32"),
        keras.distribution.TensorLayout(
            ("batch", None),
            keras.distribution.DeviceMesh((1,), ["batch"], devices[:1]),
        ),
    )
    errors["repeated_device"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (2,), ["batch"], ["cpu:0", "cpu:0"]
            ).backend_mesh
        )
    )
    errors["foreign_device"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (2,), ["batch"], ["tpu:0", "tpu:1"]
            ).backend_mesh
        )
    )
    errors["repeated_axis_name"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (1, 2), ["x", "x"], devices
            ).backend_mesh
        )
    )
    errors["unknown_axis_keras"] = error_of(
        keras.distribution.TensorLayout, ("model", None), mesh
    )
    errors["unknown_axis_ours"] = error_of(
        layouts.placements_for, ("model", None), list(mesh.axis_names)
    )
    errors["unknown_axis_layout_map"] = error_of(
        keras.distribution.LayoutMap(mesh).__setitem__,
        "kernel",
        (None, "model"),
    )
    errors["no_mesh"] = error_of(
        keras.distribution.distribute_tensor,
        np.zeros((4, 2), "float32"),
        keras.distribution.TensorLayout(("batch", None)),
    )
    errors["gpu_mesh"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (2,), ["batch"], ["gpu:0", "gpu:1"]
            ).backend_mesh
        )
    )
    # The pool still works after the errors: every rank stayed in step.
    after = (
        keras.distribution.distribute_tensor(
            np.arange(4, dtype="float32"),
            keras.distribution.TensorLayout(("batch",), mesh),
        )
        .full_tensor()
        .numpy()
    )
    return errors, after


# ---------------------------------------------------------------------------
# Tests on the session pools
# ---------------------------------------------------------------------------


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
    results = pool4.run(
        _layout_cases, (2, 2), ("batch", "model"), cases, devices
    )
    _check_layout_results(results, expected)
    # 5 rows over the 4 ranks, nested batch-major: 2, 1, 1, 1 (torch's rule).
    index = AXES_2X2.index(((("batch", "model"), None), [S0, S0])) + len(
        AXES_2X2
    )
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
        np.testing.assert_array_equal(
            local, full[:3] if rank == 0 else full[3:]
        )
        np.testing.assert_array_equal(gathered, full)

        local, gathered = out["torch_cols"]
        np.testing.assert_array_equal(
            local, full[:, :2] if rank == 0 else full[:, 2:]
        )
        np.testing.assert_array_equal(gathered, full)
        np.testing.assert_array_equal(out["keras_rows"], full)

        is_cols, local, gathered, is_replicated, replicated, unchanged = out[
            "relayout"
        ]
        assert is_cols and is_replicated and unchanged
        np.testing.assert_array_equal(
            local, full[:, :2] if rank == 0 else full[:, 2:]
        )
        np.testing.assert_array_equal(gathered, full)
        np.testing.assert_array_equal(replicated, full)

        on_grid_mesh, placements, local, gathered = out["other_mesh"]
        assert on_grid_mesh
        assert placements == ["Replicate()", "Shard(dim=0)"]
        np.testing.assert_array_equal(
            local, full[:3] if rank == 0 else full[3:]
        )
        np.testing.assert_array_equal(gathered, full)

        (
            reduced_placements,
            reduced,
            scattered_placements,
            scattered,
            gathered,
        ) = out["partial"]
        assert reduced_placements == ["Replicate()"]
        np.testing.assert_array_equal(reduced, np.full((4, 2), 3.0, "float32"))
        assert scattered_placements == ["Shard(dim=0)"]
        total = np.arange(8, dtype="float32").reshape(4, 2) * 3
        np.testing.assert_array_equal(
            scattered, total[:2] if rank == 0 else total[2:]
        )
        np.testing.assert_array_equal(gathered, total)

        dtype, local, gathered, one_local, one_full, empty_local, empty_full = (
            out["small"]
        )
        assert dtype == "torch.int64"
        np.testing.assert_array_equal(local, [0, 1] if rank == 0 else [2])
        np.testing.assert_array_equal(gathered, np.arange(3))
        assert one_local == ((1, 4) if rank == 0 else (0, 4))
        np.testing.assert_array_equal(one_full, np.ones((1, 4), "float32"))
        assert empty_local == (0, 4) and empty_full == (0, 4)


def test_error_cases(pool2):
    for errors, after in pool2.run(_error_cases):
        assert_error(
            errors["rank"],
            "ValueError",
            r"Layout axes \('batch', None\) have 2 entries, but the tensor has "
            r"shape \(4,\) \(rank 1\)\. Give the layout one entry",
        )
        assert_error(
            errors["rank_dtensor"],
            "ValueError",
            (
                r"Layout axes \('batch', None, None\) have 3 entries, but the "
                r"tensor has shape \(4, 2\)"
            ),
        )
        assert_error(
            errors["too_few_devices"],
            "ValueError",
            r"DeviceMesh shape=\(1,\) has 1 devices, but 2 processes run\..*"
            r"product is 2",
        )
        assert_error(
            errors["too_many_devices"],
            "ValueError",
            r"DeviceMesh shape=\(2, 2\) has 4 devices, but 2 processes run",
        )
        assert_error(
            errors["too_few_in_layout"],
            "ValueError",
            r"has 1 devices, but 2 processes run",
        )
        assert_error(
            errors["repeated_device"],
            "ValueError",
            (
                r"devices \['cpu:0', 'cpu:0'\] do not name each of the 2 "
                r"processes once"
            ),
        )
        assert_error(
            errors["foreign_device"],
            "ValueError",
            r"Device 'tpu:0' is not a device of this package",
        )
        assert_error(
            errors["repeated_axis_name"],
            "ValueError",
            r"axis_names \['x', 'x'\] repeat a name",
        )
        assert_error(
            errors["unknown_axis_keras"],
            "ValueError",
            r"Invalid axis names.*model",
        )
        assert_error(
            errors["unknown_axis_ours"],
            "ValueError",
            (
                r"name the mesh axis 'model', which the mesh does not have; "
                r"its axes are \['batch'\]"
            ),
        )
        assert_error(
            errors["unknown_axis_layout_map"],
            "ValueError",
            r"Invalid axis names",
        )
        assert_error(
            errors["no_mesh"],
            "ValueError",
            r"TensorLayout axes=\('batch', None\) has no device mesh",
        )
        assert_error(
            errors["gpu_mesh"],
            "ValueError",
            r"are GPUs, but CUDA is not available",
        )
        np.testing.assert_array_equal(after, np.arange(4, dtype="float32"))

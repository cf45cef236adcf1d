"""Single-process tests of the foundation: install, the Keras seam, devices,
layout translation and the public `keras.distribution` objects.

These run in the pytest process (KERAS_BACKEND=torch, set by conftest) and
start no process group, except `one_process_world`, which removes its own.
"""

import warnings

import keras
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

import keras_torch_distribution
from keras_torch_distribution import _keras
from keras_torch_distribution._backend import distribution_lib
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._processes import runtime


def _keras_backend_distribution_lib():
    from keras.src import backend as keras_backend  # the seam test allows tests

    return keras_backend.distribution_lib


def _keras_front_end_distribution_lib():
    from keras.src.distribution import distribution_lib as front_end

    return front_end.distribution_lib


@pytest.fixture
def reinstall():
    """Leave Keras with the package installed, whatever the test did."""
    yield
    keras_torch_distribution.install()
    assert keras_torch_distribution.is_installed()


@pytest.fixture
def one_process_world():
    """A world of one process for the test; removed (with its meshes) after."""
    if dist.is_initialized():
        pytest.skip("another test left a process group in the pytest process")
    layouts.torch_meshes.clear()
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)
        if dist.is_initialized():
            dist.destroy_process_group()
        layouts.torch_meshes.clear()


# ---------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------


def test_import_installs():
    assert keras_torch_distribution.is_installed()
    assert _keras_backend_distribution_lib() is distribution_lib
    assert _keras_front_end_distribution_lib() is distribution_lib


def test_install_twice_is_harmless(reinstall):
    before = keras.Model.__call__
    keras_torch_distribution.install()
    keras_torch_distribution.install()
    assert keras_torch_distribution.is_installed()
    # A second install must not wrap the wrappers.
    assert keras.Model.__call__ is before
    assert _keras_backend_distribution_lib() is distribution_lib


def _keras_own_distribution_lib():
    """The torch backend's own `distribution_lib` the package replaced:
    None on Keras 3.15, Keras' module on 3.16."""
    from keras_torch_distribution import _install

    (patch,) = [
        p
        for p in _install._installed
        if p.owner is _keras.keras_backend_module
        and p.name == "distribution_lib"
    ]
    return patch.original


def test_uninstall_restores_keras_and_reinstall_works(reinstall):
    own = _keras_own_distribution_lib()
    patched_call = keras.Model.__call__
    keras_torch_distribution.uninstall()
    assert not keras_torch_distribution.is_installed()
    assert _keras_backend_distribution_lib() is own
    assert _keras_front_end_distribution_lib() is own
    assert keras.Model.__call__ is not patched_call
    # Model inherits __call__ from Layer; uninstall removes the override.
    assert "__call__" not in keras.Model.__dict__
    assert keras.Model.__call__ is keras.layers.Layer.__call__
    if own is None:
        # Keras 3.15's torch backend has no distribution support.
        with pytest.raises(AttributeError):
            keras.distribution.list_devices()
    else:
        # Keras 3.16's has its own, which answers again.
        assert keras.distribution.list_devices() == own.list_devices()
    keras_torch_distribution.uninstall()  # twice is harmless too
    assert _keras_backend_distribution_lib() is own

    keras_torch_distribution.install()
    assert keras_torch_distribution.is_installed()
    assert _keras_backend_distribution_lib() is distribution_lib
    assert _keras_front_end_distribution_lib() is distribution_lib
    assert keras.distribution.list_devices() == ["cpu:0"]


def test_model_works_after_reinstall(reinstall):
    keras_torch_distribution.uninstall()
    keras_torch_distribution.install()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    out = model(np.ones((4, 3), "float32"))
    assert tuple(out.shape) == (4, 2)


# ---------------------------------------------------------------------------
# The one seam and the environment guard
# ---------------------------------------------------------------------------


def test_environment_check_passes_here():
    _keras.check_environment()


def test_non_torch_backend_is_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(
        ImportError,
        match=r"needs the torch backend.*'jax'.*KERAS_BACKEND=torch",
    ):
        _keras.check_environment()


@pytest.mark.parametrize("version", ["3.15.0", "3.14.2", "2.15.0"])
def test_older_keras_version_is_refused(monkeypatch, version):
    monkeypatch.setattr(keras, "__version__", version)
    with pytest.raises(
        ImportError,
        match=(
            rf"supports keras>=3\.15\.1,<3\.17, but keras {version} is "
            r"installed.*pip install"
        ),
    ):
        _keras.check_environment()


@pytest.mark.parametrize(
    "version",
    ["3.15.1", "3.15.2", "3.15.1.dev2025", "3.16.0.dev2026102704", "3.16.1"],
)
def test_supported_keras_versions_pass(monkeypatch, version):
    monkeypatch.setattr(keras, "__version__", version)
    _keras.check_environment()
    assert not _keras.newer_keras()


@pytest.mark.parametrize("version", ["3.17.0", "3.20.1", "4.0.0"])
def test_newer_keras_is_checked_not_refused(monkeypatch, version):
    monkeypatch.setattr(keras, "__version__", version)
    _keras.check_environment()
    assert _keras.newer_keras()


def test_newer_keras_installs_with_one_warning_saying_what_it_checked(
    reinstall, monkeypatch
):
    from keras_torch_distribution import _install

    keras_torch_distribution.uninstall()
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.setattr(_install, "_warned_newer", [])
    with pytest.warns(UserWarning) as record:
        keras_torch_distribution.install()
    (warning,) = [w for w in record if "3.99.0" in str(w.message)]
    text = str(warning.message)
    assert "tested with keras>=3.15.1,<3.17" in text
    # Keras' own rows: not those of libraries on Keras (keras_hub's, applied
    # at install where an earlier test imported them).
    from keras_torch_distribution import _patches

    assert f"all {len(_patches._patch_table())} Keras internals" in text
    for line in _keras.differences():
        assert line in text
    assert keras_torch_distribution.is_installed()
    keras_torch_distribution.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_torch_distribution.install()  # once per process


def test_install_refuses_a_keras_that_lacks_a_patch_target(
    reinstall, monkeypatch
):
    # reinstall is listed first so that it runs after monkeypatch is undone.
    own = _keras_own_distribution_lib()
    keras_torch_distribution.uninstall()
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.delattr(_keras.BackupAndRestore, "_save_model")
    with pytest.raises(
        ImportError,
        match=r"keras 3\.99\.0: these internals are missing: "
        r"\['BackupAndRestore\._save_model'\].*keras>=3\.15\.1,<3\.17.*"
        r"pip install",
    ):
        keras_torch_distribution.install()
    # Nothing was patched by the failed install.
    assert not keras_torch_distribution.is_installed()
    assert _keras_backend_distribution_lib() is own


def test_every_patch_target_exists_on_the_installed_keras():
    """The patch table of the installed Keras (3.15 or 3.16: the patches
    only 3.16 needs are in it only there) names only attributes that
    exist, and each of the version-dependent ones where its feature is."""
    from keras_torch_distribution import _patches

    table = _patches._patch_table()
    missing = [p.describe() for p in table if not hasattr(p.owner, p.name)]
    assert missing == []
    targets = {p.describe() for p in table}
    native = {
        "keras.src.backend.torch.trainer.distribute_data_input",
        "TorchEpochIterator._get_iterator",
        f"{_keras.TorchTrainer.__qualname__}._initialize_ddp",
    }
    assert (native <= targets) == _keras.NATIVE_TORCH_TRAINING
    assert not (native & targets) or _keras.NATIVE_TORCH_TRAINING
    assert (
        "Variable._initialize_distributed" in targets
    ) == _keras.NATIVE_VARIABLE_DISTRIBUTION
    for owner in _keras.CONVERT_TO_NUMPY_OWNERS:
        assert f"{owner.__name__}.convert_to_numpy" in targets


# ---------------------------------------------------------------------------
# Devices in one process
# ---------------------------------------------------------------------------


def test_devices_in_one_process():
    assert keras.distribution.list_devices() == ["cpu:0"]
    assert keras.distribution.list_devices("cpu") == ["cpu:0"]
    assert keras.distribution.list_devices("CPU") == ["cpu:0"]
    assert keras.distribution.get_device_count() == 1
    assert keras.distribution.get_device_count("cpu") == 1
    assert keras.distribution.list_devices("tpu") == []
    if not torch.cuda.is_available():  # an error naming what was found
        with pytest.raises(
            RuntimeError,
            match=r"^list_devices\('gpu'\) asks for GPUs, but CUDA is not "
            r"available here: torch \S+ is built (without CUDA|with CUDA "
            r"[\d.]+, it sees 0 CUDA device)",
        ):
            keras.distribution.list_devices("gpu")
        with pytest.raises(RuntimeError, match="asks for GPUs"):
            keras.distribution.get_device_count("gpu")
    # Listing devices starts no process group.
    assert not dist.is_initialized()
    assert distribution_lib.num_processes() == 1
    assert distribution_lib.process_id() == 0


def test_unknown_device_type():
    with pytest.raises(
        ValueError,
        match=r"device_type='npu' is not one of 'cpu', 'gpu' or 'tpu'",
    ):
        keras.distribution.list_devices("npu")


def test_devices_need_initialize_when_launched(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError,
        match=r"WORLD_SIZE=2 says.*lacks MASTER_ADDR, "
        r"MASTER_PORT, RANK.*keras.distribution.initialize\(",
    ):
        keras.distribution.list_devices()


@pytest.mark.parametrize(
    "device, rank", [("cpu:0", 0), ("gpu:3", 3), ("cuda:12", 12), ("CPU:1", 1)]
)
def test_device_rank(device, rank):
    assert layouts.device_rank(device) == rank


@pytest.mark.parametrize("device", ["tpu:0", "cpu", "cpu:x", "0"])
def test_device_rank_rejects(device):
    with pytest.raises(
        ValueError,
        match=(
            rf"Device '{device}' is not a device of this package.*list_devices"
        ),
    ):
        layouts.device_rank(device)


@pytest.mark.parametrize("text", ["0", "-1", "soon"])
def test_timeout_must_be_positive(monkeypatch, text):
    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", text)
    with pytest.raises(
        ValueError,
        match=rf"KTD_TIMEOUT_SECONDS='{text}' is not a positive number",
    ):
        runtime.timeout_seconds()


def test_init_method_parsing():
    from keras_torch_distribution._processes.environments import coordinator_url

    assert coordinator_url("10.0.0.1:1234") == "tcp://10.0.0.1:1234"
    assert (
        coordinator_url("10.0.0.1:1234,10.0.0.2:2345") == "tcp://10.0.0.1:1234"
    )
    assert coordinator_url("file:///tmp/x") == "file:///tmp/x"
    assert coordinator_url("localhost") == "tcp://localhost:29500"
    for bad in (":1234", "host:port"):
        with pytest.raises(ValueError, match=rf"job_addresses='{bad}'"):
            coordinator_url(bad)


def test_initialize_argument_errors(monkeypatch):
    # KTD_SPAWN=0: initialize(num_processes=2) must not start 2 pytest
    # processes.
    monkeypatch.setenv("KTD_SPAWN", "0")
    if dist.is_initialized():
        pytest.skip(
            "a process group runs in the pytest process; initialize() would "
            "return early"
        )
    with pytest.raises(
        ValueError, match=r"also needs num_processes and process_id"
    ):
        keras.distribution.initialize(job_addresses="localhost:1")
    with pytest.raises(
        ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"
    ):
        keras.distribution.initialize(
            job_addresses="localhost:1", num_processes=2, process_id=2
        )
    with pytest.raises(ValueError, match=r"lists 3 jobs but num_processes=2"):
        keras.distribution.initialize(
            job_addresses="a:1,b:2,c:3", num_processes=2, process_id=0
        )
    with pytest.raises(
        ValueError,
        match=(
            r"^initialize\(num_processes=2\) would start 2 local processes, "
            r"but KTD_SPAWN=0 is set. Start the script with `ktd run -n 2 "
            r"script.py` \(or torchrun --nproc-per-node 2\); or give every "
            r"process job_addresses='host:port' \(process 0's\) and its "
            r"process_id.$"
        ),
    ):
        keras.distribution.initialize(num_processes=2)
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------
# Layout translation (pure functions)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "axes, expected",
    [
        (("batch",), (Shard(0),)),
        ((None,), (Replicate(),)),
        ((None, "batch"), (Shard(1),)),
        ((None, None, "batch"), (Shard(2),)),
        ((), (Replicate(),)),
    ],
)
def test_placements_1d_mesh(axes, expected):
    assert layouts.placements_for(axes, ["batch"]) == expected


@pytest.mark.parametrize(
    "axes, expected",
    [
        (("batch", "model"), (Shard(0), Shard(1))),
        (("model", "batch"), (Shard(1), Shard(0))),
        ((None, "model"), (Replicate(), Shard(1))),
        (("batch", None), (Shard(0), Replicate())),
        ((None, None), (Replicate(), Replicate())),
        ((("batch", "model"), None), (Shard(0), Shard(0))),
        ((None, ("batch", "model")), (Shard(1), Shard(1))),
        ((None, ["batch", "model"]), (Shard(1), Shard(1))),
        ((("model",), None), (Replicate(), Shard(0))),
    ],
)
def test_placements_2d_mesh(axes, expected):
    assert layouts.placements_for(axes, ["batch", "model"]) == expected


def test_placements_unknown_axis():
    with pytest.raises(
        ValueError,
        match=(
            r"name the mesh axis 'data', which the mesh does not have; its "
            r"axes are \['batch', 'model'\]"
        ),
    ):
        layouts.placements_for(("data", None), ["batch", "model"])
    with pytest.raises(ValueError, match=r"mesh axis 'data'"):
        layouts.placements_for(((("batch", "data")), None), ["batch", "model"])


def test_placements_axis_used_twice():
    with pytest.raises(
        ValueError,
        match=(
            r"use the mesh axis 'model' for dims 0 and 1; a mesh axis can "
            r"shard only one tensor dim"
        ),
    ):
        layouts.placements_for(("model", "model"), ["batch", "model"])
    with pytest.raises(
        ValueError, match=r"use the mesh axis 'batch' for dims 0 and 1"
    ):
        layouts.placements_for(
            (("batch", "model"), "batch"), ["batch", "model"]
        )


def test_placements_axes_out_of_mesh_order():
    with pytest.raises(
        ValueError, match=r"out of the mesh's axis order \['batch', 'model'\]"
    ):
        layouts.placements_for((("model", "batch"), None), ["batch", "model"])


def test_check_rank_message():
    layout = layouts.TorchLayout(
        mesh=None, placements=(Shard(0),), axes=("batch", None)
    )
    with pytest.raises(
        ValueError,
        match=(
            r"Layout axes \('batch', None\) have 2 entries, but the tensor has "
            r"shape \(4,\) \(rank 1\)"
        ),
    ):
        layouts.check_rank(layout, (4,), "the tensor")


def test_mesh_key_is_configuration():
    devices = keras.distribution.list_devices()
    a = keras.distribution.DeviceMesh((1,), ["batch"], devices)
    b = keras.distribution.DeviceMesh((1,), ["batch"], devices)
    c = keras.distribution.DeviceMesh((1,), ["model"], devices)
    assert (
        layouts.mesh_key(a)
        == layouts.mesh_key(b)
        == ((1,), ("batch",), ("cpu:0",))
    )
    assert layouts.mesh_key(a) != layouts.mesh_key(c)


def test_contiguous_stride():
    assert layouts.contiguous_stride((5, 3)) == (3, 1)
    assert layouts.contiguous_stride((2, 3, 4)) == (12, 4, 1)
    assert layouts.contiguous_stride((0, 3)) == (3, 1)
    assert layouts.contiguous_stride(()) == ()


def test_layout_without_mesh_is_refused():
    layout = keras.distribution.TensorLayout(("batch", None))
    with pytest.raises(
        ValueError,
        match=r"TensorLayout axes=\('batch', None\) has no device mesh",
    ):
        layouts.to_torch_layout(layout)


def test_distribute_tensor_refuses_non_layout():
    with pytest.raises(
        ValueError,
        match=r"layout=\('batch',\) is not a keras.distribution.TensorLayout",
    ):
        distribution_lib.distribute_tensor(torch.zeros(2), ("batch",))


# ---------------------------------------------------------------------------
# The public keras.distribution objects, as on JAX
# ---------------------------------------------------------------------------


def test_device_mesh():
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1,), ["batch"], devices)
    assert mesh.shape == (1,)
    assert mesh.axis_names == ["batch"]
    assert mesh.devices.tolist() == ["cpu:0"]
    mesh2 = keras.distribution.DeviceMesh((1, 1), ["batch", "model"])
    assert mesh2.devices.shape == (1, 1)
    with pytest.raises(ValueError, match="needs 2 devices, but was given 1"):
        keras.distribution.DeviceMesh((2,), ["batch"], devices)


def test_tensor_layout_and_layout_map():
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"])
    layout = keras.distribution.TensorLayout((None, "model"), mesh)
    assert layout.axes == (None, "model")
    assert layout.device_mesh is mesh
    with pytest.raises(ValueError, match="Invalid axis names"):
        keras.distribution.TensorLayout(("data",), mesh)

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*dense.*kernel"] = (None, "model")
    layout_map[r".*dense.*bias"] = ("model",)
    kernel = layout_map["seq/dense_1/kernel"]
    assert kernel.axes == (None, "model")
    assert kernel.device_mesh is mesh
    assert layout_map["seq/dense_1/bias"].axes == ("model",)
    assert layout_map["seq/conv/kernel"] is None
    assert len(layout_map) == 2


def test_data_parallel():
    dp = keras.distribution.DataParallel()
    assert dp.device_mesh.shape == (1,)
    assert dp.batch_dim_name == "batch"
    assert dp.num_model_replicas == 1
    assert dp.num_processes == 1
    assert dp.data_shard_id == 0
    layout = dp.get_data_layout((8, 3))
    assert layout.axes == ("batch", None)
    dp2 = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()
    )
    assert dp2.device_mesh.devices.tolist() == ["cpu:0"]
    mesh = keras.distribution.DeviceMesh((1,), ["data"])
    dp3 = keras.distribution.DataParallel(device_mesh=mesh)
    assert dp3.batch_dim_name == "data"
    # Building the distributions starts no process group.
    assert not dist.is_initialized()


def test_model_parallel():
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*kernel"] = (None, "model")
    mp = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    assert mp.device_mesh is mesh
    assert mp.num_model_replicas == 1
    assert mp.num_processes == 1
    assert mp.get_tensor_layout("dense/kernel").axes == (None, "model")
    mp2 = keras.distribution.ModelParallel(layout_map=layout_map)
    assert mp2.batch_dim_name == "batch"
    with pytest.raises(
        ValueError, match="You must specify a layout_map argument"
    ):
        keras.distribution.ModelParallel()


def test_set_distribution_and_scope_restore():
    assert keras.distribution.distribution() is None
    first = keras.distribution.DataParallel()
    second = keras.distribution.DataParallel()
    try:
        keras.distribution.set_distribution(first)
        assert keras.distribution.distribution() is first
        with second.scope():
            assert keras.distribution.distribution() is second
        assert keras.distribution.distribution() is first
        with pytest.raises(RuntimeError, match="inside"):
            with second.scope():
                raise RuntimeError("inside")
        assert keras.distribution.distribution() is first
    finally:
        keras.distribution.set_distribution(None)
    assert keras.distribution.distribution() is None


# ---------------------------------------------------------------------------
# One-process world: the whole path, with a group we remove afterwards
# ---------------------------------------------------------------------------


def test_one_process_distribute_tensor(one_process_world):
    mesh = keras.distribution.DeviceMesh((1,), ["batch"])
    layout = keras.distribution.TensorLayout(("batch", None), mesh)
    full = np.arange(15, dtype="float32").reshape(5, 3)
    value = keras.distribution.distribute_tensor(full, layout)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert tuple(value.placements) == (Shard(0),)
    np.testing.assert_array_equal(value.full_tensor().numpy(), full)
    assert (
        mesh.backend_mesh
        is keras.distribution.DeviceMesh((1,), ["batch"]).backend_mesh
    )


def test_variable_numpy():
    # numpy 2 passes `copy=` to Variable.__array__, which the package patches.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    weights = model.get_weights()
    assert [w.shape for w in weights] == [(2, 1), (1,)]
    assert np.array(model.weights[0], copy=True).shape == (2, 1)

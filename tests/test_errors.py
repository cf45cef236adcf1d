"""Bad input gives a clear error: the offending value, what was expected,
and the fix. Uneven sharding is not an error: it trains with one-process
numbers.

Single-process cases run in the pytest process (a world of one process);
cases that need several processes run on the session's 2-rank pool.
Errors of starting the process group are in test_runtime.py.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401


@pytest.fixture
def one_process():
    """A world of one process, no distribution set before or after."""
    keras.distribution.initialize()
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    yield keras.distribution.list_devices()
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()


def _model_parallel(devices, rules, shape=None, axis_names=("model",)):
    mesh = keras.distribution.DeviceMesh(
        shape or (len(devices),), list(axis_names), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map)


def _dense_model(units=4):
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(units, name="dense")], name="net"
    )


def _error_text(function, *args):
    """(exception class name, message) of what `function` raises, or None."""
    try:
        function(*args)
    except (ValueError, RuntimeError, TypeError) as error:
        return type(error).__name__, str(error)
    return None


# --------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------


def test_mesh_shape_must_match_its_devices(one_process):
    with pytest.raises(ValueError, match=r"Shape does not match the number of devices. "
                       r"Received: shape=\(2,\); devices.shape=\(1,\)"):
        keras.distribution.DeviceMesh((2,), ["model"], one_process)


def test_unknown_axis_name_in_layout_map(one_process):
    distribution = _model_parallel(one_process, {})
    with pytest.raises(ValueError, match=r"Invalid axis names for Layout. Valid axis "
                       r"names: \{'model'\}, Got \{'modle'\}"):
        distribution._layout_map[".*kernel"] = (None, "modle")


def test_unknown_axis_name_in_a_tensor_layout(one_process):
    # A TensorLayout built without a mesh is checked when it meets one.
    from keras_torch_distribution import layouts

    with pytest.raises(ValueError, match=r"Layout axes \(None, 'modle'\) name the mesh "
                       r"axis 'modle', which the mesh does not have; its axes are "
                       r"\['model'\]"):
        layouts.placements_for((None, "modle"), ["model"])


def test_layout_longer_than_variable_rank(one_process):
    keras.distribution.set_distribution(
        _model_parallel(one_process, {".*kernel": (None, "model", None)})
    )
    with pytest.raises(ValueError, match=r"Layout axes \(None, 'model', None\) have 3 "
                       r"entries, but variable 'net/dense/kernel' has shape \(3, 4\) "
                       r"\(rank 2\). Give the layout one entry \(an axis name or None\) "
                       r"per dim, or fewer: a shorter layout lays out the leading dims "
                       r"and replicates the rest \(e.g. \(None, 'model'\)\)."):
        _dense_model()


def test_two_layout_map_patterns_matching_one_variable(one_process):
    keras.distribution.set_distribution(_model_parallel(
        one_process, {".*kernel": (None, "model"), ".*dense.*": ("model", None)}
    ))
    with pytest.raises(ValueError, match=r"Path 'net/dense/kernel' matches multiple "
                       r"layout specification keys: \['\.\*kernel', '\.\*dense\.\*'\]"):
        _dense_model()


def test_model_parallel_needs_a_layout_map(one_process):
    with pytest.raises(ValueError, match="You must specify a layout_map argument."):
        keras.distribution.ModelParallel()


@pytest.mark.parametrize("value", ["nan", "inf", "1e30", "abc", "-5", "0"])
def test_bad_timeout_setting(monkeypatch, value):
    from keras_torch_distribution import runtime

    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", value)
    with pytest.raises(ValueError) as caught:
        runtime.timeout_seconds()
    assert str(caught.value) == (
        f"KTD_TIMEOUT_SECONDS='{value}' is not a positive number of seconds up to "
        "604800 (one week): it sets how long the rendezvous and each collective wait "
        "for a peer. Set it to a number in (0, 604800], e.g. 300 (the default), or "
        "unset it."
    )


@pytest.mark.parametrize("variable, value, message", [
    ("KTD_LOG_LEVEL", "loud", r"^KTD_LOG_LEVEL='loud' is not a logging level: set one "
                              r"of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("KTD_DEVICE", "tpu", r"^KTD_DEVICE='tpu' is not a device choice: set KTD_DEVICE=cpu"),
])
def test_bad_settings(monkeypatch, variable, value, message):
    from keras_torch_distribution import _env

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        _env.log_level() if variable == "KTD_LOG_LEVEL" else _env.forces_cpu()


# --------------------------------------------------------------------------
# Two processes (the session's pool)
# --------------------------------------------------------------------------


def mesh_errors():
    """Meshes that do not cover the 2 running processes."""
    devices = keras.distribution.list_devices()
    found = {}
    one = keras.distribution.DeviceMesh((1,), ["model"], devices[:1])
    layout_map = keras.distribution.LayoutMap(one)
    layout_map[".*kernel"] = (None, "model")
    found["model_parallel"] = _error_text(
        lambda: keras.distribution.ModelParallel(layout_map=layout_map)
    )
    found["data_parallel"] = _error_text(
        lambda: keras.distribution.DataParallel(devices=devices[:1]).device_mesh.backend_mesh
    )
    four = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    found["too_many"] = _error_text(
        lambda: keras.distribution.DeviceMesh((2, 2), ["batch", "model"], four).backend_mesh
    )
    return found


def test_mesh_must_cover_every_process(pool2):
    for found in pool2.run(mesh_errors):
        for where, shape, count in (
            ("model_parallel", (1,), 1), ("data_parallel", (1,), 1), ("too_many", (2, 2), 4),
        ):
            assert found[where] is not None, f"{where} did not raise"
            kind, message = found[where]
            assert kind == "ValueError"
            assert message == (
                f"DeviceMesh shape={shape} has {count} devices, but 2 processes run. "
                "The mesh must cover every process, one device per process: build "
                "it from keras.distribution.list_devices() with a shape whose "
                "product is 2."
            ), (where, message)


UNEVEN_RULES = {".*dense/kernel": (None, "model"), ".*dense/bias": ("model",),
                ".*out/kernel": ("model", None)}


def _uneven_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(5, activation="tanh", name="dense"),  # 5 columns on 2 ranks
        keras.layers.Dense(3, name="out"),  # 5 rows on 2 ranks
    ], name="uneven")


def uneven_training(distributed):
    if distributed:
        devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(_model_parallel(devices, UNEVEN_RULES))
    model = _uneven_model()
    local_shapes = {
        v.path: tuple(getattr(v.value, "_local_tensor", v.value).shape)
        for v in model.weights
    }
    model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], [np.asarray(w) for w in model.weights], local_shapes


def test_uneven_sharding_trains_with_one_process_numbers(pool2):
    """A dim that its mesh axis does not divide is sharded unevenly (as
    torch.chunk: ceil-sized blocks first, the last one smaller)."""
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    reference_loss, reference_weights, _ = uneven_training(False)
    keras.backend.clear_session()
    results = pool2.run(uneven_training, True)
    expected_shapes = [
        {"uneven/dense/kernel": (3, 3), "uneven/dense/bias": (3,), "uneven/out/kernel": (3, 3)},
        {"uneven/dense/kernel": (3, 2), "uneven/dense/bias": (2,), "uneven/out/kernel": (2, 3)},
    ]
    for rank, (loss, weights, shapes) in enumerate(results):
        for path, shape in expected_shapes[rank].items():
            assert shapes[path] == shape, (rank, path, shapes[path])
        np.testing.assert_allclose(loss, reference_loss, rtol=1e-5, atol=1e-6)
        for got, want in zip(weights, reference_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _Records:
    """Collects the package logger's records."""

    def __init__(self):
        import logging

        self.handler = logging.Handler()
        self.records = []
        self.handler.emit = self.records.append
        self.logger = logging.getLogger("keras_torch_distribution")

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc_info):
        self.logger.removeHandler(self.handler)


def test_variable_created_outside_the_distribution_warns_once(one_process):
    model = _dense_model()  # no distribution set: kernel is whole
    keras.distribution.set_distribution(_model_parallel(one_process, {".*kernel": (None, "model")}))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 4), "float32")
    with _Records() as records:
        model.fit(x, y, verbose=0)
        model.fit(x, y, verbose=0)
    messages = [r.getMessage() for r in records if "created with no distribution" in r.getMessage()]
    assert messages == [
        "Variable 'net/dense/kernel' was created with no distribution set, so it "
        "is whole on every rank, but the current distribution would shard it "
        "with axes (None, 'model'). Create the model after "
        "keras.distribution.set_distribution(...) or inside distribution.scope()."
    ], messages

"""Bad input gives a clear error: the offending value, what was expected,
and the fix. Uneven sharding is not an error: it trains with one-process
numbers.

Single-process cases run in the pytest process (a world of one process);
cases that need several processes run on the session's 2-rank pool or in a
subprocess with a timeout.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_bad_timeout_setting(monkeypatch):
    from keras_torch_distribution import runtime

    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match=r"KTD_TIMEOUT_SECONDS='soon' is not a positive "
                       r"number of seconds. Set it to e.g. 300, or unset it."):
        runtime.timeout_seconds()


def test_initialize_passes_the_timeout_to_torch(monkeypatch):
    """Collectives time out after KTD_TIMEOUT_SECONDS (gloo honours the
    process group's timeout): initialize hands it to init_process_group."""
    from keras_torch_distribution import runtime

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", "7")
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "init_process_group", fake_init)
    with pytest.raises(RuntimeError, match=r"could not start process 1 of 2 at "
                       r"tcp://127.0.0.1:9 within KTD_TIMEOUT_SECONDS=7 s: stop here"):
        runtime.initialize("127.0.0.1:9", 2, 1)
    assert seen["timeout"].total_seconds() == 7


# --------------------------------------------------------------------------
# Subprocesses: a multi-process environment that must not be initialized
# --------------------------------------------------------------------------


def _python(code, env, timeout=60):
    environment = dict(os.environ, KERAS_BACKEND="torch", KTD_DEVICE="cpu",
                       OMP_NUM_THREADS="1", **env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in env:
            environment.pop(key, None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment,
        capture_output=True, text=True, timeout=timeout,
    )


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


_REPORT_ERRORS = """
import json, time
import keras
import keras_torch_distribution

def error_of(function):
    start = time.monotonic()
    try:
        function()
    except (ValueError, RuntimeError) as error:
        return [type(error).__name__, str(error), time.monotonic() - start]
    return None
"""


@pytest.mark.slow
def test_initialize_with_an_unreachable_address_fails_fast():
    port = _closed_port()
    code = _REPORT_ERRORS + textwrap.dedent(f"""
    found = error_of(lambda: keras.distribution.initialize(
        job_addresses="127.0.0.1:{port}", num_processes=2, process_id=1))
    print("RESULT", json.dumps(found))
    """)
    start = time.monotonic()
    result = _python(code, {"KTD_TIMEOUT_SECONDS": "2"})
    assert time.monotonic() - start < 45
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, result.stdout + result.stderr[-3000:]
    kind, message, seconds = json.loads(lines[0][len("RESULT"):])
    assert kind == "RuntimeError"
    assert message.startswith(
        f"torch.distributed could not start process 1 of 2 at tcp://127.0.0.1:{port} "
        "within KTD_TIMEOUT_SECONDS=2 s: "
    ), message
    assert "raise KTD_TIMEOUT_SECONDS" in message
    assert seconds < 20


@pytest.mark.slow
def test_distribution_before_initialize_in_a_multi_process_run():
    """torchrun's environment says 2 processes, but initialize() was not
    called: every entry point says so instead of acting as one process."""
    code = _REPORT_ERRORS + textwrap.dedent("""
    found = {
        "list_devices": error_of(keras.distribution.list_devices),
        "DataParallel": error_of(keras.distribution.DataParallel),
        "mesh": error_of(lambda: keras.distribution.DeviceMesh(
            (2,), ["model"], ["cpu:0", "cpu:1"]).backend_mesh),
    }
    print("RESULT", json.dumps(found))
    """)
    result = _python(code, {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_closed_port()),
    })
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, result.stdout + result.stderr[-3000:]
    for where, found in json.loads(lines[0][len("RESULT"):]).items():
        assert found is not None, f"{where} did not raise"
        kind, message, _ = found
        assert kind == "RuntimeError", (where, found)
        assert "This process is one of WORLD_SIZE=2 processes, but torch.distributed " \
               "is not initialized yet" in message, (where, message)
        assert "Call keras.distribution.initialize() first, on every process." in message


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
    """Collects the package logger's records (it does not propagate)."""

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

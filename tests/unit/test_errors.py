"""Bad input gives a clear error: the offending value, what was expected,
and the fix.

These cases run in the pytest process (a world of one process); the cases
that need several processes, and uneven sharding (not an error: it trains
with one-process numbers), are in multiprocess/test_errors_on_ranks.py.
Errors of starting the process group are in test_runtime.py.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import model_parallel  # noqa: E402


@pytest.fixture
def one_process():
    """A world of one process, no distribution set before or after. The
    group is removed afterwards (with the meshes and replica groups built
    on it) when this fixture started it: later tests in the pytest process
    expect none."""
    import torch.distributed as dist

    from keras_torch_distribution._distributed import layouts
    from keras_torch_distribution._distributed import replicas

    started = not dist.is_initialized()
    keras.distribution.initialize()
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    yield keras.distribution.list_devices()
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    if started and dist.is_initialized():
        dist.destroy_process_group()
        replicas.cache.clear()
        layouts.torch_meshes.clear()


def _dense_model(units=4):
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(units, name="dense")], name="net"
    )


# --------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------


def test_mesh_shape_must_match_its_devices(one_process):
    """A mesh hard-coded for more devices than the job has (keras.io's
    (2, 4) under `ktd run -n 2`) says what it needs and the two fixes, not
    Keras' bare "Shape does not match" (issue 48)."""
    with pytest.raises(
        ValueError,
        match=r"^DeviceMesh\(shape=\(2, 4\), axis_names=\['batch', 'model'\]\) "
        r"needs 8 devices, but was given 1 \(one device per process: this "
        r"job's keras.distribution.list_devices\(\) has 1 device\(s\)\). "
        r"Either run 8 processes \(`ktd run -n 8 ...`, or as many across "
        r"nodes\), or give the mesh a shape whose product is 1, e.g. "
        r"\(1, 1\), from list_devices\(\).$",
    ):
        keras.distribution.DeviceMesh((2, 4), ["batch", "model"], one_process)


def test_unknown_axis_name_in_layout_map(one_process):
    distribution = model_parallel(one_process, {})
    with pytest.raises(
        ValueError,
        match=r"Invalid axis names for Layout. Valid axis "
        r"names: \{'model'\}, Got \{'modle'\}",
    ):
        distribution._layout_map[".*kernel"] = (None, "modle")


def test_unknown_axis_name_in_a_tensor_layout(one_process):
    # A TensorLayout built without a mesh is checked when it meets one.
    from keras_torch_distribution._distributed import layouts

    with pytest.raises(
        ValueError,
        match=r"Layout axes \(None, 'modle'\) name the mesh "
        r"axis 'modle', which the mesh does not have; its axes are "
        r"\['model'\]",
    ):
        layouts.placements_for((None, "modle"), ["model"])


def test_layout_longer_than_variable_rank(one_process):
    keras.distribution.set_distribution(
        model_parallel(one_process, {".*kernel": (None, "model", None)})
    )
    with pytest.raises(
        ValueError,
        match=r"Layout axes \(None, 'model', None\) have 3 "
        r"entries, but variable 'net/dense/kernel' has shape \(3, 4\) "
        r"\(rank 2\). Give the layout one entry \(an axis name or None\) "
        r"per dim, or fewer: a shorter layout lays out the leading dims "
        r"and replicates the rest \(e.g. \(None, 'model'\)\).",
    ):
        _dense_model()


def test_two_layout_map_patterns_matching_one_variable(one_process):
    keras.distribution.set_distribution(
        model_parallel(
            one_process,
            {".*kernel": (None, "model"), ".*dense.*": ("model", None)},
        )
    )
    with pytest.raises(
        ValueError,
        match=r"Path 'net/dense/kernel' matches multiple "
        r"layout specification keys: \['\.\*kernel', '\.\*dense\.\*'\]",
    ):
        _dense_model()


def test_model_parallel_needs_a_layout_map(one_process):
    with pytest.raises(
        ValueError, match="You must specify a layout_map argument."
    ):
        keras.distribution.ModelParallel()


@pytest.mark.parametrize("value", ["nan", "inf", "1e30", "abc", "-5", "0"])
def test_bad_timeout_setting(monkeypatch, value):
    from keras_torch_distribution._processes import runtime

    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", value)
    with pytest.raises(ValueError) as caught:
        runtime.timeout_seconds()
    assert str(caught.value) == (
        f"KTD_TIMEOUT_SECONDS='{value}' is not a positive number of seconds up "
        "to 604800 (one week): it sets how long the rendezvous and each "
        "collective wait for a peer. Set it to a number in (0, 604800], e.g. "
        "300 (the default), or unset it."
    )


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "KTD_LOG_LEVEL",
            "loud",
            r"^KTD_LOG_LEVEL='loud' is not a logging level: set one "
            r"of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        (
            "KTD_DEVICE",
            "tpu",
            r"^KTD_DEVICE='tpu' is not a device choice: set KTD_DEVICE=cpu",
        ),
    ],
)
def test_bad_settings(monkeypatch, variable, value, message):
    from keras_torch_distribution import _env

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        _env.log_level() if variable == "KTD_LOG_LEVEL" else _env.forces_cpu()


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
    keras.distribution.set_distribution(
        model_parallel(one_process, {".*kernel": (None, "model")})
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 4), "float32")
    with _Records() as records:
        model.fit(x, y, verbose=0)
        model.fit(x, y, verbose=0)
    messages = [
        r.getMessage()
        for r in records
        if "created with no distribution" in r.getMessage()
    ]
    assert messages == [
        (
            "Variable 'net/dense/kernel' was created with no distribution set, "
            "so it is whole on every rank, but the current distribution would "
            "shard it with axes (None, 'model'). Create the model after "
            "keras.distribution.set_distribution(...) or inside "
            "distribution.scope()."
        )
    ], messages


def test_a_step_error_that_cannot_cross_processes_is_sent_as_its_text():
    """`agreement.gather` sends each rank's error to the others; one that
    does not survive pickling goes as a RankFailedError with its type and
    text (which does), and the failing rank raises its own."""
    import pickle

    from keras_torch_distribution._distributed import agreement

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("cannot pickle")

    sent = agreement._portable(Unpicklable("disk on fire"))
    assert isinstance(sent, agreement.RankFailedError)
    assert str(sent) == "on rank 0: Unpicklable: disk on fire"
    again = pickle.loads(pickle.dumps(sent))
    assert (type(again), str(again), again.rank) == (
        agreement.RankFailedError,
        str(sent),
        0,
    )
    picklable = ValueError("fine")
    assert agreement._portable(picklable) is picklable

    def fails():
        raise Unpicklable("disk on fire")

    with pytest.raises(Unpicklable):
        agreement.gather(fails)

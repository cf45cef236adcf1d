"""Bad input on several processes gives a clear error: meshes that do not
cover every running process. Uneven sharding is not an error: it trains
with one-process numbers. Both on the session's 2-rank pool.

The single-process cases are in unit/test_errors.py.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import error_of  # noqa: E402
from helpers import model_parallel  # noqa: E402


def mesh_errors():
    """Meshes that do not cover the 2 running processes."""
    devices = keras.distribution.list_devices()
    found = {}
    one = keras.distribution.DeviceMesh((1,), ["model"], devices[:1])
    layout_map = keras.distribution.LayoutMap(one)
    layout_map[".*kernel"] = (None, "model")
    found["model_parallel"] = error_of(
        lambda: keras.distribution.ModelParallel(layout_map=layout_map)
    )
    found["data_parallel"] = error_of(
        lambda: (
            keras.distribution.DataParallel(
                devices=devices[:1]
            ).device_mesh.backend_mesh
        )
    )
    four = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    found["too_many"] = error_of(
        lambda: (
            keras.distribution.DeviceMesh(
                (2, 2), ["batch", "model"], four
            ).backend_mesh
        )
    )
    return found


def test_mesh_must_cover_every_process(pool2):
    for found in pool2.run(mesh_errors):
        for where, shape, count in (
            ("model_parallel", (1,), 1),
            ("data_parallel", (1,), 1),
            ("too_many", (2, 2), 4),
        ):
            assert found[where] is not None, f"{where} did not raise"
            kind, message = found[where]
            assert kind == "ValueError"
            assert message == (
                f"DeviceMesh shape={shape} has {count} devices, but 2 "
                "processes run. The mesh must cover every process, one device "
                "per process: build it from keras.distribution.list_devices() "
                "with a shape whose product is 2."
            ), (where, message)


UNEVEN_RULES = {
    ".*dense/kernel": (None, "model"),
    ".*dense/bias": ("model",),
    ".*out/kernel": ("model", None),
}


def _uneven_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                5, activation="tanh", name="dense"
            ),  # 5 columns on 2 ranks
            keras.layers.Dense(3, name="out"),  # 5 rows on 2 ranks
        ],
        name="uneven",
    )


def uneven_training(distributed):
    if distributed:
        devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(
            model_parallel(devices, UNEVEN_RULES)
        )
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
    return (
        history.history["loss"],
        [np.asarray(w) for w in model.weights],
        local_shapes,
    )


def test_uneven_sharding_trains_with_one_process_numbers(pool2):
    """A dim that its mesh axis does not divide is sharded unevenly (as
    torch.chunk: ceil-sized blocks first, the last one smaller)."""
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    reference_loss, reference_weights, _ = uneven_training(False)
    keras.backend.clear_session()
    results = pool2.run(uneven_training, True)
    expected_shapes = [
        {
            "uneven/dense/kernel": (3, 3),
            "uneven/dense/bias": (3,),
            "uneven/out/kernel": (3, 3),
        },
        {
            "uneven/dense/kernel": (3, 2),
            "uneven/dense/bias": (2,),
            "uneven/out/kernel": (2, 3),
        },
    ]
    for rank, (loss, weights, shapes) in enumerate(results):
        for path, shape in expected_shapes[rank].items():
            assert shapes[path] == shape, (rank, path, shapes[path])
        np.testing.assert_allclose(loss, reference_loss, rtol=1e-5, atol=1e-6)
        for got, want in zip(weights, reference_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

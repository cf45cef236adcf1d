"""Keras files from sharded multi-process models, and back."""

import os

import numpy as np


def _model():
    import keras

    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="col")(inputs)
    outputs = keras.layers.Dense(3, name="row")(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _model_parallel():
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*col/kernel"] = (None, "model")
    layout_map[".*col/bias"] = ("model",)
    layout_map[".*row/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def _data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(32, 6)).astype("float32"), rng.normal(
        size=(32, 3)
    ).astype("float32")


def train_and_save(directory):
    import keras
    from torch.distributed.tensor import DTensor

    _model_parallel()
    model = _model()
    assert isinstance(model.get_layer("col").kernel.value, DTensor)
    x, y = _data()
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "best.keras")),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
    ]
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    # The user's callbacks are not edited on any rank.
    assert callbacks[1].filename == os.path.join(directory, "log.csv")
    model.save(os.path.join(directory, "final.keras"))
    model.save_weights(os.path.join(directory, "final.weights.h5"))
    # Every rank returns only once rank 0's files are complete.
    complete = all(
        os.path.getsize(os.path.join(directory, name)) > 0
        for name in ("best.keras", "final.keras", "final.weights.h5")
    )
    return complete, model.predict(x, verbose=0), sorted(os.listdir(directory))


def test_sharded_model_saves_one_keras_file_that_loads_in_one_process(
    pool2, tmp_path
):
    import keras

    results = pool2.run(train_and_save, str(tmp_path))
    for complete, _, names in results:
        assert complete
        assert names == [
            "best.keras",
            "final.keras",
            "final.weights.h5",
            "log.csv",
        ]
    x, _ = _data()
    loaded = keras.saving.load_model(tmp_path / "final.keras")
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), results[0][1], rtol=1e-5, atol=1e-6
    )
    plain = _model()
    plain.load_weights(tmp_path / "final.weights.h5")
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), results[1][1], rtol=1e-5, atol=1e-6
    )
    lines = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert len(lines) == 4  # a header and 3 epochs, written once
    assert lines[0].startswith("epoch,loss")


def load_into_sharded(path):
    from torch.distributed.tensor import DTensor

    _model_parallel()
    model = _model()
    model.load_weights(path)
    kernel = model.get_layer("col").kernel
    x, _ = _data()
    return (
        isinstance(kernel.value, DTensor),
        tuple(kernel.value.to_local().shape),
        [np.asarray(v) for v in model.weights],
        model.predict(x, verbose=0),
    )


def test_ordinary_keras_file_loads_into_a_sharded_model(pool2, tmp_path):
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "plain.weights.h5")
    model.save_weights(path)
    expected = [np.asarray(v) for v in model.weights]
    for sharded, local_shape, weights, predictions in pool2.run(
        load_into_sharded, path
    ):
        assert sharded and local_shape == (6, 8)
        for got, want in zip(weights, expected):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(
            predictions, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
        )

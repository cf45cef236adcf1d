"""fit / evaluate / predict under DataParallel, ModelParallel and a 2x2 mesh,
compared with one process training on the global batch."""

import numpy as np
import pytest

from helpers import FEATURES
from helpers import OUTPUTS
from helpers import assert_same_training
from helpers import set_distribution

ROWS = 72  # 72 rows, batch 16: a last batch of 8


def _model(optimizer="adam", accumulation=None, **compile_kwargs):
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(OUTPUTS, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    if optimizer == "adam":
        opt = keras.optimizers.Adam(
            0.01, gradient_accumulation_steps=accumulation
        )
    else:
        opt = keras.optimizers.SGD(
            0.05, momentum=0.9, gradient_accumulation_steps=accumulation
        )
    model.compile(
        opt,
        "mse",
        metrics=["mae", keras.metrics.RootMeanSquaredError()],
        **compile_kwargs,
    )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, OUTPUTS)).astype("float32")
    return x, y


def _inputs(kind, x, y, batch_size):
    """(fit args, fit kwargs) for an input kind."""
    import keras
    import torch

    if kind == "numpy":
        return (x, y), {"batch_size": batch_size}
    if kind == "torch":
        return (torch.as_tensor(x), torch.as_tensor(y)), {
            "batch_size": batch_size
        }
    if kind == "dict":
        return ({"features": x}, y), {"batch_size": batch_size}
    if kind == "pydataset":

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return -(-len(x) // batch_size)

            def __getitem__(self, i):
                s = slice(i * batch_size, (i + 1) * batch_size)
                return x[s], y[s]

        return (Batches(),), {}
    raise ValueError(kind)


def train(
    kind,
    optimizer="adam",
    shuffle=False,
    inputs="numpy",
    accumulation=None,
    epochs=2,
    batch_size=16,
    **compile_kwargs,
):
    """Train; return weights, history, evaluate and predict results."""
    import keras

    set_distribution(kind)
    model = _model(optimizer, accumulation, **compile_kwargs)
    x, y = _data()
    args, kwargs = _inputs(inputs, x, y, batch_size)
    history = model.fit(
        *args, epochs=epochs, shuffle=shuffle, verbose=0, **kwargs
    )
    evaluation = model.evaluate(x, y, batch_size=batch_size, verbose=0)
    predictions = model.predict(x, batch_size=batch_size, verbose=0)
    weights = [np.asarray(v) for v in model.weights]
    keras.distribution.set_distribution(None)
    return weights, history.history, evaluation, predictions


def _reference(**kwargs):
    return train(None, **kwargs)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_data_parallel_fit_matches_one_process(pool2, optimizer, shuffle):
    results = pool2.run(train, "dp", optimizer=optimizer, shuffle=shuffle)
    assert_same_training(
        results, _reference(optimizer=optimizer, shuffle=shuffle)
    )


def test_model_parallel_fit_matches_one_process(pool2):
    results = pool2.run(train, "mp", shuffle=True)
    assert_same_training(results, _reference(shuffle=True))


def test_hybrid_2x2_fit_matches_one_process(pool4):
    results = pool4.run(train, "hybrid", shuffle=True)
    assert_same_training(results, _reference(shuffle=True))


@pytest.mark.parametrize("inputs", ["torch", "dict", "pydataset"])
def test_input_kinds_match_one_process(pool2, inputs):
    results = pool2.run(train, "dp", inputs=inputs, epochs=1)
    assert_same_training(results, _reference(inputs=inputs, epochs=1))


def test_gradient_accumulation_matches_one_process(pool2):
    results = pool2.run(
        train, "dp", optimizer="sgd", accumulation=2, batch_size=8
    )
    assert_same_training(
        results, _reference(optimizer="sgd", accumulation=2, batch_size=8)
    )


def several_steps_refused():
    """Keras' error for steps_per_execution=2 on torch, or None where Keras
    runs it (3.16; 3.15 refuses it)."""
    model = _model(steps_per_execution=2)
    try:
        model.make_train_function()
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("kind,jit", [("dp", False), ("mp", True)])
def test_several_steps_per_execution_match_one_process(pool2, kind, jit):
    refusal = several_steps_refused()
    if refusal is not None:
        assert "steps_per_execution" in refusal
        assert pool2.run(several_steps_refused) == [refusal, refusal]
        pytest.skip(f"this Keras refuses it on torch: {refusal}")
    results = pool2.run(
        train, kind, shuffle=True, steps_per_execution=3, jit_compile=jit
    )
    # Keras shuffles differently with steps_per_execution > 1 (measured on
    # 3.16 in one process: epoch 2 differs), so the reference uses it too.
    assert_same_training(
        results, _reference(shuffle=True, steps_per_execution=3)
    )


def indivisible_batch():
    set_distribution("dp")
    model = _model()
    x, y = _data()
    try:
        model.fit(x, y, batch_size=15, verbose=0)
    except ValueError as error:
        return str(error)
    return None


def test_indivisible_global_batch_is_an_error(pool2):
    messages = pool2.run(indivisible_batch)
    for message in messages:
        assert (
            message is not None
            and "batch_size=15 is the global batch" in message
        )
        assert "divisible by the 2 data-parallel replicas" in message


def dataloader_steps():
    """A DataLoader yields per-process batches; replicas take turns."""
    import keras
    import torch

    set_distribution("dp")
    model = _model("sgd")
    x, y = _data()
    dataset = torch.utils.data.TensorDataset(
        torch.as_tensor(x), torch.as_tensor(y)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)  # 9 batches
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    model.fit(loader, epochs=1, verbose=0, callbacks=[Count()])
    return len(seen), [np.asarray(v) for v in model.weights]


def test_dataloader_round_robin_same_steps_everywhere(pool2):
    (steps0, w0), (steps1, w1) = pool2.run(dataloader_steps)
    assert steps0 == steps1 == 4  # 9 batches over 2 replicas: 4 rounds
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


def early_stopping():
    import keras

    set_distribution("dp")
    model = _model()
    x, y = _data()
    stop = keras.callbacks.EarlyStopping(
        monitor="loss", patience=0, min_delta=10.0
    )
    history = model.fit(
        x, y, batch_size=16, epochs=5, verbose=0, callbacks=[stop]
    )
    return len(history.history["loss"])


def test_early_stopping_decides_the_same_on_every_rank(pool2):
    assert pool2.run(early_stopping) == [2, 2]


def train_with_validation(kind, how):
    """fit with validation_data or validation_split; history per epoch."""
    import keras

    set_distribution(kind)
    model = _model()
    x, y = _data()
    if how == "data":
        extra = {"validation_data": (x[:24], y[:24])}
    else:
        extra = {"validation_split": 0.25}
    reduce_lr = keras.callbacks.ReduceLROnPlateau(
        monitor="val_loss", patience=0, factor=0.5
    )
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[reduce_lr],
        **extra,
    )
    keras.distribution.set_distribution(None)
    return history.history, [np.asarray(v) for v in model.weights]


@pytest.mark.parametrize("how", ["data", "split"])
def test_validation_and_reduce_lr_match_one_process(pool2, how):
    ref_history, ref_weights = train_with_validation(None, how)
    for history, weights in pool2.run(train_with_validation, "dp", how):
        assert history.keys() == ref_history.keys()
        assert "val_loss" in history and "learning_rate" in history
        for key in ref_history:
            np.testing.assert_allclose(
                history[key], ref_history[key], rtol=1e-4, atol=2e-5
            )
        for w, r in zip(weights, ref_weights):
            np.testing.assert_allclose(w, r, rtol=1e-4, atol=2e-5)

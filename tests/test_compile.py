"""`model.compile(jit_compile=True)` under DataParallel, ModelParallel and a
2x2 mesh: compiled fit / evaluate / predict on N processes give the numbers
of one eager process on the global batch. Each case reports torch's own
compile counters (graphs, graph breaks, compiled frames; recompiles =
frames - 1, the model's outermost call being one code object)."""

import numpy as np
import pytest

from test_training import FEATURES, OUTPUTS, _assert_same, _set_distribution

ROWS, BATCH = 64, 16  # whole batches only: one compiled shape for fit


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, OUTPUTS)).astype("float32")
    return x, y


def _model(jit_compile):
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(OUTPUTS, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(0.01), "mse", metrics=["mae"], jit_compile=jit_compile
    )
    return model


def compiled_train(kind, jit_compile=True, epochs=2):
    """Train (compiled); weights, history, evaluation, predictions, and
    torch's compile counters for this run."""
    import keras
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _set_distribution(kind)
    model = _model(jit_compile)
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=True, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    weights = [np.asarray(v) for v in model.weights]
    keras.distribution.set_distribution(None)
    report = {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": [r.splitlines()[0] for r in counters["graph_break"]],
        "frames": counters["frames"].get("ok", 0),
    }
    return weights, history.history, evaluation, predictions, report


def _check(results, kind, epochs=2):
    reference = compiled_train(None, jit_compile=False, epochs=epochs)[:4]
    _assert_same([r[:4] for r in results], reference)
    for rank, result in enumerate(results):
        report = result[4]
        print(
            f"{kind} rank {rank}: compiled graphs {report['graphs']}, graph breaks "
            f"{report['graph_breaks']} {report['break_reasons']}, compiled frames "
            f"{report['frames']} (recompiles {max(report['frames'] - 1, 0)})"
        )
        # One graph for training, one for evaluate/predict (no_grad,
        # training=False); the forward never breaks.
        assert report["graph_breaks"] == 0, report
        assert report["graphs"] == 2, report


@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_compiled_fit_matches_eager_one_process(pool2, kind):
    _check(pool2.run(compiled_train, kind), kind)


def test_compiled_hybrid_2x2_matches_eager_one_process(pool4):
    _check(pool4.run(compiled_train, "hybrid", epochs=1), "hybrid", epochs=1)


def _refuses_tracing_op():
    """An identity op whose fake (tracing) implementation raises, as an op
    torch.compile cannot handle would; registered once per process."""
    import torch

    op = getattr(_refuses_tracing_op, "op", None)
    if op is None:

        @torch.library.custom_op("ktd_tests::refuses_tracing", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @op.register_fake
        def _(x):
            raise RuntimeError("this layer cannot be traced (test)")

        op.register_autograd(lambda ctx, grad: grad)
        _refuses_tracing_op.op = op
    return op


def _refuses_compilation(x):
    return _refuses_tracing_op()(x)


def fallback_train():
    """A model whose forward cannot compile trains eagerly, with one
    warning through the package logger."""
    import logging

    import keras

    from keras_torch_distribution.log import logger

    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture()
    logger.addHandler(handler)
    try:
        _set_distribution("dp")
        keras.utils.set_random_seed(7)
        inputs = keras.Input((FEATURES,), name="features")
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        hidden = keras.layers.Lambda(_refuses_compilation, name="refuses")(hidden)
        outputs = keras.layers.Dense(OUTPUTS, name="out")(hidden)
        model = keras.Model(inputs, outputs, name="uncompilable")
        model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
        x, y = _data()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0)
        weights = [np.asarray(v) for v in model.weights]
        keras.distribution.set_distribution(None)
    finally:
        logger.removeHandler(handler)
    return weights, history.history, records


def test_uncompilable_forward_falls_back_with_one_warning(pool2):
    import keras

    results = pool2.run(fallback_train)
    keras.utils.set_random_seed(7)
    reference = compiled_train(None, jit_compile=False)  # same weights, no Lambda
    (w0, h0, records0), (w1, h1, _) = results
    warnings = [r for r in records0 if "jit_compile=True" in r]
    assert len(warnings) == 1, records0
    assert "'uncompilable'" in warnings[0] and "runs eagerly" in warnings[0]
    assert "cannot be traced (test)" in warnings[0]
    for w, r in zip(w0, reference[0]):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=2e-5)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)

"""`model.compile(jit_compile=True)` under DataParallel, ModelParallel and a
2x2 mesh: compiled fit / evaluate / predict on N processes give the numbers
of one eager process on the global batch. Each case reports torch's own
compile counters (graphs, graph breaks, compiled frames; recompiles =
frames - 1, the model's outermost call being one code object)."""

import numpy as np
import pytest

from helpers import FEATURES
from helpers import OUTPUTS
from helpers import assert_same_training
from helpers import set_distribution

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
        keras.optimizers.Adam(0.01),
        "mse",
        metrics=["mae"],
        jit_compile=jit_compile,
    )
    return model


def compiled_train(kind, jit_compile=True, epochs=2, prebuilt=False):
    """Train (compiled); weights, history, evaluation, predictions, and
    torch's compile counters for this run. `prebuilt`: the step functions
    are made by user code before fit, as a custom loop would."""
    import keras
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    set_distribution(kind)
    model = _model(jit_compile)
    x, y = _data()
    prebuilt_steps = None
    if prebuilt:
        model.make_train_function()
        model.make_test_function()
        model.make_predict_function()
        prebuilt_steps = [
            getattr(f, "_ktd_compiled_forward", False)
            for f in (
                model.train_function,
                model.test_function,
                model.predict_function,
            )
        ]
    history = model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=True, verbose=0
    )
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    weights = [np.asarray(v) for v in model.weights]
    keras.distribution.set_distribution(None)
    report = dict(_compile_counters(), prebuilt_steps=prebuilt_steps)
    return weights, history.history, evaluation, predictions, report


def _compile_counters():
    """torch's own counts for this process since `counters.clear()`."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": [r.splitlines()[0] for r in counters["graph_break"]],
        "frames": counters["frames"].get("ok", 0),
    }


def _check(results, kind, epochs=2):
    reference = compiled_train(None, jit_compile=False, epochs=epochs)[:4]
    assert_same_training([r[:4] for r in results], reference)
    for rank, result in enumerate(results):
        report = result[4]
        print(
            f"{kind} rank {rank}: compiled graphs {report['graphs']}, graph "
            f"breaks {report['graph_breaks']} {report['break_reasons']}, "
            f"compiled frames {report['frames']} (recompiles "
            f"{max(report['frames'] - 1, 0)})"
        )
        # One graph for training, one for evaluate/predict (no_grad,
        # training=False), one for Adam's update (one kernel for every
        # variable: 1-D, dynamic size); nothing breaks.
        assert report["graph_breaks"] == 0, report
        assert report["graphs"] == 3, report


@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_compiled_fit_matches_eager_one_process(pool2, kind):
    _check(pool2.run(compiled_train, kind), kind)


def test_step_functions_made_before_fit_compile_the_forward_only(pool2):
    """`make_train_function()` (and test / predict) called by user code
    before fit build the package's step functions, not Keras' whole-step
    torch.compile (which cannot run under a distribution)."""
    results = pool2.run(compiled_train, "dp", prebuilt=True)
    for result in results:
        assert result[4]["prebuilt_steps"] == [True, True, True], result[4]
    _check(results, "dp prebuilt")


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

    from keras_torch_distribution._log import logger

    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture()
    logger.addHandler(handler)
    try:
        set_distribution("dp")
        keras.utils.set_random_seed(7)
        inputs = keras.Input((FEATURES,), name="features")
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(
            inputs
        )
        hidden = keras.layers.Lambda(_refuses_compilation, name="refuses")(
            hidden
        )
        outputs = keras.layers.Dense(OUTPUTS, name="out")(hidden)
        model = keras.Model(inputs, outputs, name="uncompilable")
        model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
        x, y = _data()
        history = model.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0
        )
        weights = [np.asarray(v) for v in model.weights]
        keras.distribution.set_distribution(None)
    finally:
        logger.removeHandler(handler)
    return weights, history.history, records


def test_uncompilable_forward_falls_back_with_one_warning(pool2):
    import keras

    results = pool2.run(fallback_train)
    keras.utils.set_random_seed(7)
    reference = compiled_train(
        None, jit_compile=False
    )  # same weights, no Lambda
    (w0, h0, records0), (w1, h1, _) = results
    warnings = [r for r in records0 if "jit_compile=True" in r]
    assert len(warnings) == 1, records0
    assert "'uncompilable'" in warnings[0] and "runs eagerly" in warnings[0]
    assert "cannot be traced (test)" in warnings[0]
    for w, r in zip(w0, reference[0]):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=2e-5)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


SEQ, WIDTH, HEADS = 6, 8, 2


def compiled_attention_train(sharded, jit_compile=True, causal=False):
    """A block of self-attention sharded on heads (query/key/value kernels
    on their heads dim, the output projection on its input heads) +
    residual + LayerNorm + Dense under ModelParallel on a ("model",) mesh
    (`sharded`), or one eager process; weights, history, predictions and
    torch's compile counters."""
    import keras
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if sharded:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (len(devices),), ["model"], devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        for name in ("query", "key", "value"):
            layout_map[f"mha/{name}/kernel"] = (None, "model", None)
            layout_map[f"mha/{name}/bias"] = ("model", None)
        layout_map["mha/attention_output/kernel"] = ("model", None, None)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ, WIDTH))
    attention = keras.layers.MultiHeadAttention(
        HEADS, WIDTH // HEADS, name="mha"
    )(inputs, inputs, use_causal_mask=causal)
    hidden = keras.layers.LayerNormalization(name="norm")(inputs + attention)
    outputs = keras.layers.Dense(WIDTH, name="proj")(hidden)
    model = keras.Model(inputs, outputs)
    # SGD: the key bias's gradient is zero in exact arithmetic (softmax
    # ignores a per-query constant), rounding noise that Adam would amplify.
    model.compile(
        keras.optimizers.SGD(0.05, momentum=0.9), "mse", jit_compile=jit_compile
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, SEQ, WIDTH)).astype("float32")
    y = rng.normal(size=(ROWS, SEQ, WIDTH)).astype("float32")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    query_kernel = model.get_layer("mha").query_dense.kernel.value
    local_query_kernel = (
        tuple(query_kernel.to_local().shape) if sharded else None
    )
    weights = [np.asarray(v) for v in model.weights]
    keras.distribution.set_distribution(None)
    return (
        weights,
        history.history,
        predictions,
        local_query_kernel,
        _compile_counters(),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_heads_sharded_attention_matches_eager_one_process(
    pool2, causal
):
    """Attention sharded on heads compiles into one graph per mode (no
    eager fallback, no graph break) and trains to one eager process's
    numbers. (Causal attention calls torch's fused CPU kernel, which had no
    DTensor rule: NotImplementedError before sharding_rules registered it.)"""
    ref_weights, ref_history, ref_predictions, _, _ = compiled_attention_train(
        False, jit_compile=False, causal=causal
    )
    for rank, (weights, history, predictions, local_query, report) in enumerate(
        pool2.run(compiled_attention_train, True, causal=causal)
    ):
        assert local_query == (WIDTH, HEADS // 2, WIDTH // HEADS), rank
        assert report["graph_breaks"] == 0, report
        assert report["graphs"] == 2, report
        for w, r in zip(weights, ref_weights):
            np.testing.assert_allclose(
                w, r, rtol=1e-4, atol=2e-5, err_msg=f"rank {rank}"
            )
        for key in ref_history:
            np.testing.assert_allclose(
                history[key], ref_history[key], rtol=1e-4
            )
        np.testing.assert_allclose(
            predictions, ref_predictions, rtol=1e-4, atol=2e-5
        )


def overlap_under_jit_compile(jit_compile):
    """Under DataParallel: whether each step's gradients were averaged by
    the all-reduces the gradient hooks started during backward (one entry
    per step), and whether Keras wrapped the model in DDP."""
    from keras_torch_distribution._training import overlap
    from keras_torch_distribution._variables import born_sharded

    averaged_in_backward = []
    finish = overlap.OverlappedReducer.finish

    def recording_finish(self, grads):
        used = finish(self, grads)
        averaged_in_backward.append(used)
        return used

    overlap.OverlappedReducer.finish = recording_finish
    # As in a process that never made a sharded variable (earlier tests on
    # this pool did; the overlap is for pure data parallelism).
    sharded_exist = born_sharded.state.sharded_exist
    born_sharded.state.sharded_exist = False
    try:
        set_distribution("dp")
        model = _model(jit_compile)
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    finally:
        overlap.OverlappedReducer.finish = finish
        born_sharded.state.sharded_exist = sharded_exist
    return averaged_in_backward, getattr(model, "ddp_model", None) is None


@pytest.mark.parametrize("jit_compile", [False, True])
def test_gradients_average_during_backward_also_when_compiled(
    pool2, jit_compile
):
    # Keras 3.16's torch train_step takes gradients with autograd.grad
    # under jit_compile, which fires no gradient hook; the package's
    # compiled step makes it call backward(), as 3.15's always does.
    for averaged_in_backward, no_ddp in pool2.run(
        overlap_under_jit_compile, jit_compile
    ):
        # The first step makes the hooks (after its backward).
        steps = ROWS // BATCH
        assert averaged_in_backward == [False] + [True] * (steps - 1)
        assert no_ddp

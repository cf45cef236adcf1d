"""ModelParallel on 2 and 4 gloo processes against one process.

Each case builds the same model with the same seed once without a
distribution (in the pytest process) and once under ModelParallel on the
session pool's ranks, then compares initial weights (bit for bit), forward
outputs, losses, gradients (sharded ones gathered with `full_tensor`),
weights after optimizer steps (`optimizer.apply` and `model.fit`), and
checks shard shapes and per-rank bytes.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from keras_torch_distribution import variables as ktd_variables  # noqa: E402

RTOL = ATOL = 1e-5
STEPS = 3

# ---------------------------------------------------------------------------
# Models and their layout maps. Layout rules name mesh axes "model" (and
# "batch" on 2-D meshes).
# ---------------------------------------------------------------------------


def _mlp():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(12, activation="relu", name="col"),
            keras.layers.Dense(4, name="row"),
        ],
        name="mlp",
    )


MLP_RULES = {
    r".*col/kernel": (None, "model"),
    r".*col/bias": ("model",),
    r".*row/kernel": ("model", None),
}


def _conv():
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(8, 3, activation="relu", name="conv1"),
            keras.layers.Conv2D(6, 3, padding="same", name="conv2"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, name="head"),
        ],
        name="convnet",
    )


CONV_RULES = {
    r".*conv1/kernel": (None, None, None, "model"),
    r".*conv1/bias": ("model",),
    r".*conv2/kernel": (None, None, "model", None),
}


class SquareNorm(keras.layers.Layer):
    """An RMS-style norm written by hand: uses its input twice."""

    def build(self, input_shape):
        self.scale = self.add_weight(
            shape=(input_shape[-1],), initializer="ones", name="scale"
        )

    def call(self, x):
        ms = keras.ops.mean(x * x, axis=-1, keepdims=True)
        return x * keras.ops.rsqrt(ms + 1e-6) * self.scale


VOCAB, SEQ, DIM, HEADS = 20, 5, 8, 2


def _transformer():
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    ln = keras.layers.LayerNormalization(name="ln")(x)
    rms = keras.layers.RMSNormalization(name="rms")(x)
    sq = SquareNorm(name="sq")(x)
    h = ln + rms + sq
    att = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="mha")(h, h)
    h = h + att
    ff = keras.layers.EinsumDense(
        "abc,cd->abd", output_shape=(None, 16), bias_axes="d", name="ff_in"
    )(h)
    ff = keras.layers.EinsumDense("abd,dc->abc", output_shape=(None, DIM), name="ff_out")(
        keras.ops.gelu(ff)
    )
    logits = keras.layers.Dense(VOCAB, name="logits")(h + ff)
    return keras.Model(tokens, logits, name="transformer")


TRANSFORMER_RULES = {
    r".*embed/embeddings": ("model", None),
    r".*mha/(query|key|value)/kernel": (None, "model", None),
    r".*mha/(query|key|value)/bias": ("model", None),
    r".*mha/attention_output/kernel": ("model", None, None),
    r".*ff_in/kernel": (None, "model"),
    r".*ff_in/bias": ("model",),
    r".*ff_out/kernel": ("model", None),
}


def _batchnorm():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(12, name="col"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.Dense(4, name="row"),
        ],
        name="bnnet",
    )


BN_RULES = dict(
    MLP_RULES,
    **{r".*bn/(gamma|beta|moving_mean|moving_variance)": ("model",)},
)


def _dropout():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(12, activation="relu", name="col"),
            keras.layers.Dropout(0.5, seed=3, name="drop"),
            keras.layers.Dense(4, name="row"),
        ],
        name="dropnet",
    )


def _data(case, rows=8):
    rng = np.random.default_rng(0)
    if case == "conv":
        x = rng.normal(size=(rows, 6, 6, 3)).astype("float32")
        y = rng.normal(size=(rows, 3)).astype("float32")
    elif case == "transformer":
        x = rng.integers(0, VOCAB, size=(rows, SEQ)).astype("int32")
        y = rng.integers(0, VOCAB, size=(rows, SEQ)).astype("int32")
    else:
        x = rng.normal(size=(rows, 8)).astype("float32")
        y = rng.normal(size=(rows, 4)).astype("float32")
    return x, y


CASES = {
    "mlp": (_mlp, MLP_RULES),
    "conv": (_conv, CONV_RULES),
    "transformer": (_transformer, TRANSFORMER_RULES),
    "batchnorm": (_batchnorm, BN_RULES),
    "dropout": (_dropout, MLP_RULES),
}


def _loss_fn(case):
    if case == "transformer":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


def _set_distribution(rules, mesh):
    """mesh: None (one process), "1d" (("model",) over every rank) or
    "2x2" (("batch", "model"))."""
    if mesh is None:
        return
    devices = keras.distribution.list_devices()
    if mesh == "1d":
        keras_mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
        batch = "model"
    else:
        keras_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
        batch = "batch"
    layout_map = keras.distribution.LayoutMap(keras_mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=batch)
    )


def _build(case, mesh, seed=1):
    keras.utils.set_random_seed(seed)
    make, rules = CASES[case]
    _set_distribution(rules, mesh)
    return make()


def _global(value):
    value = value.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.cpu().numpy()


def _weights(model):
    return {v.path: np.asarray(v) for v in model.weights}


def _grads(model, x, y, case, training=True):
    """Forward, loss, and the gradients of every trainable variable."""
    model.zero_grad()
    out = model(x, training=training)
    loss = _loss_fn(case)(y, out)
    loss.backward()
    grads = {v.path: _global(v.value.grad) for v in model.trainable_variables}
    return _global(out), float(loss.detach()), grads


def _train_apply(model, x, y, case, optimizer):
    trainable = model.trainable_variables
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        loss = _loss_fn(case)(y, model(x, training=True))
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in trainable], trainable)
        losses.append(float(loss.detach()))
    return losses


def _shards(model):
    """path -> (global shape, local shape, placements text, local bytes)."""
    out = {}
    for v in model.weights:
        value = v._value
        local = value.to_local() if isinstance(value, DTensor) else value
        out[v.path] = (
            tuple(v.shape),
            tuple(local.shape),
            str(tuple(value.placements)) if isinstance(value, DTensor) else None,
            ktd_variables.local_bytes(v),
        )
    return out


def numbers(case, mesh, training=True):
    """Everything the comparison needs, from one process or from each rank."""
    x, y = _data(case)
    result = {}
    model = _build(case, mesh)
    result["init"] = _weights(model)
    result["shards"] = _shards(model)
    result["out"], result["loss"], result["grads"] = _grads(
        model, x, y, case, training
    )
    eval_out = model(x, training=False)
    result["eval_out"] = _global(eval_out)
    result["eval_is_plain"] = not isinstance(eval_out, DTensor)
    for name, make_optimizer in (
        ("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
        ("adam", lambda: keras.optimizers.Adam(0.01)),
    ):
        keras.backend.clear_session()
        keras.distribution.set_distribution(None)
        model = _build(case, mesh)
        optimizer = make_optimizer()
        result[f"{name}_losses"] = _train_apply(model, x, y, case, optimizer)
        result[f"{name}_weights"] = _weights(model)
        result[f"{name}_slots"] = {
            v.path: (ktd_variables.local_bytes(v), np.asarray(v))
            for v in optimizer.variables
        }
        result[f"{name}_iterations_grad"] = optimizer.iterations._value.requires_grad
    keras.backend.clear_session()
    keras.distribution.set_distribution(None)
    model = _build(case, mesh)
    model.compile(keras.optimizers.Adam(0.01), _loss_fn(case))
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    result["fit_loss"] = history.history["loss"]
    result["fit_weights"] = _weights(model)
    return result


def _reference(case, training=True):
    keras.backend.clear_session()
    keras.distribution.set_distribution(None)
    try:
        return numbers(case, None, training)
    finally:
        keras.backend.clear_session()


def _close(got, want, what, rtol=RTOL, atol=ATOL):
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), what
        for key in want:
            _close(got[key], want[key], f"{what}[{key}]", rtol, atol)
        return
    np.testing.assert_allclose(
        np.asarray(got, dtype="float64"),
        np.asarray(want, dtype="float64"),
        rtol=rtol,
        atol=atol,
        err_msg=what,
    )


def _check_against(reference, results, rules_sharded):
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        for path, value in reference["init"].items():
            assert np.array_equal(got["init"][path], value), f"{where} init {path}"
        _close(got["out"], reference["out"], f"{where} out")
        _close(got["eval_out"], reference["eval_out"], f"{where} eval_out")
        assert got["eval_is_plain"]
        _close(got["loss"], reference["loss"], f"{where} loss")
        _close(got["grads"], reference["grads"], f"{where} grads")
        for name in ("sgd", "adam"):
            _close(got[f"{name}_losses"], reference[f"{name}_losses"], f"{where} {name} losses")
            _close(got[f"{name}_weights"], reference[f"{name}_weights"], f"{where} {name} weights")
            _close(
                {k: v[1] for k, v in got[f"{name}_slots"].items()},
                {k: v[1] for k, v in reference[f"{name}_slots"].items()},
                f"{where} {name} slots",
            )
            assert got[f"{name}_iterations_grad"] is False
        _close(got["fit_loss"], reference["fit_loss"], f"{where} fit loss")
        _close(got["fit_weights"], reference["fit_weights"], f"{where} fit weights")
        # Shards: the variables the rules name are split, the rest whole.
        for path, (shape, local, placements, nbytes) in got["shards"].items():
            full_bytes = reference["shards"][path][3]
            if rules_sharded(path):
                assert placements is not None, f"{where} {path} is not sharded"
                assert local != shape, f"{where} {path}"
                assert nbytes < full_bytes, f"{where} {path}"
            else:
                assert placements is None, f"{where} {path} is sharded: {placements}"
                assert nbytes == full_bytes


def _sharded_by(rules):
    import re

    return lambda path: any(re.search(p, path) for p in rules)


CONV_XFAIL = pytest.mark.xfail(
    strict=True,
    reason=(
        "torch 2.13 DTensor's aten.convolution prop rule (torch/distributed/"
        "tensor/_ops/_conv_ops.py convolution_rules) ignores the weight's "
        "placements: a kernel sharded on output channels gives an output "
        "labelled Replicate whose local tensor has only the local channels "
        "(then 'size of tensor a (2) must match ... (4)' at the bias add), and "
        "convolution_backward labels grad_weight Partial/replicated. Needs a "
        "package-level DTensor handler for aten.convolution(/_backward) with "
        "sharded weights (new module installed by _keras_compat.install)."
    ),
)


@pytest.mark.parametrize(
    "case",
    ["mlp", pytest.param("conv", marks=CONV_XFAIL), "transformer", "batchnorm"],
)
def test_matches_one_process_on_2_ranks(pool2, case):
    reference = _reference(case)
    results = pool2.run(numbers, case, "1d")
    _check_against(reference, results, _sharded_by(CASES[case][1]))

"""Tensor-parallel layouts on a (2, 2) mesh (batch x model), where each
batch replica computes on its own rows: Dense layers column- or
row-parallel in every order, with a ReLU between them, FSDP-style kernels
(the batch axis in the kernel layout too), a layer output relayouted, and
DataParallel, each trained against one process on the global batch from
the same weights and data.

The first case is a bug this module was written for: two column-parallel
Dense layers with a ReLU between them gave the first layer a wrong
gradient (0.33 off after one SGD step at learning rate 1) while the
predictions were right. The activations' DTensors held the batch axis,
where they claimed to be replicated; torch's sharding propagation chose to
shard the ReLU's backward on it and then reduced the bias gradient over
it, mixing the replicas' rows. Layers now compute on the mesh of the
other axes (`layouts.compute_layout`).

CI time: one pool call trains every case.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import helpers  # noqa: E402

ROWS, BATCH = 16, 8
TOL = dict(rtol=1e-5, atol=1e-5)
COLUMN, ROW = (None, "model"), ("model", None)
# Each case: LayoutMap keys and their axes (None: DataParallel).
CASES = {
    "column_column": {
        "a/kernel": COLUMN,
        "a/bias": ("model",),
        "b/kernel": COLUMN,
        "b/bias": ("model",),
    },
    "column_column_row": {
        "a/kernel": COLUMN,
        "b/kernel": COLUMN,
        "c/kernel": ROW,
    },
    "row_row": {"a/kernel": ROW, "b/kernel": ROW, "c/kernel": ROW},
    "fsdp_column_column_row": {
        "a/kernel": ("batch", "model"),
        "a/bias": ("model",),
        "b/kernel": ("batch", "model"),
        "c/kernel": ("model", "batch"),
    },
    # A row-parallel layer's partial sums relayouted to its output layout
    # (sharded on the model axis; its batch axis is the replicas' rows).
    "row_output_column": {
        "a/kernel": ROW,
        "a/output": ("batch", "model"),
        "b/kernel": COLUMN,
    },
    "data_parallel": None,
}


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="a")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="b")(x)
    outputs = keras.layers.Dense(4, name="c")(x)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(ROWS, 6)).astype("float32"),
        rng.normal(size=(ROWS, 4)).astype("float32"),
    )


def _distribute(rules):
    if rules is None:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        return
    keras.distribution.set_distribution(
        helpers.model_parallel(
            keras.distribution.list_devices(),
            rules,
            (2, 2),
            ("batch", "model"),
            batch_dim_name="batch",
        )
    )


def _train():
    """Two SGD steps (global batch of 8 rows): the weights."""
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {v.path: np.asarray(v, "float32") for v in model.weights}


def train_cases(names, distributed=True):
    """The weights of each case of `names` trained under its layouts (one
    process: `distributed=False`), or ("error", message, traceback)."""

    def run(name):
        if distributed:
            _distribute(CASES[name])
        return _train()

    return helpers.each_case(names, run)


def test_layouts_on_2x2_give_one_process_weights(pool4):
    reference = train_cases(["data_parallel"], distributed=False)
    reference = reference["data_parallel"]
    per_rank = pool4.run(train_cases, list(CASES))
    failures = []
    for name in CASES:
        for rank, results in enumerate(per_rank):
            result = results[name]
            if isinstance(result, tuple):
                failures.append(f"{name}, rank {rank}: {result[2]}")
                break
            wrong = [
                f"{path} (off by {np.max(np.abs(result[path] - w)):.3g})"
                for path, w in reference.items()
                if not np.allclose(result[path], w, **TOL)
            ]
            if wrong:
                failures.append(f"{name}, rank {rank}: {', '.join(wrong)}")
                break
    assert not failures, "\n".join(failures)

"""The batch axis is always data (issue 11), on 2 and 4 gloo processes.

Along the mesh's batch axis every coordinate holds its own rows of the
global batch, also when the layout map shards variables on that axis
(ModelParallel on a 1-D ("model",) mesh, whose batch axis is its one axis;
Gemma-style maps that shard weights on both axes of a ("batch", "model")
mesh). Those variables are FSDP: stored 1/N per rank with their optimizer
slots, gathered for use. Every case is compared with one process training
on the global batch (the concatenation of the per-process pieces).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

GLOBAL_BATCH = 16
ROWS = 64
TOL = dict(rtol=2e-5, atol=2e-5)

# A Megatron MLP map on a 1-D mesh: its one axis is also the batch axis.
RULES_1D = {
    r".*up/kernel": (None, "model"),
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", None),
}
# Weights on both axes of a ("batch", "model") mesh, as keras_hub's Gemma map.
RULES_2X2 = {
    r".*up/kernel": ("batch", "model"),
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", "batch"),
}


class RowProbe(keras.layers.Layer):
    """Identity that records how many rows each eager call sees."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rows = []

    def call(self, x):
        if not isinstance(x, keras.KerasTensor) and str(x.device) != "meta":
            self.rows.append(int(x.shape[0]))
        return x


def _model(seed=1, jit_compile=False, dtype_policy=None):
    keras.utils.set_random_seed(seed)
    if dtype_policy:
        keras.config.set_dtype_policy(dtype_policy)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            RowProbe(name="probe"),
            keras.layers.Dense(16, activation="relu", name="up"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(6, name="down"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        metrics=["mae"],
        jit_compile=jit_compile,
    )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = rng.normal(size=(ROWS, 6)).astype("float32")
    return x, y


def _pieces(array, replica, replicas):
    """A replica's rows of every global batch (what it feeds itself)."""
    per = GLOBAL_BATCH // replicas
    batches = array.reshape((-1, GLOBAL_BATCH) + array.shape[1:])
    return batches[:, replica * per : (replica + 1) * per].reshape(
        (-1,) + array.shape[1:]
    )


def _set_model_parallel(mesh_shape, rules, auto_shard):
    devices = keras.distribution.list_devices()
    if len(mesh_shape) == 1:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["model"], devices)
    else:
        mesh = keras.distribution.DeviceMesh(
            mesh_shape, ["batch", "model"], devices
        )
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, auto_shard_dataset=auto_shard
    )
    keras.distribution.set_distribution(distribution)
    return distribution


def _replica_of(distribution):
    mesh = distribution.device_mesh
    axis = list(mesh.axis_names).index(distribution.batch_dim_name)
    rank = torch.distributed.get_rank()
    position = np.argwhere(
        np.vectorize(lambda d: int(str(d).split(":")[1]))(mesh.devices) == rank
    )[0]
    return int(position[axis]), int(mesh.shape[axis])


def _shard_report(model):
    """path -> (global shape, local shape) of every sharded variable, model
    and optimizer."""
    report = {}
    for v in list(model.weights) + list(model.optimizer.variables):
        value = v._value
        if isinstance(value, DTensor):
            report[v.path] = (tuple(v.shape), tuple(value.to_local().shape))
    return report


def _run(
    mesh_shape=None, rules=None, auto_shard=True, epochs=2, **model_kwargs
):
    """Train, evaluate and predict; one process when mesh_shape is None."""
    x, y = _data()
    feed_x, feed_y, batch = x, y, GLOBAL_BATCH
    if mesh_shape is not None:
        distribution = _set_model_parallel(mesh_shape, rules, auto_shard)
        if not auto_shard:
            replica, replicas = _replica_of(distribution)
            feed_x, feed_y = (
                _pieces(x, replica, replicas),
                _pieces(y, replica, replicas),
            )
            batch = GLOBAL_BATCH // replicas
    try:
        model = _model(**model_kwargs)
        history = model.fit(
            feed_x,
            feed_y,
            batch_size=batch,
            epochs=epochs,
            shuffle=False,
            verbose=0,
        )
        fit_rows = list(model.get_layer("probe").rows)
        evaluation = model.evaluate(feed_x, feed_y, batch_size=batch, verbose=0)
        predictions = model.predict(feed_x, batch_size=batch, verbose=0)
        return dict(
            loss=history.history["loss"],
            mae=history.history["mae"],
            evaluation=evaluation,
            predictions=np.asarray(predictions, dtype="float32"),
            weights={
                v.path: np.asarray(v).astype("float32") for v in model.weights
            },
            slots={
                v.path.split("/", 1)[1]: np.asarray(v).astype("float32")
                for v in model.optimizer.variables
                if "iteration" not in v.path
            },
            fit_rows=fit_rows,
            shards=_shard_report(model),
        )
    finally:
        keras.config.set_dtype_policy("float32")


def _dp_then_mp():
    """DataParallel, then ModelParallel on a 1-D mesh, in one process."""
    x, y = _data()
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    model = _model()
    dp = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0
    )
    dp_weights = {v.path: np.asarray(v) for v in model.weights}
    mp = _run((len(devices),), RULES_1D, epochs=1)
    return dict(dp_loss=dp.history["loss"], dp_weights=dp_weights, mp=mp)


_reference_cache = {}


def _reference(**kwargs):
    key = tuple(sorted(kwargs.items()))
    if key not in _reference_cache:
        keras.backend.clear_session()
        _reference_cache[key] = _run(**kwargs)
    return _reference_cache[key]


def _assert_matches(result, reference, predictions_in_order=True):
    np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
    np.testing.assert_allclose(result["mae"], reference["mae"], **TOL)
    np.testing.assert_allclose(
        result["evaluation"], reference["evaluation"], **TOL
    )
    for path, value in reference["weights"].items():
        np.testing.assert_allclose(
            result["weights"][path], value, err_msg=path, **TOL
        )
    for path, value in reference["slots"].items():
        np.testing.assert_allclose(
            result["slots"][path], value, err_msg=path, **TOL
        )
    if predictions_in_order:
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], **TOL
        )


def _assert_ranks_agree(results):
    first = results[0]
    for other in results[1:]:
        for path, value in first["weights"].items():
            np.testing.assert_array_equal(
                other["weights"][path], value, err_msg=path
            )
        np.testing.assert_array_equal(other["loss"], first["loss"])
        np.testing.assert_array_equal(
            other["predictions"], first["predictions"]
        )


@pytest.mark.parametrize(
    "auto_shard", [True, False], ids=["auto-shard", "per-process"]
)
def test_1d_model_mesh_is_data_parallel_with_fsdp(pool2, auto_shard):
    results = pool2.run(_run, (2,), RULES_1D, auto_shard)
    reference = _reference()
    _assert_ranks_agree(results)
    for result in results:
        # Per-process input is each replica's rows of every global batch:
        # its predictions come back in replica order within each batch.
        _assert_matches(result, reference, predictions_in_order=auto_shard)
        # Each process computes on its half of every global batch.
        assert set(result["fit_rows"]) == {GLOBAL_BATCH // 2}, result[
            "fit_rows"
        ]
        # FSDP: the kernel and its Adam slots are stored 1/2 per rank.
        assert result["shards"]["mlp/up/kernel"] == ((8, 16), (8, 8))
        assert result["shards"]["mlp/down/kernel"] == ((16, 6), (8, 6))
        slots = [
            p
            for p in result["shards"]
            if p.startswith("adam/") and "up_kernel" in p
        ]
        assert slots and all(
            result["shards"][p] == ((8, 16), (8, 8)) for p in slots
        )
    if not auto_shard:
        predictions = np.concatenate(
            [
                _pieces(reference["predictions"], 0, 2).reshape(
                    -1, GLOBAL_BATCH // 2, 6
                ),
                _pieces(reference["predictions"], 1, 2).reshape(
                    -1, GLOBAL_BATCH // 2, 6
                ),
            ],
            axis=1,
        ).reshape(-1, 6)
        np.testing.assert_allclose(
            results[0]["predictions"], predictions, **TOL
        )


def test_per_process_feeding_with_mixed_precision(pool2):
    results = pool2.run(
        _run, (2,), RULES_1D, False, dtype_policy="mixed_bfloat16"
    )
    reference = _reference(dtype_policy="mixed_bfloat16")
    _assert_ranks_agree(results)
    tol = dict(rtol=2e-2, atol=2e-2)  # bfloat16 compute
    for path, value in reference["weights"].items():
        np.testing.assert_allclose(
            results[0]["weights"][path], value, err_msg=path, **tol
        )
    np.testing.assert_allclose(results[0]["loss"], reference["loss"], **tol)


def test_per_process_feeding_with_jit_compile(pool2):
    results = pool2.run(
        _run, (2,), RULES_1D, False, jit_compile=True, timeout=600
    )
    reference = _reference()
    _assert_ranks_agree(results)
    _assert_matches(results[0], reference, predictions_in_order=False)


def test_data_parallel_then_model_parallel_in_one_process(pool2):
    results = pool2.run(_dp_then_mp)
    one_epoch = _reference(epochs=1)
    for result in results:
        np.testing.assert_allclose(result["dp_loss"], one_epoch["loss"], **TOL)
        for path, value in one_epoch["weights"].items():
            np.testing.assert_allclose(
                result["dp_weights"][path], value, err_msg=path, **TOL
            )
        _assert_matches(result["mp"], one_epoch)
        assert set(result["mp"]["fit_rows"]) == {GLOBAL_BATCH // 2}


@pytest.mark.slow
@pytest.mark.parametrize(
    "auto_shard", [True, False], ids=["auto-shard", "per-process"]
)
def test_2x2_mesh_with_weights_on_both_axes(pool4, auto_shard):
    results = pool4.run(_run, (2, 2), RULES_2X2, auto_shard)
    reference = _reference()
    _assert_ranks_agree(results)
    for result in results:
        _assert_matches(result, reference, predictions_in_order=auto_shard)
        # 2 replicas on the batch axis: each process sees half of each batch.
        assert set(result["fit_rows"]) == {GLOBAL_BATCH // 2}, result[
            "fit_rows"
        ]
        # Sharded on both axes: a quarter of each kernel per rank.
        assert result["shards"]["mlp/up/kernel"] == ((8, 16), (4, 8))
        assert result["shards"]["mlp/down/kernel"] == ((16, 6), (8, 3))


def _partial_batches_then_per_process(per_process):
    """A fit whose last training and validation batches are partial (13 and
    11 rows: uneven over 2 replicas), then train_on_batch, then a fit on
    per-process pieces (or, in one process, on the global batches)."""
    x, y = _data()
    if per_process:
        devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
    model = _model()
    model.fit(
        x[:61],
        y[:61],
        batch_size=GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=(x[:11], y[:11]),
    )
    model.train_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
    after_train_on_batch = {v.path: np.asarray(v) for v in model.weights}
    feed_x, feed_y, batch = x, y, GLOBAL_BATCH
    if per_process:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(
                devices=devices, auto_shard_dataset=False
            )
        )
        rank = torch.distributed.get_rank()
        feed_x, feed_y, batch = (
            _pieces(x, rank, 2),
            _pieces(y, rank, 2),
            GLOBAL_BATCH // 2,
        )
    model.fit(
        feed_x, feed_y, batch_size=batch, epochs=1, shuffle=False, verbose=0
    )
    return after_train_on_batch, {v.path: np.asarray(v) for v in model.weights}


def test_no_step_inherits_another_batch_weight(pool2):
    """The weight of an uneven last batch (a replica's rows against an even
    share) applies to that batch's step only."""
    results = pool2.run(_partial_batches_then_per_process, True)
    keras.backend.clear_session()
    reference = _partial_batches_then_per_process(False)
    for after_train_on_batch, final in results:
        for path, value in reference[0].items():
            np.testing.assert_allclose(
                after_train_on_batch[path], value, err_msg=path, **TOL
            )
        for path, value in reference[1].items():
            np.testing.assert_allclose(final[path], value, err_msg=path, **TOL)


def _disagreeing_fit(what):
    import time

    from keras_torch_distribution._distributed.agreement import (
        RanksDisagreeError,
    )

    rank = torch.distributed.get_rank()
    x, y = _data()
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=devices, auto_shard_dataset=False
        )
    )
    model = _model()
    if what == "agree":
        from keras_torch_distribution._training import call_agreement

        start = time.perf_counter()
        for _ in range(20):
            call_agreement.check("fit", model, (x, y), {"batch_size": 8})
        return (time.perf_counter() - start) / 20
    if what == "rows":
        x, y = x[: 64 - 6 * rank], y[: 64 - 6 * rank]
    with pytest.raises(RanksDisagreeError) as error:
        if what == "model" and rank == 1:  # meets rank 0's fit at its build
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(6, name="down")]
            )
            model.compile(optimizer="adam", loss="mse")
        if what == "build":  # both build, other shapes: named at the build
            keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(6 + rank, name="down")]
            )
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return str(error.value)


def test_ranks_that_disagree_are_named_on_every_rank(pool2):
    for message in pool2.run(_disagreeing_fit, "rows"):
        assert (
            "model.fit() differs between ranks in rows of x: ranks [0]: 64; "
            "ranks [1]: 58"
        ) in message
    for message in pool2.run(_disagreeing_fit, "model"):
        assert (
            (
                "Ranks are running different programs: ranks [0] called "
                "model.fit(); ranks [1] were in the build of 1 variable "
                "('sequential"
            )
            in message
            and "/down/kernel')" in message  # its zero bias needs no broadcast
        ), message
    for message in pool2.run(_disagreeing_fit, "build"):
        assert (
            "the build differs between ranks in variable sequential" in message
        ), message
        assert (
            "/down/kernel: ranks [0]: (8, 6) float32 None; ranks [1]: (8, 7) "
            "float32 None"
        ) in message, message
    seconds = pool2.run(_disagreeing_fit, "agree")
    print(f"agreement check: {1e3 * max(seconds):.2f} ms per call")

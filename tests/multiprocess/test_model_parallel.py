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

from keras_torch_distribution._variables import born_sharded  # noqa: E402

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
    ff = keras.layers.EinsumDense(
        "abd,dc->abc", output_shape=(None, DIM), name="ff_out"
    )(keras.ops.gelu(ff))
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
            # No bias before BatchNormalization: its gradient is zero up to
            # rounding, which Adam would amplify into noise.
            keras.layers.Dense(12, use_bias=False, name="col"),
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
    elif case in ("transformer", "attention"):
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
    # The transformer with a replicated embedding: heads-sharded attention
    # and EinsumDense without the Partial embedding output.
    "attention": (
        _transformer,
        {k: v for k, v in TRANSFORMER_RULES.items() if "embed" not in k},
    ),
    "dropout": (_dropout, MLP_RULES),
}


def _loss_fn(case):
    if case in ("transformer", "attention"):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


def _set_distribution(rules, mesh):
    """mesh: None (one process), "1d" (("model",) over every rank) or
    "2x2" (("batch", "model"))."""
    if mesh is None:
        return
    devices = keras.distribution.list_devices()
    if mesh == "1d":
        keras_mesh = keras.distribution.DeviceMesh(
            (len(devices),), ["model"], devices
        )
        batch = "model"
    else:
        keras_mesh = keras.distribution.DeviceMesh(
            (2, 2), ["batch", "model"], devices
        )
        batch = "batch"
    layout_map = keras.distribution.LayoutMap(keras_mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name=batch
        )
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
            str(tuple(value.placements))
            if isinstance(value, DTensor)
            else None,
            born_sharded.local_bytes(v),
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
            v.path: (born_sharded.local_bytes(v), np.asarray(v))
            for v in optimizer.variables
        }
        result[f"{name}_iterations_grad"] = (
            optimizer.iterations._value.requires_grad
        )
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
            assert np.array_equal(got["init"][path], value), (
                f"{where} init {path}"
            )
        _close(got["out"], reference["out"], f"{where} out")
        _close(got["eval_out"], reference["eval_out"], f"{where} eval_out")
        assert got["eval_is_plain"]
        _close(got["loss"], reference["loss"], f"{where} loss")
        _close(got["grads"], reference["grads"], f"{where} grads")
        # A gradient that is zero in exact arithmetic (an attention key bias:
        # softmax ignores a per-query constant) is rounding noise, which
        # Adam normalizes into full-size steps; compare those under SGD only.
        noise = {
            path
            for path, g in reference["grads"].items()
            if np.max(np.abs(g)) < 1e-6
        }
        for name in ("sgd", "adam"):
            skip = noise if name == "adam" else set()
            _close(
                got[f"{name}_losses"],
                reference[f"{name}_losses"],
                f"{where} {name} losses",
            )
            _close(
                {
                    k: v
                    for k, v in got[f"{name}_weights"].items()
                    if k not in skip
                },
                {
                    k: v
                    for k, v in reference[f"{name}_weights"].items()
                    if k not in skip
                },
                f"{where} {name} weights",
            )
            _close(
                {
                    k: v[1]
                    for k, v in got[f"{name}_slots"].items()
                    if not any(_slot_prefix(p) in k for p in skip)
                },
                {
                    k: v[1]
                    for k, v in reference[f"{name}_slots"].items()
                    if not any(_slot_prefix(p) in k for p in skip)
                },
                f"{where} {name} slots",
            )
            assert got[f"{name}_iterations_grad"] is False
        _close(got["fit_loss"], reference["fit_loss"], f"{where} fit loss")
        _close(
            {k: v for k, v in got["fit_weights"].items() if k not in noise},
            {
                k: v
                for k, v in reference["fit_weights"].items()
                if k not in noise
            },
            f"{where} fit weights (Adam)",
        )
        # Shards: the variables the rules name are split, the rest whole.
        for path, (shape, local, placements, nbytes) in got["shards"].items():
            full_bytes = reference["shards"][path][3]
            if rules_sharded(path):
                assert placements is not None, f"{where} {path} is not sharded"
                assert local != shape, f"{where} {path}"
                assert nbytes < full_bytes, f"{where} {path}"
            else:
                assert placements is None, (
                    f"{where} {path} is sharded: {placements}"
                )
                assert nbytes == full_bytes


def _slot_prefix(path):
    """How Keras names optimizer slots of a variable: its path, '/' -> '_'."""
    return path.replace("/", "_")


def _sharded_by(rules):
    import re

    return lambda path: any(re.search(p, path) for p in rules)


@pytest.mark.parametrize(
    "case", ["mlp", "batchnorm", "conv", "transformer", "attention", "dropout"]
)
def test_matches_one_process_on_2_ranks(pool2, case):
    reference = _reference(case)
    results = pool2.run(numbers, case, "1d")
    _check_against(reference, results, _sharded_by(CASES[case][1]))


def dropout_runs(mesh):
    model = _build("dropout", mesh)
    x, y = _data("dropout")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    out = model(x, training=True)
    return _global(out), history.history["loss"]


def test_dropout_in_training_mode_does_not_crash(pool2):
    (out0, loss0), (out1, loss1) = pool2.run(dropout_runs, "1d")
    assert np.isfinite(loss0).all()
    # Every rank computes the same replica: the same dropout mask everywhere.
    np.testing.assert_array_equal(out0, out1)
    assert loss0 == loss1


def test_matches_one_process_on_2x2_mesh(pool4):
    reference = _reference("mlp")
    results = pool4.run(numbers, "mlp", "2x2")
    _check_against(reference, results, _sharded_by(MLP_RULES))


def initial_values(case, mesh):
    model = _build(case, mesh)
    return _weights(model), _shards(model)


@pytest.mark.parametrize("case", ["mlp", "conv", "transformer", "batchnorm"])
def test_initial_weights_identical_on_1_2_4_ranks(pool2, pool4, case):
    reference, _ = initial_values(case, None)
    keras.backend.clear_session()
    runs = {
        "2 ranks": pool2.run(initial_values, case, "1d"),
        "4 ranks": pool4.run(initial_values, case, "1d"),
        "2x2": pool4.run(initial_values, case, "2x2"),
    }
    for name, results in runs.items():
        for rank, (weights, shards) in enumerate(results):
            for path, value in reference.items():
                assert np.array_equal(weights[path], value), (name, rank, path)
    # Shards: 1/N of the bytes of each variable the rules shard.
    world = {"2 ranks": 2, "4 ranks": 4, "2x2": 2}
    sharded = _sharded_by(CASES[case][1])
    for name, results in runs.items():
        total, split = {}, {}
        for weights, shards in results:
            for path, (shape, local, placements, nbytes) in shards.items():
                full = reference[path].nbytes
                total[path] = total.get(path, 0) + nbytes
                # A dim smaller than the processes sharding it (2 heads over
                # 4) is replicated instead (layouts.for_variable).
                small = any(0 < n < len(results) for n in shape)
                split[path] = sharded(path) and not (
                    placements is None and small
                )
                if split[path]:
                    assert placements is not None and nbytes < full, (
                        name,
                        path,
                    )
                else:
                    assert nbytes == full, (name, path)
        for path, value in reference.items():
            copies = (
                len(results) // world[name] if split[path] else len(results)
            )
            assert total[path] == copies * value.nbytes, (
                name,
                path,
                total[path],
            )


def variable_semantics():
    import torch.distributed as dist

    rank = dist.get_rank()
    facts = {}
    model = _build("mlp", "1d")
    layout_map = keras.distribution.distribution()._layout_map
    mesh = layout_map.device_mesh
    layout_map[r"^counts$"] = (None, "model")
    layout_map[r"^flags$"] = (None, "model")
    layout_map[r"^frozen$"] = (None, "model")
    counts = keras.Variable(
        np.arange(24).reshape(4, 6), dtype="int32", name="counts"
    )
    flags = keras.Variable(
        np.ones((4, 6), dtype=bool), dtype="bool", name="flags"
    )
    frozen = keras.Variable(
        np.ones((4, 6), "float32"), trainable=False, name="frozen"
    )
    scalar = keras.Variable(3.0, name="scalar")
    facts["requires_grad"] = {
        name: (isinstance(v._value, DTensor), v._value.requires_grad)
        for name, v in [
            ("counts", counts),
            ("flags", flags),
            ("frozen", frozen),
            ("scalar", scalar),
        ]
    }
    facts["counts"] = np.asarray(counts)
    facts["flags"] = np.asarray(flags)
    # Optimizer slots are sharded like their variable; iterations is a plain
    # integer scalar that never requires grad.
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    facts["iterations"] = (
        isinstance(optimizer.iterations._value, DTensor),
        optimizer.iterations._value.requires_grad,
        str(optimizer.iterations._value.dtype),
    )
    slots = {}
    for variable in model.trainable_variables:
        index = optimizer._get_variable_index(variable)
        for slot in (optimizer._momentums[index], optimizer._velocities[index]):
            slots[slot.path] = (
                variable.path,
                born_sharded.local_bytes(slot),
                born_sharded.local_bytes(variable),
                np.asarray(variable).nbytes,
                str(getattr(slot._value, "placements", None)),
                str(getattr(variable._value, "placements", None)),
                slot._value.requires_grad,
            )
    facts["slots"] = slots
    kernel = model.get_layer("col").kernel
    # repr runs no collective: call it on rank 0 only.
    facts["repr"] = repr(kernel) if rank == 0 else None
    dist.barrier()
    facts["repr_all"] = repr(kernel)
    facts["numpy"] = np.array(kernel)
    facts["convert_to_numpy"] = keras.ops.convert_to_numpy(kernel)
    # Assign a full value, then a DTensor of another layout.
    full = np.arange(8 * 12, dtype="float32").reshape(8, 12) / 10
    kernel.assign(full)
    facts["after_full_assign"] = np.asarray(kernel)
    other = keras.distribution.distribute_tensor(
        torch.tensor(full * 2),
        keras.distribution.TensorLayout(("model", None), mesh),
    )
    facts["other_placements"] = str(other.placements)
    kernel.assign(other)
    facts["after_dtensor_assign"] = np.asarray(kernel)
    facts["kernel_placements"] = str(kernel._value.placements)
    facts["kernel_is_parameter"] = isinstance(kernel._value, torch.nn.Parameter)
    kernel.assign_add(np.ones((8, 12), "float32"))
    facts["after_assign_add"] = np.asarray(kernel)
    return facts


def test_variable_semantics(pool2):
    results = pool2.run(variable_semantics)
    full = np.arange(8 * 12, dtype="float32").reshape(8, 12) / 10
    reference = _build("mlp", None).get_layer("col").kernel.numpy()
    for rank, facts in enumerate(results):
        where = f"rank {rank}"
        assert facts["requires_grad"] == {
            "counts": (True, False),
            "flags": (True, False),
            "frozen": (True, False),
            "scalar": (False, True),
        }, where
        np.testing.assert_array_equal(
            facts["counts"], np.arange(24).reshape(4, 6)
        )
        assert facts["flags"].dtype == bool and facts["flags"].all()
        assert facts["iterations"][:2] == (False, False), where
        assert "int" in facts["iterations"][2], where
        for slot, (
            var,
            slot_bytes,
            var_bytes,
            full_bytes,
            sp,
            vp,
            grad,
        ) in facts["slots"].items():
            assert slot_bytes == var_bytes, (where, slot)
            assert sp == vp, (where, slot, sp, vp)
            assert grad is False, (where, slot)
            if (
                "col" in var
                and "kernel" in var
                or "col/bias" in var
                or "row/kernel" in var
            ):
                assert slot_bytes * 2 == full_bytes, (where, slot)
        for key in ("numpy", "convert_to_numpy"):
            assert facts[key].shape == (8, 12), (where, key)
            np.testing.assert_array_equal(
                facts[key], reference, err_msg=f"{where} {key}"
            )
        text = facts["repr_all"]
        assert (
            "value=" not in text
            and "model" in text
            and "mlp/col/kernel" in text
        )
        if rank == 0:
            assert facts["repr"] == text
        np.testing.assert_array_equal(facts["after_full_assign"], full)
        assert "Shard(dim=0)" in facts["other_placements"]
        np.testing.assert_array_equal(facts["after_dtensor_assign"], full * 2)
        assert facts["kernel_placements"] == "(Shard(dim=1),)"
        assert facts["kernel_is_parameter"]
        np.testing.assert_array_equal(facts["after_assign_add"], full * 2 + 1)


def mixed_precision(mesh):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _build("mlp", mesh)
        x, y = _data("mlp")
        out = model(x)
        kernel = model.get_layer("col").kernel
        facts = {
            "out_dtype": str(out.dtype),
            "out": _global(out),
            "kernel_dtype": kernel.dtype,
            "kernel_sharded": isinstance(kernel._value, DTensor),
        }
        model.compile(keras.optimizers.Adam(0.01), "mse")
        history = model.fit(
            x, y, batch_size=4, epochs=1, shuffle=False, verbose=0
        )
        facts["loss"] = history.history["loss"]
        facts["weights"] = _weights(model)
        return facts
    finally:
        keras.config.set_dtype_policy("float32")


def test_mixed_bfloat16(pool2):
    keras.backend.clear_session()
    reference = mixed_precision(None)
    keras.backend.clear_session()
    for rank, facts in enumerate(pool2.run(mixed_precision, "1d")):
        assert facts["out_dtype"] == "torch.bfloat16"
        assert facts["kernel_dtype"] == "float32" and facts["kernel_sharded"]
        _close(
            facts["out"],
            reference["out"],
            f"rank {rank} out",
            rtol=2e-2,
            atol=2e-2,
        )
        _close(
            facts["loss"],
            reference["loss"],
            f"rank {rank} loss",
            rtol=2e-2,
            atol=2e-2,
        )
        _close(
            facts["weights"],
            reference["weights"],
            f"rank {rank} w",
            rtol=2e-2,
            atol=2e-2,
        )


def convert_dtensor_value():
    model = _build("mlp", "1d")
    return keras.ops.convert_to_numpy(model.get_layer("col").kernel.value)


def test_convert_to_numpy_of_a_dtensor_value(pool2):
    reference = _build("mlp", None).get_layer("col").kernel.numpy()
    for value in pool2.run(convert_dtensor_value):
        np.testing.assert_array_equal(value, reference)

"""One device's numbers with Dropout, BatchNormalization and per-rank seeds
(issue 12), on 2 and 4 gloo processes against one process.

- Dropout (unseeded: torch's global generator; seeded: `Dropout(seed=...)`,
  a `noise_shape`, GaussianNoise's `keras.random.normal` with a
  SeedGenerator): each replica's masks are its rows of the masks one process
  draws for the global batch, bit for bit; an activation sharded on the
  model axis gets its columns.
- BatchNormalization: moments over the global batch (one all-reduce per
  layer), under DataParallel and on a 2x2 mesh, with a last uneven batch.
- `keras.utils.set_random_seed(1000 + rank)`: every copy of a variable is
  equal to rank 0's from creation (before any step).

Eager and `jit_compile=True`. The reference is one eager process: one
process under jit_compile draws unseeded dropout with inductor's own
generator, while distributed runs draw (eagerly) torch's stream.
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

MLP_RULES = {
    r".*up/kernel": (None, "model"),
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", None),
}
CNN_RULES = {
    r".*conv1/kernel": (None, None, None, "model"),
    r".*conv2/kernel": (None, None, None, "model"),
    r".*bn\d/(gamma|beta|moving_mean|moving_variance)": ("model",),
}


class MaskProbe(keras.layers.Layer):
    """Identity that records, for each eager training call, which entries
    are zero (dropped), gathered whole when sharded."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.masks = []

    def call(self, x, training=None):
        if (
            training
            and not isinstance(x, keras.KerasTensor)
            and x.device.type != "meta"
        ):
            if not torch.compiler.is_compiling():
                value = x.detach()
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                self.masks.append((value == 0).cpu().numpy())
        return x


def _dropout_model(kind):
    """kind: "unseeded" (torch's global generator), "seeded" (Keras seeds:
    Dropout(seed=), a noise_shape, GaussianNoise) or "both"."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="up")(
        inputs
    )  # no activation: zeros are dropped
    h = keras.layers.Dropout(
        0.3, seed=5 if kind == "seeded" else None, name="drop"
    )(h)
    h = MaskProbe(name="probe")(h)
    if kind != "unseeded":
        h = keras.layers.Dropout(
            0.2, noise_shape=(None, 1), seed=9, name="rowdrop"
        )(h)
        h = keras.layers.GaussianNoise(0.1, seed=7, name="noise")(h)
    if kind == "both":
        h = keras.layers.Dropout(0.25, seed=11, name="drop2")(h)
    h = keras.layers.Activation("relu")(h)
    outputs = keras.layers.Dense(4, name="down")(h)
    return keras.Model(inputs, outputs, name="dropnet")


def _cnn():
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3, use_bias=False, name="conv1")(inputs)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv2")(
        h
    )
    h = keras.layers.BatchNormalization(name="bn2")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    return keras.Model(inputs, outputs, name="cnn")


def _masked_bn():
    """BatchNormalization with a mask (Keras' two-pass masked moments)."""
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(10, 8, mask_zero=True, name="embed")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(4, name="down")(h)
    return keras.Model(inputs, outputs, name="masked")


def _seeds_model():
    """Replicated variables with random initial values and an unseeded
    GaussianNoise (its SeedGenerator's state comes from the rank's seed)."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.GaussianNoise(0.05, name="noise")(h)
    side = keras.layers.Dense(16, name="side")(inputs)  # replicated under MP
    h = keras.layers.Add()([h, side])
    outputs = keras.layers.Dense(4, name="down")(h)
    return keras.Model(inputs, outputs, name="seeds")


MODELS = {
    "dropout": (lambda: _dropout_model("unseeded"), MLP_RULES),
    "dropout_seeded": (lambda: _dropout_model("seeded"), MLP_RULES),
    "dropout_both": (lambda: _dropout_model("both"), MLP_RULES),
    "cnn": (_cnn, CNN_RULES),
    "masked_bn": (_masked_bn, {}),
    "seeds": (_seeds_model, MLP_RULES),
}


def _data(case, rows):
    rng = np.random.default_rng(0)
    if case == "cnn":
        x = rng.normal(size=(rows, 6, 6, 3)).astype("float32")
        y = rng.normal(size=(rows, 3)).astype("float32")
    elif case == "masked_bn":
        x = rng.integers(0, 10, size=(rows, 5)).astype("int32")  # 0: masked
        y = rng.normal(size=(rows, 4)).astype("float32")
    else:
        x = rng.normal(size=(rows, 8)).astype("float32")
        y = rng.normal(size=(rows, 4)).astype("float32")
    return x, y


def _set_distribution(mesh, rules, auto_shard):
    """mesh: "dp", "1d" (("model",), its one axis the batch axis), "1x2"
    (a batch axis of 1: tensor parallelism only) or "2x2"."""
    devices = keras.distribution.list_devices()
    if mesh == "dp":
        distribution = keras.distribution.DataParallel(
            devices=devices, auto_shard_dataset=auto_shard
        )
    else:
        if mesh == "1d":
            keras_mesh = keras.distribution.DeviceMesh(
                (len(devices),), ["model"], devices
            )
        else:
            shape = (1, len(devices)) if mesh == "1x2" else (2, 2)
            keras_mesh = keras.distribution.DeviceMesh(
                shape, ["batch", "model"], devices
            )
        layout_map = keras.distribution.LayoutMap(keras_mesh)
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
    ranks = np.vectorize(lambda d: int(str(d).split(":")[1]))(mesh.devices)
    position = np.argwhere(ranks == torch.distributed.get_rank())[0]
    return int(position[axis]), int(mesh.shape[axis])


def _pieces(array, replica, replicas):
    """A replica's rows of every global batch (what it feeds itself)."""
    per = GLOBAL_BATCH // replicas
    batches = array.reshape((-1, GLOBAL_BATCH) + array.shape[1:])
    return batches[:, replica * per : (replica + 1) * per].reshape(
        (-1,) + array.shape[1:]
    )


def _weights(model):
    return {v.path: np.asarray(v).astype("float32") for v in model.weights}


def _run(
    case,
    mesh=None,
    auto_shard=True,
    jit_compile=False,
    rows=ROWS,
    epochs=2,
    seed=1,
    init=None,
    shuffle=False,
):
    """Train; one process when mesh is None. seed="rank": 1000 + rank."""
    make, rules = MODELS[case]
    x, y = _data(case, rows)
    batch = GLOBAL_BATCH
    if seed == "rank":
        seed = 1000 + (torch.distributed.get_rank() if mesh else 0)
    keras.utils.set_random_seed(seed)
    if mesh is not None:
        distribution = _set_distribution(mesh, rules, auto_shard)
        if not auto_shard:
            replica, replicas = _replica_of(distribution)
            x, y = _pieces(x, replica, replicas), _pieces(y, replica, replicas)
            batch = GLOBAL_BATCH // replicas
    model = make()
    if init is not None:
        for v in model.weights:
            v.assign(init[v.path])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        jit_compile=jit_compile,
    )
    before = _weights(model)
    history = model.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=shuffle, verbose=0
    )
    probe = [layer for layer in model.layers if isinstance(layer, MaskProbe)]
    return dict(
        init=before,
        loss=history.history["loss"],
        weights=_weights(model),
        masks=[np.asarray(m) for m in probe[0].masks] if probe else [],
    )


_references = {}


def _reference(case, **kwargs):
    key = (case, tuple(sorted(kwargs.items())))
    if key not in _references:
        keras.backend.clear_session()
        try:
            _references[key] = _run(case, **kwargs)
        finally:
            keras.backend.clear_session()
    return _references[key]


def _assert_same_numbers(result, reference, what):
    np.testing.assert_allclose(
        result["loss"], reference["loss"], err_msg=what, **TOL
    )
    for path, value in reference["weights"].items():
        np.testing.assert_allclose(
            result["weights"][path], value, err_msg=f"{what} {path}", **TOL
        )


def _assert_masks(results, reference, replicas):
    """Each step's mask, the replicas' rows in replica order, is one
    process's mask for the global batch, bit for bit."""
    steps = len(reference["masks"])
    assert steps == ROWS // GLOBAL_BATCH * 2
    for step in range(steps):
        pieces = [
            r["masks"][step] for r in results[:: len(results) // replicas]
        ]
        np.testing.assert_array_equal(
            np.concatenate(pieces), reference["masks"][step]
        )


# ---------------------------------------------------------------------------
# Stream and slice in one process: a replica's rows of one draw, chunked
# ---------------------------------------------------------------------------

WINDOW = (40, 16, 8)  # global rows, this replica's first row, its rows


@pytest.fixture
def small_chunks(monkeypatch):
    """A fed batch's window, and draws made in several chunks."""
    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution._distributed import replicas
    from keras_torch_distribution._variables import sharded_init

    monkeypatch.setattr(sharded_init, "CHUNK_DRAWS", 40)  # 5 chunks of 8 rows
    monkeypatch.setattr(replicas.batch_weight, "rows", None)
    return lambda window: monkeypatch.setattr(
        replicas.batch_weight, "rows", window
    )


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_dropout_rows_of_one_draw_in_chunks(small_chunks, seeded):
    x = torch.randn(40, 4) + 10.0
    keras.utils.set_random_seed(3)
    seed = (lambda: keras.random.SeedGenerator(5)) if seeded else (lambda: None)
    state = torch.get_rng_state()
    whole = keras.random.dropout(x, 0.4, seed=seed())
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    small_chunks(WINDOW)
    rows = keras.random.dropout(x[16:24], 0.4, seed=seed())
    assert torch.equal(rows, whole[16:24])
    # Unseeded: torch's generator ends where one process's does.
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize(
    "kind", ["normal", "uniform", "truncated_normal", "randint"]
)
def test_keras_random_rows_of_one_draw_in_chunks(small_chunks, kind):
    def draw(rows):
        generator = keras.random.SeedGenerator(7)
        if kind == "randint":
            return keras.random.randint((rows, 4), 0, 100, seed=generator)
        return getattr(keras.random, kind)((rows, 4), seed=generator)

    whole = draw(40)
    small_chunks(WINDOW)
    assert torch.equal(draw(8), whole[16:24])
    # Not a batch-shaped draw (dim 0 is not the replica's rows): as given.
    assert torch.equal(draw(40), whole)


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["dropout", "dropout_seeded"], ids=["unseeded", "seeded"]
)
@pytest.mark.parametrize(
    "mesh,auto_shard",
    [("dp", True), ("dp", False), ("1d", True)],
    ids=["dp", "dp-per-process", "mp-1d"],
)
def test_dropout_masks_are_rows_of_one_process_masks(
    pool2, case, mesh, auto_shard
):
    reference = _reference(case)
    results = pool2.run(_run, case, mesh, auto_shard)
    _assert_masks(results, reference, replicas=2)
    for rank, result in enumerate(results):
        assert result["masks"][0].shape == (GLOBAL_BATCH // 2, 16)
        _assert_same_numbers(result, reference, f"rank {rank}")


@pytest.mark.parametrize(
    "case", ["dropout", "dropout_seeded"], ids=["unseeded", "seeded"]
)
def test_dropout_of_column_sharded_activation(pool2, case):
    # A batch axis of 1: both processes see every row; the activation after
    # "up" is a DTensor sharded on its columns, and each keeps its columns
    # of one process's mask.
    reference = _reference(case)
    results = pool2.run(_run, case, "1x2")
    for rank, result in enumerate(results):
        for step, mask in enumerate(reference["masks"]):
            np.testing.assert_array_equal(result["masks"][step], mask)
        _assert_same_numbers(result, reference, f"rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp", "1d"])
def test_dropout_with_jit_compile(pool2, mesh):
    # Unseeded and seeded dropout in one model: each draw breaks the
    # compiled graph (as Keras' own seeded dropout does), so compiling
    # costs most of the test.
    reference = _reference("dropout_both")
    results = pool2.run(_run, "dropout_both", mesh, True, True)
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")


@pytest.mark.slow
def test_dropout_on_2x2_mesh_rows_and_columns(pool4):
    reference = _reference("dropout_seeded")
    results = pool4.run(_run, "dropout_seeded", "2x2")
    _assert_masks(results, reference, replicas=2)
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")


# ---------------------------------------------------------------------------
# BatchNormalization
# ---------------------------------------------------------------------------

UNEVEN_ROWS = 57  # a last global batch of 9 rows: 5 and 4 per replica


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
def test_batchnorm_cnn_data_parallel(pool2, jit_compile):
    reference = _reference("cnn", rows=UNEVEN_ROWS)
    results = pool2.run(
        _run, "cnn", "dp", True, jit_compile, UNEVEN_ROWS, timeout=600
    )
    for rank, result in enumerate(results):
        # Moving mean and variance included (model.weights).
        _assert_same_numbers(result, reference, f"rank {rank}")


def test_masked_batchnorm_data_parallel(pool2):
    reference = _reference("masked_bn", rows=UNEVEN_ROWS)
    results = pool2.run(_run, "masked_bn", "dp", True, False, UNEVEN_ROWS)
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
def test_batchnorm_cnn_on_2x2_mesh(pool4, jit_compile):
    reference = _reference("cnn", rows=UNEVEN_ROWS)
    results = pool4.run(
        _run, "cnn", "2x2", True, jit_compile, UNEVEN_ROWS, timeout=600
    )
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")


# ---------------------------------------------------------------------------
# Rank-dependent seeds
# ---------------------------------------------------------------------------


def _replicated_paths(results):
    """Variables whose pre-fit values differ between ranks (sharded ones are
    gathered, so their global values agree)."""
    first, second = results[0]["init"], results[1]["init"]
    return [p for p in first if not np.array_equal(first[p], second[p])]


@pytest.mark.parametrize(
    "jit_compile,shuffle",
    [(False, False), (True, False), (False, True)],
    ids=["eager", "jit", "shuffle"],
)
def test_rank_dependent_seeds_data_parallel(pool2, jit_compile, shuffle):
    reference = _reference("seeds", seed=1000, shuffle=shuffle)
    results = pool2.run(
        _run,
        "seeds",
        "dp",
        True,
        jit_compile,
        seed="rank",
        shuffle=shuffle,
        timeout=600,
    )
    # Copies are equal from creation (before any step), as on JAX.
    assert not _replicated_paths(results), _replicated_paths(results)
    # Rank 0's values are one process's with seed 1000; after the broadcast
    # (GaussianNoise's SeedGenerator state included) every rank trains as
    # that process does. With shuffle=True every rank takes its rows of
    # rank 0's permutation (torch's generator, which Keras shuffles with).
    for path, value in reference["init"].items():
        np.testing.assert_array_equal(results[0]["init"][path], value)
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
def test_rank_dependent_seeds_model_parallel(pool2, jit_compile):
    results = pool2.run(
        _run, "seeds", "1d", True, jit_compile, seed="rank", timeout=600
    )
    # Copies of replicated variables are equal from creation.
    assert not _replicated_paths(results), _replicated_paths(results)
    # Sharded (FSDP) variables are made of each rank's block; replicated
    # ones become rank 0's. One process started from those values (rank 0's
    # view) gives the same numbers.
    keras.backend.clear_session()
    reference = _run("seeds", seed=1000, init=results[0]["init"])
    keras.backend.clear_session()
    for rank, result in enumerate(results):
        _assert_same_numbers(result, reference, f"rank {rank}")

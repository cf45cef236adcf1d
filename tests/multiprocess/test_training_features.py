"""Keras training features under every distribution (issue 40): each
feature trained under DataParallel, tensor parallelism on a (1, 2) mesh,
FSDP on a (2, 1) mesh (the batch axis shards the kernels) and both on a
(2, 2) mesh, against one process on the global batch from the same
weights and data. docs/semantics.md holds the matrix these tests check.

CI time: the pools are spawned once for the module, and each test is one
pool call that runs every feature of its distribution in turn (a feature
that fails is reported by name, with the others' results).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import helpers  # noqa: E402

ROWS, BATCH = 32, 8
TOL = dict(rtol=2e-5, atol=2e-5)
MESHES = {"tp": (1, 2), "fsdp": (2, 1), "2d": (2, 2)}
# The batch axis shards dim 0 of `hidden` and dim 1 of `proj` and `out`:
# FSDP on a (2, 1) mesh; with the model axis, column- then row-parallel.
RULES = {
    "hidden/kernel": ("batch", "model"),
    "hidden/bias": ("model",),
    "proj/kernel": ("model", "batch"),
    "out/kernel": ("batch", None),
}


def _distribute(kind):
    if kind is None:
        return
    if kind == "dp":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        return
    keras.distribution.set_distribution(
        helpers.model_parallel(
            keras.distribution.list_devices(),
            RULES,
            MESHES[kind],
            ("batch", "model"),
            batch_dim_name="batch",
        )
    )


def _layers():
    return [
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(8, activation="tanh", name="proj"),
        keras.layers.Dense(4, name="out"),
    ]


def _mlp(remat_mode=None, **remat_options):
    keras.utils.set_random_seed(0)
    scope = (
        keras.RematScope(mode=remat_mode, **remat_options)
        if remat_mode
        else None
    )
    if scope is not None:
        scope.__enter__()
    try:
        inputs = keras.Input((6,))
        x = inputs
        for layer in _layers():
            x = layer(x)
        return keras.Model(inputs, x, name="mlp")
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)


def _data(rows=ROWS):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(rows, 6)).astype("float32"),
        rng.normal(size=(rows, 4)).astype("float32"),
    )


def _weights(model):
    return {v.path: np.asarray(v, "float32") for v in model.weights}


def _fit(
    model, optimizer=None, jit_compile=False, epochs=1, rows=ROWS, **fit_kwargs
):
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01),
        loss="mse",
        jit_compile=jit_compile,
    )
    x, y = _data(rows)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        **fit_kwargs,
    )
    return dict(loss=history.history["loss"], weights=_weights(model))


# --- rematerialization ----------------------------------------------------


class _RematBlock(keras.layers.Layer):
    """`keras.remat` on part of a layer's call: two Dense and a residual."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.proj = keras.layers.Dense(8, name="proj")

    def call(self, x):
        return keras.remat(self._inner)(x)

    def _inner(self, x):
        return self.proj(self.hidden(x)) + x


def remat_full():
    return _fit(_mlp("full"))


def remat_full_jit():
    return _fit(_mlp("full"), jit_compile=True)


def remat_activations():
    return _fit(_mlp("activations"))


def _counting_remat(function):
    """`function()`'s result, with `rematerialized`: how many calls torch's
    checkpoint got (the layer calls Keras rematerialized, their recomputes'
    nested ones included)."""
    real = torch.utils.checkpoint.checkpoint
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.utils.checkpoint.checkpoint = counted
    try:
        result = function()
    finally:
        torch.utils.checkpoint.checkpoint = real
    return dict(result, rematerialized=len(calls))


def remat_larger_than():
    """Outputs of more than 20 values: `hidden`'s and `proj`'s (8 rows x 8)
    and the model's and `out`'s (8 x 4). The last batch has 5 rows, so the
    replicas hold 3 and 2: the same layers are rematerialized as in one
    process (the global batch's output size decides), on every rank."""
    return _counting_remat(
        lambda: _fit(
            _mlp("larger_than", output_size_threshold=20), rows=ROWS - 3
        )
    )


def remat_list_of_layers():
    return _counting_remat(
        lambda: _fit(_mlp("list_of_layers", layer_names=["hidden", "out"]))
    )


def remat_layer():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="embed")(inputs)
    x = _RematBlock(name="block")(x)
    outputs = keras.layers.Dense(4, name="out")(x)
    return _fit(keras.Model(inputs, outputs))


def remat_keras_hub():
    """A tiny keras_hub Llama built in RematScope("full"), under its own
    layout map where the distribution has a model axis (FSDP: the map
    shards its kernels on the batch axis too)."""
    keras_hub = pytest.importorskip("keras_hub")
    vocabulary, length = 32, 8
    current = keras.distribution.distribution()
    if isinstance(current, keras.distribution.ModelParallel):
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=keras_hub.models.LlamaBackbone.get_layout_map(
                    current.device_mesh
                ),
                batch_dim_name="batch",
            )
        )
    keras.utils.set_random_seed(0)
    with keras.RematScope(mode="full"):
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocabulary,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
        )
        model = keras_hub.models.LlamaCausalLM(
            backbone=backbone, preprocessor=None
        )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ids = np.random.default_rng(0).integers(1, vocabulary, (16, length + 1))
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((16, length), bool),
    }
    history = model.fit(
        x, ids[:, 1:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    return dict(loss=history.history["loss"], weights=_weights(model))


# --- loss scaling ---------------------------------------------------------


def loss_scale_overflow(jit_compile=False):
    """mixed_float16 with a LossScaleOptimizer, a row whose activations
    overflow float16 in the first batch: only the replica that holds it
    sees an infinite gradient, yet every rank skips that step and halves
    its scale, as one process does on the global batch."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = _mlp()
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=2.0**10
        )
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
        x, y = _data()
        x[1] = 6e4  # overflows float16 in `hidden` (eager)
        y[1] = 6e4  # and the scaled gradient of `out` (compiled too)
        history = model.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0
        )
        return dict(
            scale=float(optimizer.dynamic_scale),
            iterations=int(optimizer.iterations),
            weights=_weights(model),
            finite_loss=np.isfinite(history.history["loss"]),
        )
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def loss_scale_overflow_jit():
    return loss_scale_overflow(jit_compile=True)


# --- gradient accumulation ------------------------------------------------


def _optimizer_state(optimizer):
    return {
        f"optimizer/{v.path}": np.asarray(v, "float32")
        for v in optimizer.variables
    }


def accumulation():
    """Adam(gradient_accumulation_steps=4): after 6 micro-steps (one update,
    two micro-steps into the next) the weights and the optimizer state,
    its gradient accumulators included, are one process's on every rank."""
    model = _mlp()
    optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=4)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
    x, y = (
        np.concatenate([x, x[: 2 * BATCH]]),
        np.concatenate([y, y[: 2 * BATCH]]),
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    return dict(
        loss=history.history["loss"],
        weights={**_weights(model), **_optimizer_state(optimizer)},
    )


def _accumulating(kind, steps):
    """A fresh MLP and Adam(gradient_accumulation_steps=steps) under
    distribution `kind` (None: one process), compiled."""
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    _distribute(kind)
    model = _mlp()
    optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps)
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def _state(model, optimizer):
    return {**_weights(model), **_optimizer_state(optimizer)}


RESUME_CASES = ((4, 6), (3, 5))  # (accumulation steps, micro-steps saved)
RESUME_STEPS = 10


def accumulation_resumed(directory, kind):
    """For each (steps, saved) of RESUME_CASES: RESUME_STEPS micro-steps
    uninterrupted; then a run of `saved` micro-steps (mid-accumulation)
    saved with `checkpoint.save`, loaded into a fresh model and optimizer
    (built by the load), trained on the batches left. Per case: (the
    uninterrupted state, the saved, the loaded, the resumed)."""
    from keras_torch_distribution import checkpoint

    x, y = _data(RESUME_STEPS * BATCH)
    fit = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    results = []
    for steps, saved_at in RESUME_CASES:
        model, optimizer = _accumulating(kind, steps)
        model.fit(x, y, **fit)
        uninterrupted = _state(model, optimizer)

        model, optimizer = _accumulating(kind, steps)
        split = saved_at * BATCH
        model.fit(x[:split], y[:split], **fit)
        path = os.path.join(directory, f"{kind}-{steps}")
        checkpoint.save(model, path)
        saved = _state(model, optimizer)

        model, optimizer = _accumulating(kind, steps)
        checkpoint.load(model, path)
        loaded = _state(model, optimizer)
        model.fit(x[split:], y[split:], **fit)
        results.append((uninterrupted, saved, loaded, _state(model, optimizer)))
    keras.distribution.set_distribution(None)
    return results


# --- compile and fit options ----------------------------------------------


def _history(history):
    return {k: list(v) for k, v in history.history.items()}


def _fit_logs(model, epochs=1, **fit_kwargs):
    x, y = fit_kwargs.pop("data", None) or _data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        **fit_kwargs,
    )
    return dict(weights=_weights(model), **_history(history))


def _compiled(optimizer=None, loss="mse", model=None, **compile_kwargs):
    model = model or _mlp()
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01),
        loss=loss,
        **compile_kwargs,
    )
    return model


def steps_per_execution():
    """Keras refuses it on torch, in one process too: the same error."""
    return _fit_logs(_compiled(steps_per_execution=2), epochs=2)


def class_weight():
    x, _ = _data()
    labels = np.arange(ROWS) % 4
    model = _compiled(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return _fit_logs(
        model, data=(x, labels), class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}
    )


def sample_weight():
    weights = np.linspace(0.1, 2.0, ROWS).astype("float32")
    return _fit_logs(_compiled(), sample_weight=weights)


def validation():
    x, y = _data()
    return _fit_logs(
        _compiled(metrics=["mae"]),
        epochs=2,
        validation_data=(x[:12], y[:12]),
        validation_freq=2,
    )


def uneven_last_batch():
    """29 rows in batches of 8: the last batch's 5 rows split 3 and 2, each
    replica's gradient weighted by its rows (FSDP's reduce-scatter too)."""
    return _fit_logs(_compiled(), data=_data(ROWS - 3))


def initial_epoch():
    return _fit_logs(_compiled(), epochs=3, initial_epoch=1)


class _AuxLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(x * x))
        return x


def outputs_losses_add_loss():
    """Two outputs, two losses with loss_weights, and an add_loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    x = _AuxLoss(name="aux")(x)
    x = keras.layers.Dense(8, activation="tanh", name="proj")(x)
    first = keras.layers.Dense(4, name="out")(x)
    second = keras.layers.Dense(2, name="second")(x)
    model = keras.Model(inputs, {"first": first, "second": second})
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"first": "mse", "second": "mae"},
        loss_weights={"first": 1.0, "second": 0.5},
    )
    x, y = _data()
    return _fit_logs(model, data=(x, {"first": y, "second": y[:, :2]}))


def run_eagerly():
    return _fit_logs(_compiled(run_eagerly=True))


def clipnorm():
    return _fit_logs(_compiled(keras.optimizers.Adam(0.01, clipnorm=0.05)))


def clipvalue():
    return _fit_logs(_compiled(keras.optimizers.Adam(0.01, clipvalue=0.01)))


def global_clipnorm():
    """The norm of every gradient together: over the sharded gradients'
    global values, not each rank's blocks."""
    return _fit_logs(_compiled(keras.optimizers.SGD(0.1, global_clipnorm=0.05)))


def learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
    return _fit_logs(_compiled(keras.optimizers.SGD(schedule, momentum=0.9)))


def weight_decay():
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return _fit_logs(_compiled(optimizer))


def ema():
    """use_ema: fit ends with the moving averages in the weights."""
    optimizer = keras.optimizers.AdamW(0.01, use_ema=True, ema_momentum=0.5)
    return _fit_logs(_compiled(optimizer))


def frozen_layer():
    model = _mlp()
    model.get_layer("proj").trainable = False
    return _fit_logs(_compiled(model=model))


class _CustomStep(keras.Model):
    """A train_step of its own, as Keras' torch guide writes it."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        variables = self.trainable_weights
        gradients = [v.value.grad for v in variables]
        with torch.no_grad():
            self.optimizer.apply(gradients, variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = inputs
    for layer in _layers():
        x = layer(x)
    return _fit_logs(_compiled(model=_CustomStep(inputs, x)))


def quantize():
    """Trained, then quantized to int8: its predictions."""
    model = _compiled()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.quantize("int8")
    return dict(
        predictions=np.asarray(
            model.predict(x, batch_size=BATCH, verbose=0), "float32"
        )
    )


# --- quantized training -----------------------------------------------------


def float8():
    """quantize("float8"), then fit: the losses, kernels and biases, and
    every scale and amax history (Keras' float8 layers overwrite them with
    their "gradient": the maximum over the replicas, one process's)."""
    model = _mlp()
    model.quantize("float8")
    return _fit_logs(_compiled(model=model))


def float8_scaled_mm():
    """The same with KTD_FLOAT8_MATMUL=1: the products as torch._scaled_mm
    on float8 operands where torch offers it (torch 2.13's CPU does; DTensor
    operands, under tensor parallelism, keep Keras' matmul)."""
    os.environ["KTD_FLOAT8_MATMUL"] = "1"
    try:
        return float8()
    finally:
        del os.environ["KTD_FLOAT8_MATMUL"]


def _qlora(mode):
    """quantize(mode), LoRA (rank 2) on every Dense, then fit: the losses,
    the LoRA factors and biases, the quantized kernels and scales
    (unchanged)."""
    model = _mlp()
    model.quantize(mode)
    for layer in _layers():
        model.get_layer(layer.name).enable_lora(2)
    return _fit_logs(_compiled(model=model))


def qlora_int8():
    return _qlora("int8")


def qlora_int4():
    return _qlora("int4")


FEATURES = {
    "steps_per_execution": steps_per_execution,
    "class_weight": class_weight,
    "sample_weight": sample_weight,
    "validation": validation,
    "initial_epoch": initial_epoch,
    "uneven_last_batch": uneven_last_batch,
    "outputs_losses_add_loss": outputs_losses_add_loss,
    "run_eagerly": run_eagerly,
    "clipnorm": clipnorm,
    "clipvalue": clipvalue,
    "global_clipnorm": global_clipnorm,
    "learning_rate_schedule": learning_rate_schedule,
    "weight_decay": weight_decay,
    "ema": ema,
    "frozen_layer": frozen_layer,
    "custom_train_step": custom_train_step,
    "quantize": quantize,
    "float8": float8,
    "float8_scaled_mm": float8_scaled_mm,
    "qlora_int8": qlora_int8,
    "qlora_int4": qlora_int4,
    "accumulation": accumulation,
    "loss_scale_overflow": loss_scale_overflow,
    "loss_scale_overflow_jit": loss_scale_overflow_jit,
    "remat_full": remat_full,
    "remat_keras_hub": remat_keras_hub,
    "remat_full_jit": remat_full_jit,
    "remat_activations": remat_activations,
    "remat_larger_than": remat_larger_than,
    "remat_list_of_layers": remat_list_of_layers,
    "remat_layer": remat_layer,
}
# The features each distribution runs. Compiled steps cost seconds of
# compile time each, and keras_hub seconds to build: they run under one
# distribution each, in the slow tests.
SLOW_UNDER = {
    "remat_full_jit": "fsdp",
    "remat_keras_hub": "fsdp",
    "loss_scale_overflow_jit": "dp",
}
# Features that differ from another only where operands are plain tensors:
# float8's torch._scaled_mm (DTensor operands keep Keras' matmul).
ONLY_UNDER = {"float8_scaled_mm": ("dp", "fsdp")}
UNDER = {
    kind: [
        n
        for n in FEATURES
        if n not in SLOW_UNDER and kind in ONLY_UNDER.get(n, (kind,))
    ]
    for kind in ("dp", "tp", "fsdp", "2d")
}
# float16 compute: sums in another order differ in the last bits.
TOLERANCES = {
    # issue 47's bar: every scale and amax history within 1e-5.
    "float8": dict(rtol=1e-5, atol=1e-5),
    "float8_scaled_mm": dict(rtol=1e-5, atol=1e-5),
    "loss_scale_overflow": dict(rtol=1e-2, atol=1e-3),
    "loss_scale_overflow_jit": dict(rtol=1e-2, atol=1e-3),
}


def _run(kind, names):
    """Each feature of `names` under distribution `kind` (None: one
    process): its result, or ("error", the exception's type and message,
    its traceback)."""

    def run(name):
        _distribute(kind)
        return FEATURES[name]()

    return helpers.each_case(names, run)


_references = {}


def _reference(name):
    if name not in _references:
        _references[name] = _run(None, [name])[name]
    return _references[name]


def _assert_equal(name, result, reference):
    """`result` equals one process's `reference`; where one process raises
    (Keras refuses the feature on torch), the same error."""
    if isinstance(reference, tuple):
        assert isinstance(result, tuple), f"{name}: no error, expected one"
        assert result[1] == reference[1], f"{name}: {result[1]}"
        return
    tolerance = TOLERANCES.get(name, TOL)
    if isinstance(result, tuple):
        raise AssertionError(f"{name}: {result[1]}\n{result[2]}")
    for key, value in reference.items():
        if key == "weights":
            for path, weight in value.items():
                np.testing.assert_allclose(
                    result["weights"][path],
                    weight,
                    err_msg=f"{name}: {path}",
                    **tolerance,
                )
        else:
            np.testing.assert_allclose(
                result[key], value, err_msg=f"{name}: {key}", **tolerance
            )


def _check(kind, per_rank, names=None):
    failures = []
    for name in names or UNDER[kind]:
        for rank, results in enumerate(per_rank):
            try:
                _assert_equal(name, results[name], _reference(name))
            except AssertionError as error:
                failures.append(f"rank {rank}, {name} under {kind}: {error}")
                break
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("kind", ["dp", "tp", "fsdp"])
def test_features_on_2_processes(pool2, kind):
    _check(kind, pool2.run(_run, kind, UNDER[kind]))


def test_features_on_2x2(pool4):
    _check("2d", pool4.run(_run, "2d", UNDER["2d"]))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_slow_features_on_2_processes(pool2, kind):
    names = [n for n, k in SLOW_UNDER.items() if k == kind]
    _check(kind, pool2.run(_run, kind, names), names)


def test_a_checkpoint_mid_accumulation_resumes_to_the_uninterrupted_run(
    pool2, tmp_path
):
    """Saved 6 micro-steps into Adam(gradient_accumulation_steps=4) (and 5
    into 3): the partial sums and the iteration count are in the
    checkpoint, and the resumed run ends with the uninterrupted run's
    weights and optimizer state, exactly, under DataParallel and FSDP;
    both equal one process's."""
    from helpers import assert_same_values

    one = accumulation_resumed(str(tmp_path / "one"), None)
    for kind in ("dp", "fsdp"):
        per_rank = pool2.run(accumulation_resumed, str(tmp_path), kind)
        for rank, cases in enumerate(per_rank):
            for (steps, saved_at), case, reference in zip(
                RESUME_CASES, cases, one
            ):
                uninterrupted, saved, loaded, resumed = case
                where = f"{kind}, rank {rank}, accumulation {steps}"
                assert saved["optimizer/adam/iteration"] == saved_at, where
                assert any(
                    np.any(v != 0)
                    for k, v in saved.items()
                    if k.endswith("gradient_accumulator")
                ), f"{where}: nothing accumulated at the save"
                assert_same_values(loaded, saved)
                assert_same_values(resumed, uninterrupted)
                for got, want in zip(case, reference):
                    assert sorted(got) == sorted(want), where
                    for key in want:
                        np.testing.assert_allclose(
                            got[key],
                            want[key],
                            err_msg=f"{where}: {key}",
                            **TOL,
                        )

"""Quantized training on 2 processes (issue 47), beside the feature
matrix's rows (test_training_features.py: float8, int8 / int4 + LoRA fit
against one process): what a rank holds under FSDP with int8 kernels,
where LoRA factors live, and the refusals.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

WIDTH, LAYERS, ROWS = 64, 4, 16


class _LiveBytes:
    """Bytes of the storages the ops inside the block create, while alive,
    by dtype: those alive at the block's peak (`at_peak`)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tracker._forget_freed()
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode = Mode()
        self.live = {}  # storage key -> (weak ref, bytes, dtype)
        self.total = 0
        self.peak = 0
        self.at_peak = {}

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def _forget_freed(self):
        for key in [k for k, entry in self.live.items() if entry[0].expired()]:
            self.total -= self.live.pop(key)[1]

    def _record(self, out):
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if isinstance(leaf, DTensor):
                leaf = leaf._local_tensor
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = leaf.untyped_storage()
            key = storage._cdata
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = (
                StorageWeakRef(storage),
                storage.nbytes(),
                str(leaf.dtype),
            )
            self.total += storage.nbytes()
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {}
            for _, nbytes, dtype in self.live.values():
                self.at_peak[dtype] = self.at_peak.get(dtype, 0) + nbytes


def _int8_lora_step(keras_call):
    """A stack of LAYERS Dense(WIDTH) under FSDP on a (2, 1) mesh (each
    kernel sharded on the batch axis: one FSDP group per layer), quantized
    to int8 with LoRA: the bytes alive at one train step's peak, by dtype,
    and the losses of 3 steps. `keras_call`: Keras' own `_int8_call`
    (whose custom gradient keeps the gathered kernel) instead of the
    package's."""
    from keras_torch_distribution import _install

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for i in range(LAYERS):
        layout_map[f"d{i}/kernel"] = ("batch", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(WIDTH, name=f"d{i}", use_bias=False)(x)
    model = keras.Model(inputs, x)
    model.quantize("int8")
    for i in range(LAYERS):
        model.get_layer(f"d{i}").enable_lora(4)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, WIDTH)).astype("float32")
    y = rng.normal(size=(ROWS, WIDTH)).astype("float32")
    patch = next(
        p for p in _install._installed if p.describe() == "Dense._int8_call"
    )
    ours = patch.owner.__dict__["_int8_call"]
    if keras_call:
        setattr(patch.owner, "_int8_call", patch.original)
    try:
        losses = [float(model.train_on_batch(x, y)) for _ in range(2)]
        with _LiveBytes() as live:
            losses.append(float(model.train_on_batch(x, y)))
    finally:
        setattr(patch.owner, "_int8_call", ours)
    kernel = model.get_layer("d0")._kernel
    return dict(
        losses=losses,
        int8_at_peak=live.at_peak.get("torch.int8", 0),
        peak=live.peak,
        kernel_block_bytes=kernel.value.to_local().nbytes
        if hasattr(kernel.value, "to_local")
        else None,
    )


def _both(_):
    import helpers

    return helpers.each_case(
        ["package", "keras"],
        lambda name: _int8_lora_step(keras_call=name == "keras"),
    )


def test_fsdp_int8_keeps_one_gathered_kernel_not_every_layers(pool2):
    """Under FSDP, Keras' int8 call kept every layer's gathered int8 kernel
    from its forward to its backward (3 of the 4 alive at the step's
    peak); the package's holds one layer's at the peak (the group in use),
    with the same losses. The rank's int8 blocks (half a kernel each) are
    its own storage, not made by the step."""
    kernel = WIDTH * WIDTH  # int8 bytes of one whole kernel
    for rank, result in enumerate(pool2.run(_both, None)):
        for name, case in result.items():
            assert not isinstance(case, tuple), f"{name}: {case[1]}\n{case[2]}"
        ours, keras_own = result["package"], result["keras"]
        assert ours["kernel_block_bytes"] == kernel // 2, rank
        assert ours["int8_at_peak"] == kernel, (rank, ours)
        assert keras_own["int8_at_peak"] >= 3 * kernel, (rank, keras_own)
        np.testing.assert_allclose(
            ours["losses"], keras_own["losses"], rtol=1e-6
        )


def _lora_placements(kind):
    """LoRA factors' placements (mesh order) under `kind`'s mesh and the
    feature matrix's layout map (test_training_features.RULES), int8."""
    import test_training_features as features

    features._distribute(kind)
    model = features._mlp()
    model.quantize("int8")
    for name in ("hidden", "proj", "out"):
        model.get_layer(name).enable_lora(2)
    placements = {}
    for variable in model.weights:
        value = variable.value
        placements[variable.path] = (
            tuple(str(p) for p in value.placements)
            if hasattr(value, "placements")
            else "whole"
        )
    keras.distribution.set_distribution(None)
    return placements


def test_lora_factors_are_laid_out_along_the_kernels_dims(pool2):
    """`enable_lora` under the feature matrix's layout map, which has keys
    for the kernels only: `a` takes the kernel's layout but its last dim,
    `b` the kernel's last dim; the int8 kernels keep the float kernels'
    layout. (1, 2) mesh: `hidden/kernel` ("batch", "model") is
    column-parallel, `proj/kernel` ("model", "batch") row-parallel."""
    placements = pool2.run(_lora_placements, "tp")[0]
    assert placements["hidden/kernel"] == ("R", "S(1)")
    assert placements["hidden/lora_kernel_a"] == "whole"
    assert placements["hidden/lora_kernel_b"] == (
        "R",
        "S(1)",
    )
    assert placements["proj/kernel"] == ("R", "S(0)")
    assert placements["proj/lora_kernel_a"] == ("R", "S(0)")
    assert placements["proj/lora_kernel_b"] == "whole"
    assert placements["out/lora_kernel_a"] == "whole"  # a size-1 batch axis
    placements = pool2.run(_lora_placements, "fsdp")[0]
    assert placements["out/kernel"] == ("S(0)", "R")
    assert placements["out/lora_kernel_a"] == ("S(0)", "R")
    assert placements["out/lora_kernel_b"] == "whole"


def _amax_history_on_batch_axis(_):
    import test_training_features as features

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/inputs_amax_history"] = ("batch",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    model = features._mlp()
    model.quantize("float8")
    model.compile(optimizer="adam", loss="mse")
    x, y = features._data()
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except ValueError as error:
        return str(error)
    finally:
        keras.distribution.set_distribution(None)
    return None


def test_an_amax_history_sharded_on_the_batch_axis_is_refused(pool2):
    """Its new value is the maximum over the replicas, which FSDP's
    reduce-scatter (a sum) cannot give: every rank raises, naming it."""
    for message in pool2.run(_amax_history_on_batch_axis, None):
        assert message is not None
        assert "'hidden/inputs_amax_history'" in message
        assert "remove the LayoutMap key" in message


def _int8_model(mode):
    """Dense(64) x 2 built quantized (the dtype policy a quantized preset's
    config carries), as `from_preset` of a quantized model builds it."""
    keras.utils.set_random_seed(0)
    policy = keras.dtype_policies.get(f"{mode}_from_float32")
    inputs = keras.Input((WIDTH,))
    x = keras.layers.Dense(WIDTH, name="d0", dtype=policy)(inputs)
    x = keras.layers.Dense(WIDTH, name="d1", dtype=policy)(x)
    return keras.Model(inputs, x)


def _load_quantized(path, mode):
    """Under FSDP on a (2,) mesh: the int8 / int4 kernels born sharded
    (nothing whole made), the weights file's blocks read, predictions."""
    import helpers
    from keras_torch_distribution._distributed import stored_values

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d.*/kernel"] = ("batch", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    try:
        with helpers.Allocations() as made:
            model = _int8_model(mode)
        kernel = model.get_layer("d0")._kernel.value
        stored_values.reads.clear()
        model.load_weights(path)
        x = np.random.default_rng(1).normal(size=(8, WIDTH)).astype("float32")
        return dict(
            placements=tuple(str(p) for p in kernel.placements),
            dtype=str(kernel.dtype),
            local_bytes=kernel.to_local().nbytes,
            largest_made=made.largest("cpu"),
            largest_read=stored_values.reads.largest,
            predictions=np.asarray(model.predict(x, verbose=0)),
        )
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_weights_file_loads_born_sharded(pool2, tmp_path, mode):
    """A model built quantized under FSDP (its kernels int8 blocks, or int4
    packed in int8, laid out by the float kernels' keys) loads a quantized
    weights file block by block: no whole kernel made or read on a rank,
    predictions equal to one process's."""
    model = _int8_model(mode)
    path = str(tmp_path / f"{mode}.weights.h5")
    rng = np.random.default_rng(0)
    for layer in model.layers[1:]:
        kernel = layer._kernel
        low, high = (-127, 128) if mode == "int8" else (-128, 128)
        kernel.assign(rng.integers(low, high, kernel.shape).astype("int8"))
    model.save_weights(path)
    x = np.random.default_rng(1).normal(size=(8, WIDTH)).astype("float32")
    expected = np.asarray(model.predict(x, verbose=0))
    whole = int(np.prod(model.get_layer("d0")._kernel.shape))
    for result in pool2.run(_load_quantized, path, mode):
        assert result["placements"] == ("S(0)",)
        assert result["dtype"] == "torch.int8"
        assert result["local_bytes"] == whole // 2
        assert result["largest_made"] < whole
        assert result["largest_read"] == whole // 2
        np.testing.assert_allclose(
            result["predictions"], expected, rtol=1e-6, atol=1e-6
        )

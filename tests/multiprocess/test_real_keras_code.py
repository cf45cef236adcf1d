"""Keras code written for JAX, on 2 processes: layouts shorter than their
tensors, uneven einsum kernels, every Keras file writer, and the small
errors and outputs users meet first."""

import contextlib
import io
import os

import numpy as np
import pytest


def _attention_model():
    import keras

    keras.utils.set_random_seed(4)
    inputs = keras.Input((5, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    x = keras.layers.Dense(8, name="dense")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(8, 5, 8)).astype("float32"), rng.normal(
        size=(8, 5, 3)
    ).astype("float32")


SHORT_RULES = [
    # JAX reads (None, "model") as a prefix of the rank-3 attention kernels;
    # ".*bn.*" matches gamma/beta/moving_* and the layer's output, bn/output.
    {".*kernel": (None, "model"), ".*bn.*": ("model",)},
    # A plain (not sharded) output laid out on its rows.
    {".*bn/output": ("model",)},
]


def short_layouts(rules):
    """A LayoutMap with layouts shorter than the tensors they match."""
    import keras
    from torch.distributed.tensor import DTensor

    distributed = rules is not None
    if distributed:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (1, 2), ["batch", "model"], devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        for pattern, axes in rules.items():
            layout_map[pattern] = axes
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
    model = _attention_model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    losses = model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
    ).history["loss"]
    query = model.get_layer("mha")._query_dense.kernel
    value = query.value
    return {
        "losses": losses,
        "predict": model.predict(x, verbose=0),
        "query_local": tuple(value.to_local().shape)
        if isinstance(value, DTensor)
        else None,
        "query_axes": getattr(query._ktd_layout, "axes", None)
        if distributed
        else None,
    }


@pytest.mark.parametrize(
    "rules", SHORT_RULES, ids=["kernels_and_bn", "bn_output"]
)
def test_short_layouts_are_prefixes_as_on_jax(pool2, rules):
    import keras

    keras.backend.clear_session()
    want = short_layouts(None)
    for got in pool2.run(short_layouts, rules):
        np.testing.assert_allclose(
            got["losses"], want["losses"], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            got["predict"], want["predict"], rtol=1e-5, atol=1e-5
        )
        if ".*kernel" in rules:
            # query kernel (8, 2 heads, 4): (None, "model") shards the heads.
            assert got["query_local"] == (8, 1, 4)
            assert tuple(got["query_axes"]) == (None, "model")


def uneven_einsum(heads, distributed=True):
    """An EinsumDense kernel of `heads` heads sharded over the 2 processes
    (or, with distributed=False, in one process): its output, and its
    kernel after one fit step."""
    import keras

    from keras_torch_distribution import _log

    keras.distribution.set_distribution(None)
    if distributed:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((2,), ["model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*heads/kernel"] = (None, "model", None)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    keras.utils.set_random_seed(2)
    records = []
    handler = _ListHandler(records)
    _log.logger.addHandler(handler)
    try:
        inputs = keras.Input((5, 8))
        outputs = keras.layers.EinsumDense(
            "btd,dnh->btnh", output_shape=(None, heads, 4), name="heads"
        )(inputs)
        model = keras.Model(inputs, outputs)
        x = np.linspace(-1, 1, 2 * 5 * 8, dtype="float32").reshape(2, 5, 8)
        y = np.ones((2, 5, heads, 4), "float32")
        output = keras.ops.convert_to_numpy(model(x))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        result = (output, np.asarray(model.get_layer("heads").kernel))
    finally:
        _log.logger.removeHandler(handler)
        keras.distribution.set_distribution(None)
    return result, records


class _ListHandler:
    level = 0

    def __init__(self, records):
        self.records = records

    def handle(self, record):
        self.records.append(record.getMessage())


def test_uneven_einsum_kernels(pool2):
    # 1 head over 2 processes (keras_hub's Gemma test config, 1 key/value
    # head): replicated, with a warning. 3 heads over 2: sharded unevenly
    # (2 + 1). Both give one process's output and fit step.
    for heads in (1, 3):
        (want_output, want_kernel), _ = uneven_einsum(heads, distributed=False)
        for rank, ((output, kernel), records) in enumerate(
            pool2.run(uneven_einsum, heads)
        ):
            where = f"{heads} heads, rank {rank}"
            np.testing.assert_allclose(
                output, want_output, rtol=1e-6, atol=1e-6, err_msg=where
            )
            np.testing.assert_allclose(
                kernel, want_kernel, rtol=1e-6, atol=1e-6, err_msg=where
            )
            replicated = any(
                (
                    "splits dims [1] over more processes than they have "
                    "entries, so they are replicated instead (layout (None, "
                    "None, None))"
                )
                in r
                for r in records
            )
            assert replicated == (heads == 1 and rank == 0), (where, records)


def keras_file_writers(directory):
    """Keras' weight stores, opened for writing by every rank at one path."""
    import keras
    from keras.src.saving import (
        saving_lib,
    )  # the stores keras_hub writes through

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    h5_path = os.path.join(directory, "direct.h5")
    store = saving_lib.H5IOStore(h5_path, mode="w")
    store.make("group")["value"] = np.arange(4.0)
    store.close()
    # Right after close, every rank reads rank 0's complete file.
    reader = saving_lib.H5IOStore(h5_path, mode="r")
    h5_value = np.asarray(reader.get("group")["value"])
    reader.close()
    if hasattr(saving_lib, "NpzIOStore"):  # Keras 3.15 (gone in 3.16)
        npz = saving_lib.NpzIOStore(
            os.path.join(directory, "direct.npz"), mode="w"
        )
        npz.make("group")["value"] = np.arange(3.0)
        npz.close()
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="d")]
    )
    model.save_weights(
        os.path.join(directory, "sharded.weights.json"), max_shard_size=0.0001
    )
    fresh = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="d")]
    )
    fresh.load_weights(os.path.join(directory, "sharded.weights.json"))
    same = all(
        np.array_equal(a, b)
        for a, b in zip(model.get_weights(), fresh.get_weights())
    )
    return h5_value, same, sorted(os.listdir(directory))


def test_every_keras_weight_store_writes_once(pool2, tmp_path):
    import tempfile

    from keras_torch_distribution import _keras

    has_npz = any(c.__name__ == "NpzIOStore" for c in _keras.KERAS_FILE_STORES)
    before = set(os.listdir(tempfile.gettempdir()))
    for h5_value, same, names in pool2.run(keras_file_writers, str(tmp_path)):
        np.testing.assert_array_equal(h5_value, np.arange(4.0))
        assert same
        assert "direct.h5" in names and "sharded.weights.json" in names
        assert ("direct.npz" in names) == has_npz
        assert all(n.startswith(("direct.", "sharded")) for n in names), names
    leftovers = {
        n
        for n in set(os.listdir(tempfile.gettempdir())) - before
        if n.startswith("ktd-discard-")
    }
    assert not leftovers


def small_things():
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    from keras_torch_distribution._backend import distribution_lib

    out = {}
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    try:
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="nope"
        )
    except ValueError as error:
        out["batch_dim_name"] = str(error)
    try:
        keras.distribution.DataParallel(devices=devices[:1])
    except ValueError as error:
        out["one_device"] = str(error)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.summary()
    out["summary_printed"] = bool(printed.getvalue().strip())
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    out["summary_collected"] = bool(lines)
    dp = keras.distribution.DataParallel()
    local = torch.arange(6.0).reshape(3, 2) + 10 * torch.distributed.get_rank()
    rows = distribution_lib.distribute_data_input(
        local, dp.get_data_layout((6, 2)), "batch"
    )
    out["data_input"] = (isinstance(rows, DTensor), rows.numpy())
    return out


def test_small_things_users_meet_first(pool2):
    for rank, out in enumerate(pool2.run(small_things)):
        assert out["batch_dim_name"] == (
            "ModelParallel(batch_dim_name='nope'): the mesh has no axis "
            "'nope'; its axes are ['batch', 'model']. Pass batch_dim_name= one "
            "of them (the data-parallel axis), or name that axis so in the "
            "DeviceMesh."
        )
        assert out["one_device"].startswith(
            "DeviceMesh shape=(1,) has 1 devices, but 2 processes run. The "
            "mesh must cover every process"
        )
        assert out["summary_printed"] == (rank == 0)
        assert out["summary_collected"]
        is_dtensor, rows = out["data_input"]
        assert not is_dtensor
        np.testing.assert_array_equal(
            rows, np.arange(6.0).reshape(3, 2) + 10 * rank
        )


@pytest.mark.parametrize("axes", [("batch", None, None, None)])
def test_layouts_longer_than_the_tensor_are_refused(axes):
    from torch.distributed.tensor import Shard

    from keras_torch_distribution._distributed import layouts

    layout = layouts.TorchLayout(mesh=None, placements=(Shard(0),), axes=axes)
    with pytest.raises(
        ValueError, match=r"have 4 entries, but the tensor has shape \(2, 3\)"
    ):
        layouts.check_rank(layout, (2, 3), "the tensor")
    layouts.check_rank(
        layouts.TorchLayout(None, (Shard(0),), ("batch",)), (2, 3), "x"
    )

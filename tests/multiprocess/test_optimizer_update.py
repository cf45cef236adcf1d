"""The package's Adam update (`optimizer_update.adam_update`, in place on
local blocks) gives bit for bit the numbers of Keras' own torch Adam update,
in one process and on sharded variables on 2 ranks."""

import numpy as np
import pytest

SHAPES = [(6, 4), (4,), (4, 6), (6,)]


def _defining_class(optimizer):
    return next(
        cls
        for cls in type(optimizer).__mro__
        if "_parallel_update_step" in cls.__dict__
    )


def _run_steps(make_optimizer, use_keras_original, layout=None, steps=3):
    """Apply `steps` updates with fixed gradients; the variables' (local)
    values, and the moment slots', after each step."""
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    rng = np.random.default_rng(0)
    variables = []
    for i, shape in enumerate(SHAPES):
        value = rng.normal(size=shape).astype("float32")
        variables.append(keras.Variable(value, name=f"v{i}"))
    grads_per_step = [
        [rng.normal(size=shape).astype("float32") for shape in SHAPES]
        for _ in range(steps)
    ]
    optimizer = make_optimizer()
    optimizer.build(variables)
    owner = _defining_class(optimizer)
    patched = owner.__dict__["_parallel_update_step"]
    if use_keras_original:
        owner._parallel_update_step = patched.__wrapped__
    try:
        history = []
        for grads in grads_per_step:
            tensors = []
            for g, v in zip(grads, variables):
                g = torch.as_tensor(g)
                stored = v.value
                if isinstance(stored, DTensor):
                    g = layout(g, stored)
                tensors.append(g)
            optimizer.apply(tensors, variables)

            def local(t):
                t = t.value if hasattr(t, "value") else t
                return (
                    (t.to_local() if isinstance(t, DTensor) else t)
                    .detach()
                    .clone()
                    .numpy()
                )

            history.append(
                [local(v) for v in variables + list(optimizer.variables)]
            )
    finally:
        owner._parallel_update_step = patched
    return history


def _optimizers():
    import keras

    return {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.5),
    }


def _assert_bit_equal(ours, theirs):
    for step, (a_step, b_step) in enumerate(zip(ours, theirs)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            assert a.shape == b.shape
            assert np.array_equal(a, b), (
                f"step {step}, tensor {i}: max diff {np.abs(a - b).max()}"
            )


@pytest.mark.parametrize("path", ["one_by_one", "foreach_chunks"])
@pytest.mark.parametrize("kind", ["adam", "amsgrad", "adamw", "adam_clipnorm"])
def test_adam_update_is_bit_identical_to_keras(kind, path, monkeypatch):
    """Both paths: one variable at a time (CPU) and foreach chunks (CUDA;
    chunks of at most 120 bytes here, so that the four variables make two
    chunks)."""
    import torch

    from keras_torch_distribution._training import optimizer_update

    if path == "foreach_chunks":
        monkeypatch.setattr(
            optimizer_update, "_use_foreach", lambda value: True
        )
        monkeypatch.setattr(optimizer_update, "FOREACH_CHUNK_BYTES", 120)
        sizes = [
            len(c)
            for c in optimizer_update._chunks(
                [[torch.zeros(shape)] for shape in SHAPES]
            )
        ]
        assert sizes == [2, 2], sizes
    make = _optimizers()[kind]
    _assert_bit_equal(_run_steps(make, False), _run_steps(make, True))


def sharded_adam_histories(kind):
    """On each rank: variables sharded on a ("model",) mesh (rows, columns,
    a replicated bias), Adam through the package and through Keras' own
    update (DTensor foreach ops)."""
    import keras
    from torch.distributed.tensor import distribute_tensor

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["v0"] = ("model", None)
    layout_map["v1"] = ("model",)
    layout_map["v2"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )

    def layout(g, like):
        return distribute_tensor(g, like.device_mesh, like.placements)

    try:
        make = _optimizers()[kind]
        ours = _run_steps(make, False, layout)
        theirs = _run_steps(make, True, layout)
    finally:
        keras.distribution.set_distribution(None)
    return ours, theirs


@pytest.mark.parametrize("kind", ["adam", "amsgrad"])
def test_sharded_adam_update_is_bit_identical_to_keras(pool2, kind):
    for rank, (ours, theirs) in enumerate(
        pool2.run(sharded_adam_histories, kind)
    ):
        assert ours[0][0].shape == (SHAPES[0][0] // 2, SHAPES[0][1]), (
            f"rank {rank}"
        )
        _assert_bit_equal(ours, theirs)

"""Whole values of sharded variables are assembled in host memory (GPU
audit M6): `get_weights` / `np.asarray(variable)` and `.keras` saves gather
each rank's block to the CPU (`tensors.host_value`), never a whole variable
on a device (no DTensor redistribute to Replicate runs: it is refused here);
`set_weights` with numpy values slices them on the host. The numbers are
those given, on every rank, and a one-process Keras loads the saved file.
"""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow

# Uneven on purpose: 7 columns and 7 rows over 2 ranks are blocks of 4 and 3.
RULES = {
    r".*dense.*kernel": (None, "model"),
    r".*dense.*bias": ("model",),
    r".*out.*kernel": ("model", None),
}


def _values():
    return [
        np.arange(5 * 7, dtype="float32").reshape(5, 7) / 10,
        np.arange(7, dtype="float32") - 3,
        np.arange(7 * 3, dtype="float32").reshape(7, 3) / 4,
        np.array([0.5, -1.0, 2.0], dtype="float32"),
    ]


def _set_get_and_save(path):
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    from helpers import model_parallel

    keras.distribution.set_distribution(
        model_parallel(keras.distribution.list_devices(), RULES)
    )
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, name="dense"),
            keras.layers.Dense(3, name="out", dtype="bfloat16"),
        ]
    )
    sharded = [isinstance(v.value, DTensor) for v in model.weights]
    model.set_weights(_values())
    local_shapes = [
        tuple(v.value.to_local().shape)
        if isinstance(v.value, DTensor)
        else None
        for v in model.weights
    ]
    redistribute = DTensor.redistribute

    def refused(*args, **kwargs):
        raise AssertionError(
            "a sharded variable was gathered whole on the device"
        )

    DTensor.redistribute = refused
    try:
        weights = model.get_weights()
        array = np.asarray(model.weights[0])
        model.save(path)
    finally:
        DTensor.redistribute = redistribute
    return {
        "sharded": sharded,
        "local_shapes": local_shapes,
        "weights": [np.asarray(w, dtype="float32") for w in weights],
        "array": array,
        "torch": torch.__version__,
    }


def test_whole_values_are_assembled_on_the_host(pool2, tmp_path):
    import keras

    path = str(tmp_path / "model.keras")
    results = pool2.run(_set_get_and_save, path)
    expected = _values()  # exact in bfloat16 too
    for rank, result in enumerate(results):
        assert result["sharded"] == [True, True, True, False]
        assert result["local_shapes"][:3] == (
            [(5, 4), (4,), (4, 3)] if rank == 0 else [(5, 3), (3,), (3, 3)]
        )
        for got, want in zip(result["weights"], expected):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(result["array"], expected[0])
    loaded = keras.saving.load_model(path)
    for got, want in zip(loaded.get_weights(), expected):
        np.testing.assert_array_equal(np.asarray(got, dtype="float32"), want)
    assert os.listdir(tmp_path) == ["model.keras"]

"""Layer outputs named in the LayoutMap (`<layer path>/output`) are
relayouted, with the numbers of one process."""

import numpy as np
import pytest


def _model():
    import keras

    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="col")(inputs)
    outputs = keras.layers.Dense(3, name="row")(h)
    return keras.Model(inputs, outputs, name="net")


def forward_and_grads(output_axes, pure_tensor_parallel=False):
    import keras

    if output_axes is not None:
        devices = keras.distribution.list_devices()
        if pure_tensor_parallel:  # a batch axis of size 1
            mesh = keras.distribution.DeviceMesh(
                (1, len(devices)), ["batch", "model"], devices
            )
        else:  # the one axis is also the batch axis: FSDP, rows split
            mesh = keras.distribution.DeviceMesh(
                (len(devices),), ["model"], devices
            )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*col/kernel"] = (None, "model")
        layout_map[".*row/kernel"] = ("model", None)
        layout_map[".*col/output"] = tuple(output_axes)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name=mesh.axis_names[0]
            )
        )
    model = _model()
    x = np.random.default_rng(2).normal(size=(4, 6)).astype("float32")
    out = model(x)
    out.sum().backward()
    grads = [
        np.asarray(keras.ops.convert_to_numpy(v.value.grad))
        for v in model.trainable_weights
    ]
    keras.distribution.set_distribution(None)
    return np.asarray(out.detach()), grads


@pytest.mark.parametrize(
    "pure_tensor_parallel", [False, True], ids=["1d", "1x2"]
)
@pytest.mark.parametrize(
    "axes", [(None, None), (None, "model"), ("model", None)]
)
def test_output_relayout_keeps_one_process_numbers(
    pool2, axes, pure_tensor_parallel
):
    ref_out, ref_grads = forward_and_grads(None)
    for out, grads in pool2.run(forward_and_grads, axes, pure_tensor_parallel):
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)

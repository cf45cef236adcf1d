"""Train one Keras model with DataParallel, then with ModelParallel.

Run on 2 local CPU processes:  ktd run -n 2 examples/demo.py
(or: torchrun --nproc-per-node 2 examples/demo.py)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402

keras.distribution.initialize()

devices = keras.distribution.list_devices()


def say(*args):
    if ktd.process_id() == 0:
        print(*args, flush=True)


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu", name="up"),
            keras.layers.Dense(32, name="down"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 32)).astype("float32")
y = np.tanh(x @ rng.normal(size=(32, 32)).astype("float32") / 4)

say(f"devices: {devices}")

# DataParallel: every process holds the whole model and half of each batch.
keras.distribution.set_distribution(keras.distribution.DataParallel())
model = make_model()
history = model.fit(x, y, batch_size=128, epochs=3, verbose=0)
say(
    "DataParallel loss per epoch:",
    [round(v, 4) for v in history.history["loss"]],
)

# ModelParallel: "up" is stored sharded on its columns, "down" on its rows.
# On a 1-D mesh the one axis is also the batch axis (as on JAX): each process
# still computes on its half of every batch, and the sharded kernels are
# gathered for use (FSDP). A ("batch", "model") mesh of shape (1, N) gives
# pure tensor parallelism instead; the losses are the same either way.
mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*up/kernel"] = (None, "model")
layout_map[".*up/bias"] = ("model",)
layout_map[".*down/kernel"] = ("model", None)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map)
)
model = make_model()
history = model.fit(x, y, batch_size=128, epochs=3, verbose=0)
say(
    "ModelParallel loss per epoch:",
    [round(v, 4) for v in history.history["loss"]],
)
ktd.report(model, print_fn=say)

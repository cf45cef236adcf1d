"""What the README's demo and the checkpoint example do, then a plain exit
with an async save never completed with .result(): every rank must exit 0
and the save must be complete (tests/e2e/test_clean_exit.py).

    ktd run -n 2 tests/scripts/train_save_exit.py CHECKPOINT_DIR
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402
from keras_torch_distribution import checkpoint  # noqa: E402

directory = sys.argv[1]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = x[:, :4] * 2.0


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


# DataParallel: the bucketed gradient all-reduce, overlapped with backward.
keras.distribution.set_distribution(keras.distribution.DataParallel())
make_model().fit(x, y, batch_size=32, epochs=1, verbose=0)

# ModelParallel on a 1-D mesh: FSDP gathers, sharded checkpoints.
mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*out/kernel"] = ("model", None)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map)
)
model = make_model()
model.fit(
    x,
    y,
    batch_size=32,
    epochs=2,
    verbose=0,
    callbacks=[
        checkpoint.ShardedCheckpoint(os.path.join(directory, "every-epoch"))
    ],
)
ktd.report(model, print_fn=lambda *args: None)
checkpoint.async_save(
    model, os.path.join(directory, "at-exit"), extra={"epoch": 2}
)
if ktd.process_id() == 0:
    print("trained and saved; exiting without .result()", flush=True)

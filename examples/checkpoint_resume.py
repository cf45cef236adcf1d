"""Train with sharded checkpoints every epoch; run it again to resume.

    ktd run -n 2 examples/checkpoint_resume.py /tmp/ktd-ckpt 4
    ktd report /tmp/ktd-ckpt/ckpt-<step>      # what each rank wrote

The first run trains 2 of the 4 epochs (it stops itself, as a crash would);
the second run restores the newest checkpoint and trains epochs 3 and 4.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402
from keras_torch_distribution import checkpoint  # noqa: E402

directory, epochs = sys.argv[1], int(sys.argv[2])
keras.distribution.initialize()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*out/kernel"] = ("model", None)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map)
)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="hidden"),
        keras.layers.Dense(4, name="out"),
    ]
)
model.compile(keras.optimizers.Adam(1e-2), "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = x[:, :4] * 2.0


class StopAfterTwoEpochs(keras.callbacks.Callback):
    """Stands in for a crash in the first run."""

    def on_epoch_end(self, epoch, logs=None):
        if not resumed and epoch == 1:
            self.model.stop_training = True


resumed = checkpoint.latest(directory) is not None
history = model.fit(
    x,
    y,
    batch_size=32,
    epochs=epochs,
    verbose=0,
    callbacks=[
        checkpoint.ShardedCheckpoint(directory, restore=True),
        StopAfterTwoEpochs(),
    ],
)
if ktd.process_id() == 0:
    print(
        f"{'resumed' if resumed else 'first run'}: epochs {history.epoch}, "
        f"loss {[round(v, 5) for v in history.history['loss']]}",
        flush=True,
    )

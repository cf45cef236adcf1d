"""Data parallelism: a classifier trained on 2 processes, each holding the
whole model and half of every global batch.

    ktd run -n 2 examples/data_parallel_classifier.py

`batch_size` is the global batch; gradients are averaged over the processes,
so history, evaluate and predict give what one process training on the
global batch would. The data is synthetic (no download): points drawn
around 4 class centres in 16 dimensions.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402

keras.distribution.initialize()  # torchrun's environment (set by `ktd run`)
keras.distribution.set_distribution(keras.distribution.DataParallel())


def say(*args):
    if ktd.process_id() == 0:  # every rank has the same numbers
        print(*args, flush=True)


CLASSES, FEATURES = 4, 16
rng = np.random.default_rng(0)
centres = rng.normal(scale=1.0, size=(CLASSES, FEATURES)).astype("float32")
labels = rng.integers(0, CLASSES, size=4096)
x = (centres[labels] + rng.normal(size=(4096, FEATURES))).astype("float32")
x_train, y_train, x_test, y_test = (
    x[:3584],
    labels[:3584],
    x[3584:],
    labels[3584:],
)

keras.utils.set_random_seed(0)  # the same initial model on every process
model = keras.Sequential(
    [
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES),
    ]
)
model.compile(
    keras.optimizers.Adam(1e-3),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
history = model.fit(
    x_train, y_train, batch_size=256, epochs=4, validation_split=0.1, verbose=0
)
say("loss per epoch:", [round(v, 4) for v in history.history["loss"]])
say(
    "val_accuracy per epoch:",
    [round(v, 4) for v in history.history["val_accuracy"]],
)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
predictions = model.predict(
    x_test, batch_size=256, verbose=0
)  # every row, every rank
say(
    f"test loss {loss:.4f} accuracy {accuracy:.4f} predictions "
    f"{predictions.shape}"
)

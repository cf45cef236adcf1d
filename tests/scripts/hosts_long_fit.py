"""A DataParallel fit that runs until it is stopped from outside.

    ktd run ... hosts_long_fit.py MARKER

tests/hosts/test_hosts.py cuts a host off once MARKER exists (written by
rank 0 after its third batch); each batch takes at least 0.2 s.
"""

import sys
import time

import keras
import numpy as np

import keras_torch_distribution  # noqa: F401

keras.distribution.initialize()
keras.distribution.set_distribution(keras.distribution.DataParallel())
model = keras.Sequential(
    [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(2)]
)
model.compile("sgd", "mse")
x, y = np.zeros((64, 6), "float32"), np.zeros((64, 2), "float32")


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2 and keras_torch_distribution.process_id() == 0:
            open(sys.argv[1], "w").close()
        time.sleep(0.2)


model.fit(x, y, batch_size=16, epochs=10_000, verbose=0, callbacks=[Slow()])

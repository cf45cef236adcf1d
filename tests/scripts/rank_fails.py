"""Rank 1 fails while rank 0 trains on: the job must not hang.

`rank_fails.py raise`: rank 1 raises after its first epoch; torchrun stops
rank 0 and names rank 1. `rank_fails.py stall MARKER`: rank 1 stops
answering (it sleeps) instead of training; rank 0's first collective of
`fit` times out after KTD_TIMEOUT_SECONDS. Run by tests/e2e/test_launch.py
(`ktd run`) and tests/e2e/test_clusters.py (processes started by
initialize()).
"""

import os
import sys
import time

import keras
import numpy as np

import keras_torch_distribution  # noqa: F401  (also run without `ktd run`)

if sys.argv[1] == "stall":  # under `ktd run`: RANK is set before initialize()
    # KTD_TIMEOUT_SECONDS (a few seconds here) also bounds initialize()'s
    # wait for the other rank: rank 0 starts it once rank 1 is about to, so
    # that a slow start (imports on a loaded machine) is not the timeout
    # this tests.
    marker = sys.argv[2]
    if os.environ["RANK"] == "1":
        open(marker, "w").close()
    deadline = time.monotonic() + 240
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise SystemExit("rank 1 never reached initialize()")
        time.sleep(0.05)
keras.distribution.initialize()
keras.distribution.set_distribution(keras.distribution.DataParallel())
RANK = int(os.environ["RANK"])


class FailOnRank1(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if RANK == 1 and epoch == 0:
            raise RuntimeError("deliberate failure on rank 1 after epoch 1")


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
x = np.ones((64, 4), "float32")
if sys.argv[1] == "stall" and RANK == 1:
    time.sleep(300)  # stopped by torchrun once rank 0 fails
model.fit(
    x, x[:, :2], batch_size=8, epochs=1000, verbose=0, callbacks=[FailOnRank1()]
)
print("rank", RANK, "finished training: the failure was not seen", flush=True)

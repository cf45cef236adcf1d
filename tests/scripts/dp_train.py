"""Train a small model with DataParallel and print its final numbers.

Run by tests/e2e/test_launch.py on 2 processes of one node and on 2 simulated
nodes x 1 process: both runs must print the same numbers. With
`--without-initialize` it is written as single-host JAX scripts are: it
never calls keras.distribution.initialize() and lists the devices first.
tests/e2e/test_clusters.py runs it as each scheduler starts processes
(plain `python dp_train.py` with SLURM's, Open MPI's, PMI's variables).
"""

import os
import sys

import keras
import numpy as np

import keras_torch_distribution

if "--without-initialize" in sys.argv:
    print(
        (
            f"rank={os.environ.get('RANK')} "
            f"devices={keras.distribution.list_devices()}"
        ),
        flush=True,
    )
else:
    keras.distribution.initialize()
keras.distribution.set_distribution(keras.distribution.DataParallel())
keras.utils.set_random_seed(7)
model = keras.Sequential(
    [
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(2),
    ]
)
model.compile(keras.optimizers.SGD(0.1), "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = rng.normal(size=(64, 2)).astype("float32")
history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
rank = keras_torch_distribution.process_id()
weights = [
    float(np.asarray(w, dtype="float64").sum()) for w in model.get_weights()
]
print(
    f"rank={rank} world={keras.distribution.DataParallel().num_processes} "
    f"losses={[round(v, 6) for v in history.history['loss']]} "
    f"weight_sums={[round(v, 6) for v in weights]}",
    flush=True,
)

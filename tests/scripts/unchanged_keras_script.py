"""A Keras distribution script as written for JAX: it never imports
keras_torch_distribution. `ktd run` makes it run on torch."""

import keras
import numpy as np

keras.distribution.initialize()
keras.distribution.set_distribution(keras.distribution.DataParallel())
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
x = np.arange(64, dtype="float32").reshape(16, 4) / 64
history = model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=0)
rank = keras.distribution.DataParallel().num_processes
print(
    f"processes={rank} backend={keras.backend.backend()} "
    f"loss={history.history['loss'][-1]:.6f}",
    flush=True,
)

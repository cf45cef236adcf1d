"""Data and tensor parallelism together: a 2 x 2 mesh over 4 processes.

    ktd run -n 4 examples/hybrid_2d_mesh.py

The mesh has a "batch" axis (2 data-parallel replicas, each seeing half of
every global batch) and a "model" axis (inside each replica, 2 processes
share every sharded variable, Megatron style: the first Dense column-
parallel, the second row-parallel). Processes 0 and 1 form replica 0,
processes 2 and 3 replica 1; gradients are averaged over the replicas.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402

keras.distribution.initialize()
devices = keras.distribution.list_devices()
if len(devices) % 2:
    raise SystemExit(
        "hybrid_2d_mesh.py needs an even number of processes (got "
        f"{len(devices)}): run it with `ktd run -n 4 "
        "examples/hybrid_2d_mesh.py`."
    )
mesh = keras.distribution.DeviceMesh(
    (len(devices) // 2, 2), ["batch", "model"], devices
)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[r".*up/kernel"] = (None, "model")  # column-parallel
layout_map[r".*up/bias"] = ("model",)
layout_map[r".*down/kernel"] = ("model", None)  # row-parallel
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
)


def say(*args):
    if ktd.process_id() == 0:
        print(*args, flush=True)


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 32)).astype("float32")
y = np.tanh(x @ rng.normal(size=(32, 8)).astype("float32") / 4)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [
        keras.Input((32,)),
        keras.layers.Dense(128, activation="relu", name="up"),
        keras.layers.Dense(8, name="down"),
    ]
)
model.compile(keras.optimizers.Adam(1e-3), "mse")
history = model.fit(x, y, batch_size=128, epochs=3, verbose=0)
say(
    f"mesh {dict(zip(mesh.axis_names, mesh.shape))} over {len(devices)} "
    "processes"
)
say("loss per epoch:", [round(v, 5) for v in history.history["loss"]])
ktd.report(model, print_fn=say)  # collective: every rank calls it

"""A first user's mistakes, one per mode, for tests/e2e/test_one_error.py
(`ktd run -n 2 user_mistakes.py MODE`):

- batch: batch_size=127 under DataParallel on 2 processes;
- mesh: a mesh of 8 devices on 2 processes;
- axis: a LayoutMap axis the mesh does not have;
- load: `checkpoint.load` of a path that does not exist;
- gpu: a `gpu:N` mesh on a machine without CUDA;
- sleep: both ranks print "ready", then sleep (stopped by Ctrl-C);
- speak: a Python warning, another library's log line, the package's
  log lines before and after `logging.basicConfig`, `rank_zero_print`, a
  short `fit`; then each rank prints "done".
"""

import logging
import os
import sys
import time
import warnings

import keras
import numpy as np

import keras_torch_distribution as ktd
from keras_torch_distribution import checkpoint

MODE = sys.argv[1]
keras.distribution.initialize()
if MODE == "sleep":
    print("ready", os.environ["RANK"], flush=True)
    time.sleep(300)
devices = keras.distribution.list_devices()
if MODE == "mesh":
    devices = [f"cpu:{i}" for i in range(8)]
elif MODE == "gpu":
    devices = ["gpu:0", "gpu:1"]
mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
if MODE == "axis":
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
else:
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
keras.distribution.set_distribution(distribution)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
x = np.ones((254, 4), "float32")
if MODE == "load":
    checkpoint.load(model, os.path.join(os.getcwd(), "no", "such", "ckpt"))
if MODE == "speak":
    warnings.warn("a warning of the script")
    logging.getLogger("another.library").warning("another library's warning")
    ktd_logger = logging.getLogger("keras_torch_distribution")
    ktd_logger.warning("the package's warning before basicConfig")
    logging.basicConfig()  # as another library may do
    ktd_logger.warning("the package's warning after basicConfig")
    ktd.rank_zero_print("printed by rank 0 only")
    model.fit(x[:8], x[:8, :2], batch_size=4, epochs=1, verbose=0)
    print("done", os.environ["RANK"], flush=True)
    sys.exit(0)
model.fit(x, x[:, :2], batch_size=127 if MODE == "batch" else 2, verbose=0)

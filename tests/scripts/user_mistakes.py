"""A first user's mistakes, one per mode, for tests/e2e/test_one_error.py
(`ktd run -n 2 user_mistakes.py MODE`):

- batch: batch_size=127 under DataParallel on 2 processes;
- mesh: a mesh of 8 devices on 2 processes;
- axis: a LayoutMap axis the mesh does not have;
- load: `checkpoint.load` of a path that does not exist;
- gpu: a `gpu:N` mesh on a machine without CUDA;
- sleep: both ranks print "ready", then sleep (stopped by Ctrl-C);
- save: after fit, `model.save` on rank 0 only (the DDP habit); save-fit:
  the same, then a fit on every rank;
- speak: a Python warning, another library's log line, the package's
  log lines before and after `logging.basicConfig`, `rank_zero_print`, a
  `fit` on a torch DataLoader (Keras warns that shuffle=True is ignored,
  from under the package's patched data adapter); then each rank prints
  "done".
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
    import torch

    rows = torch.utils.data.TensorDataset(
        torch.ones((8, 4)), torch.ones((8, 2))
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model.fit(loader, epochs=1, verbose=0)  # Keras warns: shuffle ignored
    print("done", os.environ["RANK"], flush=True)
    sys.exit(0)
model.fit(x, x[:, :2], batch_size=127 if MODE == "batch" else 2, verbose=0)
if MODE in ("save", "save-fit"):
    if int(os.environ["RANK"]) == 0:
        model.save(os.path.join(os.getcwd(), "model.keras"))
    if MODE == "save-fit":
        model.fit(x, x[:, :2], batch_size=2, verbose=0)

"""A script with collectives of its own, which `ktd plan` refuses where
rank 0's result needs real peers (tests/unit/test_plan_peers.py).

    python plan_peers.py CALL
    CALL: all_reduce | all_gather_object | broadcast_object_list_from_1
          (each needs the other ranks' values) | from_rank_0 (a broadcast
          from rank 0 and a barrier: rank 0's values as on N ranks) |
          guarded (an all_reduce skipped while planning)
"""

import sys

import keras
import numpy as np
import torch
import torch.distributed as dist

import keras_torch_distribution  # noqa: F401
from keras_torch_distribution.plan import is_planning

keras.distribution.initialize()
devices = keras.distribution.list_devices()
keras.distribution.set_distribution(
    keras.distribution.DataParallel(devices=devices)
)
call = sys.argv[1]
value = torch.ones(2)
if call == "all_reduce":
    dist.all_reduce(value)  # needs peers
elif call == "all_gather_object":
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, 3)  # needs peers
elif call == "broadcast_object_list_from_1":
    config = [None]
    dist.broadcast_object_list(config, src=1)  # needs peers
elif call == "from_rank_0":
    dist.broadcast(value, src=0)
    dist.barrier()
elif call == "guarded":
    if not is_planning():
        dist.all_reduce(value)
rows = 2 * len(devices)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
model.fit(np.zeros((rows, 4)), np.zeros((rows, 2)), batch_size=rows, verbose=0)

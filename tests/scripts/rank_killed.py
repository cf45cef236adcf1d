"""Rank 1 dies by SIGKILL; rank 0 then fails on the broken connection.

`ktd run` must name rank 1 and its signal, not rank 0, although torchrun
may record rank 0's error first (it orders failures by whole seconds).
Run by tests/e2e/test_launch.py.
"""

import os
import signal

import keras
import torch
import torch.distributed as dist

keras.distribution.initialize()
value = torch.ones(1)
dist.all_reduce(value)  # both ranks are up
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(value)  # rank 0: the connection to rank 1 breaks
print("rank", dist.get_rank(), "finished: the kill was not seen", flush=True)

"""Each process says it is ready, then waits to be killed.

Run by tests/e2e/test_clusters.py as `KERAS_DISTRIBUTION_NUM_PROCESSES=2
python wait_after_initialize.py`: initialize() starts 2 processes running
this script and waits for them; the test SIGKILLs that launcher and checks
that the processes die with it.
"""

import os
import time

import keras

import keras_torch_distribution

keras.distribution.initialize()
print(
    f"ready rank={keras_torch_distribution.process_id()} pid={os.getpid()}",
    flush=True,
)
time.sleep(600)

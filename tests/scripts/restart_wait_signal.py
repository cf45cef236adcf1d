"""Each rank of `ktd run -n 2 restart_wait_signal.py DIR` writes DIR/ready-RANK
and waits up to 60 s for SIGUSR1 (tests/e2e/test_restarts.py sends it to
`ktd run`, whose torchrun agent must pass it on), then prints `rank=R
got=SIGUSR1` and exits with 138 (128 + SIGUSR1), or prints `rank=R got=none`
and exits 0.
"""

import os
import signal
import sys
import time

import keras

import keras_torch_distribution

keras.distribution.initialize()
rank = keras_torch_distribution.process_id()
got = []
signal.signal(signal.SIGUSR1, lambda number, frame: got.append(number))
with open(os.path.join(sys.argv[1], f"ready-{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 300  # the test signals once all are ready
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stdout.write(f"rank={rank} got={'SIGUSR1' if got else 'none'}\n")
sys.stdout.flush()
sys.exit(128 + signal.SIGUSR1 if got else 0)

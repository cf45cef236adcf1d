"""One worker of the elastic jobs of tests/e2e/test_elastic_shrink.py:

    SHRINK_NODE=N ktd run --nnodes 1:2 ... shrink_fit.py OUT STEP SAVE_FREQ

The fit of helpers.preempt_fit (its model, data, shuffle, dropout and
global batch of 8) under DataParallel on however many processes the
rendezvous gave, with BackupAndRestore(OUT/backup, save_freq=SAVE_FREQ).
The attempt is torchrun's restart count (TORCHELASTIC_RESTART_COUNT).

In attempt 0, after its STEP-th batch (1-based, counted over epochs), local
rank 0 of node 1 (SHRINK_NODE=1) writes OUT/stopped (its global rank and
the world's size) and sleeps: the test then SIGKILLs node 1 (its launcher
and its workers), and the ranks of node 0 fail in the collective they wait
in. Rank 0 of each start of the processes appends "<attempt> <world size>"
to OUT/worlds and writes OUT/first_step<N> (time.time() after its first
batch); rank 0 of a run that finishes writes OUT/attempt<N>.npz (the
values) and .json (the (epoch, batch) pairs trained, the world's size).
"""

import json
import os
import sys
import time

# tests/, for `helpers` (this script's own folder is what Python adds).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import PREEMPT_EPOCHS  # noqa: E402
from helpers import checkpoint_model  # noqa: E402
from helpers import checkpoint_values  # noqa: E402
from helpers import preempt_data  # noqa: E402
from keras_torch_distribution._processes import runtime  # noqa: E402

SLEEP_S = 300  # longer than the test waits: node 1 dies while sleeping


def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def main():
    out, step, save_freq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stopper = (
        attempt == 0
        and os.environ.get("SHRINK_NODE") == "1"
        and os.environ.get("LOCAL_RANK") == "0"
    )
    keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    me, world = runtime.process_id(), runtime.num_processes()
    if me == 0:
        with open(os.path.join(out, "worlds"), "a") as f:
            f.write(f"{attempt} {world}\n")
    model = checkpoint_model()
    x, y = preempt_data()
    seen = []

    class Act(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            seen.append((self.epoch, batch))
            if me == 0 and len(seen) == 1:
                _write(
                    os.path.join(out, f"first_step{attempt}"), str(time.time())
                )
            if stopper and len(seen) == step:
                _write(os.path.join(out, "stopped"), f"{me} {world}")
                time.sleep(SLEEP_S)

    backup = keras.callbacks.BackupAndRestore(
        os.path.join(out, "backup"), save_freq=save_freq
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=PREEMPT_EPOCHS,
        verbose=0,
        callbacks=[backup, Act()],
    )
    values = checkpoint_values(model)
    if me == 0:
        np.savez(
            os.path.join(out, f"attempt{attempt}.npz"),
            **{k.replace("/", "|"): v for k, v in values.items()},
        )
        report = {"seen": seen, "world": world}
        _write(os.path.join(out, f"attempt{attempt}.json"), json.dumps(report))


main()

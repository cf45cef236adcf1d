"""A 2-process DataParallel fit whose rank 1 is lost in its first attempts,
for restarts inside one torchrun job (tests/e2e/test_restarts.py):

    ktd run -n 2 --max-restarts 3 restart_fit.py BACKUP sigkill,sigterm,raise

Attempt A (TORCHELASTIC_RESTART_COUNT) ends rank 1 after batch STOP_STEP
of epoch STOP_EPOCH (or its first batch, if it resumed past that one) as
the A-th word says: `sigkill` or `sigterm` (it
sends itself that signal), `raise` (a Python exception); attempts past the
list train to the end. keras.callbacks.BackupAndRestore(BACKUP) makes
each attempt resume from its newest backup (the last completed epoch, or
the step where a SIGTERM preempted both ranks). The attempt that
finishes then fits the same model again from scratch, uninterrupted, in
the same processes, and prints on every rank `attempt=A rank=R resumed=L
reference=L2 same_weights=True|False`. Each rank prints `attempt=A rank=R
start=T` when the script starts, and rank 1 `attempt=A rank=1 ends by HOW
at=T` before it ends (T: time.time()).
"""

import os
import signal
import sys
import time

START = time.time()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution  # noqa: E402

STOP_EPOCH, STOP_STEP = 1, 2
HOWS = ("sigkill", "sigterm", "raise")


def say(line):
    """One line in one write: the ranks share torchrun's stdout, and under
    `python -u` print() writes the text and the newline separately."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


backup_dir = sys.argv[1]
endings = sys.argv[2].split(",") if len(sys.argv) > 2 else []
if not set(endings) <= set(HOWS):
    raise SystemExit(f"endings must be among {HOWS}, not {endings}")
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
how = endings[attempt] if attempt < len(endings) else None

keras.distribution.initialize()
rank = keras_torch_distribution.process_id()
say(f"attempt={attempt} rank={rank} start={START:.3f}")
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = rng.normal(size=(64, 2)).astype("float32")


def fit(callbacks):
    """(final loss, weights) of the same model fitted from the same seed."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return history.history["loss"][-1], model.get_weights()


class LoseRank1(keras.callbacks.Callback):
    """Ends rank 1 once, after batch STOP_STEP of epoch STOP_EPOCH or the
    first one past it, as `how` says."""

    def __init__(self):
        super().__init__()
        self.epoch = 0
        self.done = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if how is None or rank != 1 or self.done:
            return
        # At or after: an attempt resumed past that batch (from a backup
        # taken at a preemption) ends at its first batch.
        if (self.epoch, batch) < (STOP_EPOCH, STOP_STEP):
            return
        self.done = True
        say(f"attempt={attempt} rank=1 ends by {how} at={time.time():.3f}")
        if how == "raise":
            raise RuntimeError(f"rank 1 fails on purpose in attempt {attempt}")
        # SIGKILL, and SIGTERM without a handler, end it here; with the
        # package's preemption handler, SIGTERM stops both ranks at the
        # next step, with a backup there.
        os.kill(os.getpid(), getattr(signal, how.upper()))


loss, weights = fit([keras.callbacks.BackupAndRestore(backup_dir), LoseRank1()])
reference_loss, reference_weights = fit([])
same = all(
    np.array_equal(a, b)
    for a, b in zip(weights, reference_weights, strict=True)
)
say(
    f"attempt={attempt} rank={rank} resumed={loss:.6f} "
    f"reference={reference_loss:.6f} same_weights={same}"
)

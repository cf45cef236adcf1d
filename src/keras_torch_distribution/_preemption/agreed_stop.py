"""`PreemptTogether`: the last callback of a multi-process `fit`, which
stops the ranks together (`StopTogether`) and acts on preemption signals.

From `on_train_begin` to the end of `fit` the preemption signals only
take note (`signals`). The signal a rank received rides in the all-reduce
`StopTogether` already makes after every batch and every epoch, so every
rank learns at the same step that some rank was signalled (a signal that
lands during that all-reduce counts at the next step everywhere). There,
on every rank, in this order:

1. each backup callback of the `fit` (`BackupAndRestore`,
   `ShardedCheckpoint`) writes its sharded backup at this step (a pending
   async save is completed first; a backup already at this step, written
   at an epoch's end, is kept as it is), with where `fit` is in its data
   (`_batch.position`), so a restart resumes at exactly this batch;
2. under SLURM, after SIGUSR1 (KTD_SLURM_REQUEUE), rank 0 requeues the job;
3. every rank logs one line naming the signal, the ranks that received
   it, the step and the backup, and raises `Preempted`, a `SystemExit`
   with code 128 + the signal.

Keras' `on_epoch_end` and `on_train_end` do not run, so no backup is
marked as a finished epoch or deleted. `PreemptEvaluation` does the same
for a multi-process `evaluate` outside `fit`, saving nothing. A crash is
no preemption: a rank whose peer is gone fails in the collective, or its
watchdog ends it.
"""

from __future__ import annotations

import os
import time

import keras

from keras_torch_distribution._batch import position
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import logger
from keras_torch_distribution._preemption import requeue
from keras_torch_distribution._preemption import signals
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint import callbacks as checkpoints


def backup_callbacks(callbacks) -> list:
    """The callbacks in `callbacks` (a list or Keras' CallbackList) that
    write backups a restart resumes from."""
    listed = list(getattr(callbacks, "callbacks", callbacks) or [])
    return [
        c
        for c in listed
        if isinstance(
            c,
            (
                keras.callbacks.BackupAndRestore,
                checkpoints.ShardedCheckpoint,
            ),
        )
    ]


class PreemptTogether(agreement.StopTogether):
    """Stops the ranks together, and at a preemption signal writes
    `backups` (this `fit`'s backup callbacks) at one agreed step and exits
    with 128 + the signal on every rank. Must be the last callback.
    Collective: every rank runs it at the same points."""

    def __init__(self, backups=()) -> None:
        super().__init__()
        self.backups = list(backups)

    def on_train_begin(self, logs=None):
        position.start()
        for backup in self.backups:
            backup._ktd_saved_at = None
            if isinstance(backup, checkpoints.ShardedCheckpoint):
                backup._saved_at = None
        signals.catch()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        position.set_epoch(epoch)

    def on_train_end(self, logs=None):
        signals.release()

    def own_code(self):
        return signals.received()

    def agreed(self, codes, where):
        received = {rank: code for rank, code in enumerate(codes) if code}
        if not received:
            return
        signals.boundary_reached()
        epoch, batch = position.reached()
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        started = time.monotonic()
        written = [self._write(backup) for backup in self.backups]
        seconds = time.monotonic() - started
        saved = _describe_backups(self.backups, written, seconds)
        _exit(
            received,
            f"{where}: every rank stops in {self.epoch_text(epoch)}, after "
            f"{batch} batch(es) of it (step {step}); {saved}",
        )

    @staticmethod
    def _write(backup):
        if isinstance(backup, checkpoints.ShardedCheckpoint):
            return backup.save_at_preemption()
        return checkpoints.backup_at_preemption(backup)


class PreemptEvaluation(keras.callbacks.Callback):
    """The last callback of a multi-process `evaluate` outside `fit`: a
    preemption signal stops every rank after the same batch (one
    all-reduce of one integer per rank per batch) and exits with 128 + the
    signal; nothing is saved (evaluate changes no state). Collective."""

    reads_batch_logs = False  # so no host read of the logs for it

    def on_test_begin(self, logs=None):
        signals.catch()

    def on_test_batch_end(self, batch, logs=None):
        codes = agreement.codes_of_ranks(signals.received())
        received = {rank: code for rank, code in enumerate(codes) if code}
        if received:
            signals.boundary_reached()
            _exit(
                received,
                f"evaluate(), after batch {batch + 1}: every rank stops there "
                "(evaluate saves nothing)",
            )

    def on_test_end(self, logs=None):
        signals.release()


def _exit(received, what):
    """Requeue under SLURM, log one line (rank 0's, for the job), release
    the handlers and raise Preempted. Collective."""
    number = received[min(received)]
    name = signals.signal_name(number)
    waited = signals.seconds_since_signal()
    job = requeue.job_to_requeue(number)
    if job is not None:
        agreement.barrier()
        if runtime.process_id() == 0:
            what += "; " + requeue.requeue(job)
    message = (
        f"preempted by {name} (received by rank(s) {sorted(received)}) at "
        f"{what}. Exiting with {128 + number}"
        + (f", {waited:.1f} s after the signal." if waited else ".")
    )
    logger.warning("%s", message)
    signals.release()
    raise signals.Preempted(number, message)


def _describe_backups(backups, written, seconds):
    if not backups:
        return (
            "nothing was saved (this fit has no BackupAndRestore or "
            "ShardedCheckpoint callback; add one to resume where it stopped)"
        )
    parts = []
    for backup, path in zip(backups, written):
        if path is None:
            parts.append(
                f"{type(backup).__name__}'s newest backup is already at this "
                "step"
            )
        else:
            parts.append(f"backup {path} ({_size_text(path)})")
    return ", ".join(parts) + f", written in {seconds:.1f} s"


def _size_text(path):
    total = 0
    for root, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return f"{total / 2**20:.1f} MiB"

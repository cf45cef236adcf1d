"""Preemption on 2 gloo ranks: a signal in the middle of an epoch stops
every rank at one step with a backup written there, and a second `fit`
resumes at exactly that batch and ends with an uninterrupted run's
weights (shuffle and dropout included), under DataParallel, tensor
parallelism and FSDP, with BackupAndRestore and ShardedCheckpoint.

The signal is raised by a callback on the ranks themselves
(`signal.raise_signal`), as `kill -TERM` would deliver it; real processes
killed from outside and restarted by torchrun are in
e2e/test_preemption_restarts.py.
"""

import os
import signal

import keras
import numpy as np
import pytest

from helpers import SAVE_RULES
from helpers import assert_same_values
from helpers import checkpoint_model
from helpers import checkpoint_values
from helpers import model_parallel

EPOCHS = 3
BATCH = 8
ROWS = 40  # 5 batches per epoch


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 4)).astype("float32")
    return x, y


def _distribute(kind):
    devices = keras.distribution.list_devices()
    if kind == "dp":
        distribution = keras.distribution.DataParallel()
    elif kind == "tp":  # a batch axis of 1: tensor parallel only
        distribution = model_parallel(
            devices, SAVE_RULES, (1, len(devices)), ("batch", "model")
        )
    else:  # "fsdp": the one axis is the batch axis, kernels sharded on it
        distribution = model_parallel(devices, SAVE_RULES)
    keras.distribution.set_distribution(distribution)


def _callback(kind, directory):
    if kind == "backup":
        return keras.callbacks.BackupAndRestore(directory)
    if kind == "backup-false":
        return keras.callbacks.BackupAndRestore(directory, save_freq=False)
    from keras_torch_distribution.checkpoint import ShardedCheckpoint

    return ShardedCheckpoint(directory, restore=True)


class _Signal(keras.callbacks.Callback):
    """Raises `number` on `ranks` after batch `at[1]` of epoch `at[0]`."""

    def __init__(self, at, ranks, number):
        super().__init__()
        self.at, self.ranks, self.number = at, ranks, number
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        from keras_torch_distribution._processes import runtime

        if (self.epoch, batch) == self.at and (
            runtime.process_id() in self.ranks
        ):
            signal.raise_signal(self.number)


class _Batches(keras.callbacks.Callback):
    """(epoch, batch) of every batch trained."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch))


def preempt_and_resume(directory, kind, callback_kind, shuffle, at, ranks):
    """fit until the signal (caught: `Preempted`), then fit again with the
    same callback kind: what each attempt did, and the final values."""
    from keras_torch_distribution import Preempted
    from keras_torch_distribution import checkpoint

    _distribute(kind)
    x, y = _data()
    attempts = []
    for attempt in range(2):
        model = checkpoint_model()
        batches = _Batches()
        callbacks = [_callback(callback_kind, directory), batches]
        if attempt == 0:
            callbacks.append(_Signal(at, ranks, signal.SIGTERM))
        outcome = {"seen": None}
        try:
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=EPOCHS,
                shuffle=shuffle,
                verbose=0,
                callbacks=callbacks,
            )
            outcome["exit"] = None
        except Preempted as preempted:
            outcome["exit"] = preempted.code
            outcome["message"] = str(preempted)
            outcome["files"] = sorted(os.listdir(directory))
            saved = (
                os.path.join(directory, "latest.ckpt")
                if callback_kind.startswith("backup")
                else checkpoint.latest(directory)
            )
            outcome["extra"] = checkpoint.read_extra(saved)
            outcome["handler"] = signal.getsignal(signal.SIGTERM)
        outcome["seen"] = batches.seen
        attempts.append(outcome)
    attempts[1]["left"] = os.path.exists(directory)
    return attempts, checkpoint_values(model)


def uninterrupted(kind, shuffle):
    _distribute(kind)
    x, y = _data()
    model = checkpoint_model()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=shuffle, verbose=0)
    return checkpoint_values(model)


CASES = [
    # (distribution, callback, shuffle, (epoch, batch) of the signal, ranks)
    ("fsdp", "backup", True, (1, 2), (1,)),
    ("dp", "backup", True, (1, 2), (0, 1)),
    ("tp", "backup", True, (0, 4), (0,)),
    ("fsdp", "sharded", True, (2, 0), (1,)),
    ("dp", "backup-false", False, (1, 3), (1,)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,callback_kind,shuffle,at,ranks",
    CASES,
    ids=["-".join(map(str, c[:3])) + f"-at{c[3]}-ranks{c[4]}" for c in CASES],
)
def test_preempted_fit_resumes_with_uninterrupted_weights(
    pool2, tmp_path, kind, callback_kind, shuffle, at, ranks
):
    directory = str(tmp_path / "backup")
    results = pool2.run(
        preempt_and_resume, directory, kind, callback_kind, shuffle, at, ranks
    )
    reference = pool2.run(uninterrupted, kind, shuffle)[0]
    epoch, batch = at
    done = [(e, b) for e in range(epoch) for b in range(5)]
    done += [(epoch, b) for b in range(batch + 1)]
    rest = [(e, b) for e in range(EPOCHS) for b in range(5)][len(done) :]
    for rank, (attempts, values) in enumerate(results):
        first, second = attempts
        # Every rank stops after the signalled batch, exits with 143.
        assert first["exit"] == 128 + signal.SIGTERM, first
        assert first["seen"] == done
        assert f"received by rank(s) {list(ranks)}" in first["message"]
        assert "SIGTERM" in first["message"]
        assert first["handler"] is signal.SIG_DFL  # put back
        resume = first["extra"]["resume"]
        assert (resume["epoch"], resume["batch"]) == (epoch, batch + 1)
        # The resumed fit trains only what was left, and ends with the
        # uninterrupted run's values, exactly.
        assert second["exit"] is None
        assert second["seen"] == rest, (rank, second["seen"])
        assert_same_values(values, reference)
        if callback_kind.startswith("backup"):
            assert not second["left"]  # deleted when training completed


def _periodic_then_crash_resume(directory):
    """ShardedCheckpoint(save_freq=3) and an error raised on every rank
    after batch 1 of epoch 1 (step 7): the newest checkpoint is step 6,
    and a second fit resumes there."""
    from keras_torch_distribution.checkpoint import ShardedCheckpoint

    _distribute("dp")
    x, y = _data()
    seen = []
    for attempt in range(2):
        model = checkpoint_model()
        batches = _Batches()
        callbacks = [ShardedCheckpoint(directory, save_freq=3, restore=True)]
        callbacks.append(batches)

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batches.seen[-1] == (1, 1):
                    raise RuntimeError("crash")

        if attempt == 0:
            callbacks.append(Crash())
        try:
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=EPOCHS,
                verbose=0,
                callbacks=callbacks,
            )
        except RuntimeError as error:
            seen.append(str(error))
        seen.append(batches.seen)
    return seen, checkpoint_values(model)


@pytest.mark.slow
def test_periodic_checkpoint_resumes_at_its_batch_after_a_crash(
    pool2, tmp_path
):
    results = pool2.run(_periodic_then_crash_resume, str(tmp_path / "ckpt"))
    reference = pool2.run(uninterrupted, "dp", True)[0]
    everything = [(e, b) for e in range(EPOCHS) for b in range(5)]
    for seen, values in results:
        assert seen[:2] == ["crash", everything[:7]]
        # Resumed at step 6 (epoch 1, after batch 0): batches 1.. again.
        assert seen[2] == everything[6:]
        assert_same_values(values, reference)


def _requeued(directory, log):
    """SIGUSR1 on rank 1 under a fake SLURM job 123 whose `scontrol` (on
    PATH) logs its arguments: (exit code, message)."""
    from keras_torch_distribution import Preempted

    _distribute("dp")
    x, y = _data()
    model = checkpoint_model()
    bin_dir = os.path.join(directory, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    scontrol = os.path.join(bin_dir, "scontrol")
    with open(scontrol, "w") as f:
        f.write(f'#!/bin/sh\necho "$@" >> {log}\n')
    os.chmod(scontrol, 0o755)
    saved = dict(os.environ)
    os.environ["SLURM_JOB_ID"] = "123"
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ["PATH"]
    try:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            verbose=0,
            callbacks=[
                _callback("backup", os.path.join(directory, "backup")),
                _Signal((0, 2), (1,), signal.SIGUSR1),
            ],
        )
    except Preempted as preempted:
        return preempted.code, str(preempted)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None, None


@pytest.mark.slow
def test_sigusr1_under_slurm_requeues_the_job_once(pool2, tmp_path):
    log = tmp_path / "scontrol.log"
    results = pool2.run(_requeued, str(tmp_path), str(log))
    for code, message in results:
        assert code == 128 + signal.SIGUSR1 == 138
        assert "preempted by SIGUSR1 (received by rank(s) [1])" in message
    # Rank 0 requeued the job once, after every rank's backup was written,
    # and says so.
    assert log.read_text() == "requeue 123\n"
    assert "SLURM job 123 requeued" in results[0][1]
    assert "requeue" not in results[1][1]


def _preempt_only(directory):
    """fsdp fit preempted on rank 1 after batch 2 of epoch 1."""
    from keras_torch_distribution import Preempted

    _distribute("fsdp")
    x, y = _data()
    model = checkpoint_model()
    try:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            verbose=0,
            callbacks=[
                _callback("backup", directory),
                _Signal((1, 2), (1,), signal.SIGTERM),
            ],
        )
    except Preempted as preempted:
        return preempted.code
    return None


def _resume_only(directory):
    _distribute("fsdp")
    x, y = _data()
    model = checkpoint_model()
    batches = _Batches()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[_callback("backup", directory), batches],
    )
    return batches.seen, checkpoint_values(model)


@pytest.mark.slow
def test_a_backup_from_2_ranks_resumes_at_its_batch_on_4(
    pool2, pool4, tmp_path
):
    directory = str(tmp_path / "backup")
    assert pool2.run(_preempt_only, directory) == [143, 143]
    reference = pool2.run(uninterrupted, "fsdp", True)[0]
    everything = [(e, b) for e in range(EPOCHS) for b in range(5)]
    for seen, values in pool4.run(_resume_only, directory):
        # The same global batches, now in 4 replicas' rows: resharded, and
        # at the agreed batch (the 8th), shuffle included.
        assert seen == everything[8:]
        assert sorted(values) == sorted(reference)
        for key in reference:
            np.testing.assert_allclose(
                values[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key
            )


def _evaluate_preempted():
    """evaluate (outside fit) with SIGTERM on rank 1 after test batch 1:
    (exit code, message, test batches seen, the SIGTERM handler after)."""
    from keras_torch_distribution import Preempted
    from keras_torch_distribution._processes import runtime

    _distribute("dp")
    x, y = _data()
    model = checkpoint_model()
    seen = []

    class Signal(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen.append(batch)
            if batch == 1 and runtime.process_id() == 1:
                signal.raise_signal(signal.SIGTERM)

    try:
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[Signal()])
    except Preempted as preempted:
        return preempted.code, str(preempted), seen, signal.getsignal(15)
    return None, None, seen, signal.getsignal(15)


@pytest.mark.slow
def test_a_signal_during_evaluate_stops_every_rank_after_one_batch(pool2):
    for code, message, seen, handler in pool2.run(_evaluate_preempted):
        assert code == 143
        assert seen == [0, 1]  # both ranks stop after the same batch
        assert (
            "preempted by SIGTERM (received by rank(s) [1]) at evaluate(), "
            "after batch 2" in message
        )
        assert handler is signal.SIG_DFL

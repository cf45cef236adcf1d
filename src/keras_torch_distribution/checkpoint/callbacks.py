"""Callbacks: `ShardedCheckpoint`, and BackupAndRestore in multi-process
runs."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import keras

import keras_torch_distribution.checkpoint._dcp as _dcp
import keras_torch_distribution.checkpoint._files as _files
import keras_torch_distribution.checkpoint._location as _location
import keras_torch_distribution.checkpoint._pending as _pending
import keras_torch_distribution.checkpoint._storage as _storage
from keras_torch_distribution import _keras
from keras_torch_distribution._batch import position
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError

_NAME = re.compile(r"^ckpt-(\d+)$")
# A checkpoint's name, or what a save or removal of it leaves while running.
_ANY_STATE = re.compile(
    r"^(ckpt-(\d+))(%s|%s|%s)?$"
    % tuple(
        re.escape(s)
        for s in (
            _location.INCOMPLETE_SUFFIX,
            _location.OLD_SUFFIX,
            _location.REMOVING_SUFFIX,
        )
    )
)


def _steps(directory: str) -> dict[int, str]:
    """{step: checkpoint path} of every `ckpt-<step>` name in `directory`,
    complete or not (from its own name or its leftovers)."""
    found = {}
    for name in os.listdir(directory):
        match = _ANY_STATE.match(name)
        if match:
            found[int(match.group(2))] = os.path.join(directory, match.group(1))
    return found


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint `ShardedCheckpoint` wrote in
    `directory` (the highest step), or None."""
    directory = _location.normalize(directory)
    if not os.path.isdir(directory):
        return None
    complete = [
        (step, path)
        for step, path in _steps(directory).items()
        if _location.is_checkpoint(path)
    ]
    return max(complete)[1] if complete else None


def tidy(directory: str, max_to_keep: int | None = None) -> None:
    """Settle every checkpoint of `directory` (finish interrupted
    replacements, remove ``*.incomplete`` left by crashed saves and other
    leftovers), then keep only the newest `max_to_keep` complete ones.
    The lowest rank of each storage that holds `directory` (one on a
    shared filesystem, one per host on local disks: `_storage.storage_groups`,
    which makes `directory` in a multi-process run) works between two
    barriers.
    Collective: call on every rank."""
    groups = _storage.storage_groups(directory)
    agreement.barrier()
    if _storage.leads(groups) and os.path.isdir(directory):
        steps = _steps(directory)
        for step in sorted(steps):
            _files.settle(steps[step])
        complete = sorted(s for s in steps if _location.has_marker(steps[s]))
        if max_to_keep is not None:
            for step in complete[:-max_to_keep]:
                _files.remove_checkpoint(steps[step])
    agreement.barrier()


class ShardedCheckpoint(keras.callbacks.Callback):
    """Save a sharded checkpoint every epoch (or every `save_freq` batches)
    into `directory/ckpt-<step>`, with ``extra={"epoch", "batch", "step"}``.

    `restore=True` loads the newest complete checkpoint of `directory` when
    `fit` begins and resumes where it was taken: in a multi-process `fit`
    at exactly that batch, with the data order and random state of the run
    that wrote it (`_batch.position`); otherwise at the start of the epoch
    it was taken in, as Keras' BackupAndRestore does. A preemption signal
    also writes one (`preemption`). `max_to_keep` keeps only the newest
    ones. What crashed saves left
    (``ckpt-<step>.incomplete``) is removed when `fit` begins and after each
    save. `async_save=True` writes in the background; each save completes
    the previous one first and `fit` completes the last before it returns.
    Every rank must run the callback (saving is collective).
    """

    reads_batch_logs = False  # so no host read of the logs for it

    def __init__(
        self,
        directory: str | os.PathLike[str],
        save_freq: str | int = "epoch",
        optimizer: bool = True,
        max_to_keep: int | None = None,
        restore: bool = False,
        async_save: bool = False,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and not (
            isinstance(save_freq, int) and save_freq > 0
        ):
            raise ValueError(
                f"save_freq={save_freq!r} must be 'epoch' or a positive number "
                "of batches."
            )
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"max_to_keep={max_to_keep!r} must be None (keep all) or a "
                "positive integer."
            )
        self.directory = _location.normalize(directory)
        self.save_freq = save_freq
        self.optimizer = optimizer
        self.max_to_keep = max_to_keep
        self.restore = restore
        self.async_save = async_save
        self._pending = None
        self._step = 0
        self._epoch = 0
        self._batches_since_save = 0
        self._saved_at = None  # the position of the newest save

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._step = 0
        tidy(self.directory, self.max_to_keep)
        if self.restore:
            found = latest(self.directory)
            if found is not None:
                extra = (
                    _dcp.load(self.model, found, optimizer=self.optimizer) or {}
                )
                self._step = int(extra.get("step", 0))
                _resume(self.model, extra, found)

    def on_epoch_begin(
        self, epoch: int, logs: dict[str, Any] | None = None
    ) -> None:
        self._epoch = epoch

    def on_train_batch_end(
        self, batch: int, logs: dict[str, Any] | None = None
    ) -> None:
        self._step += 1
        if self.save_freq == "epoch":
            return
        self._batches_since_save += 1
        if self._batches_since_save >= self.save_freq:
            self._batches_since_save = 0
            self._save(epoch=self._epoch, batch=batch + 1)

    def on_epoch_end(
        self, epoch: int, logs: dict[str, Any] | None = None
    ) -> None:
        if self.save_freq == "epoch":
            self._save(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._complete_pending()

    def _complete_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            tidy(self.directory, self.max_to_keep)

    def _save(self, epoch: int, batch: int, synchronous: bool = False) -> str:
        self._complete_pending()
        path = os.path.join(self.directory, f"ckpt-{self._step:09d}")
        extra = {"epoch": epoch, "batch": batch, "step": self._step}
        _add_position(extra)
        self._saved_at = position.reached()
        if self.async_save and not synchronous:
            self._pending = _dcp.async_save(
                self.model, path, self.optimizer, extra
            )
        else:
            _dcp.save(self.model, path, self.optimizer, extra)
            tidy(self.directory, self.max_to_keep)
        return path

    def save_at_preemption(self) -> str | None:
        """Write a checkpoint at the step `fit` has reached, completely
        (a pending async save first); None when the newest is already
        there. Collective: call on every rank."""
        if self._saved_at == position.reached():
            self._complete_pending()
            return None
        epoch, batch = position.reached()
        return self._save(epoch, batch, synchronous=True)


def _add_position(extra: dict[str, Any]) -> None:
    """Put where `fit` is in its data into a checkpoint's `extra` (in a
    multi-process `fit`): the epoch it is in and the batches done, and
    what a resume at exactly that batch needs."""
    reached = position.saved()
    if reached is not None:
        extra["epoch"] = reached["epoch"]
        extra["resume"] = reached


def _resume(model, extra: dict[str, Any], path: str) -> None:
    """Make the next `fit` start where the checkpoint at `path` (with this
    `extra`) was taken."""
    _keras.set_initial_epoch(model, int(extra.get("epoch", 0)))
    resume = extra.get("resume")
    position.resume_from(resume)
    if resume and resume.get("batch"):
        logger.info(
            "resuming from %s at epoch %s, after batch %s",
            path,
            resume["epoch"],
            resume["batch"],
        )
    else:
        logger.info("resuming from %s at epoch %s", path, extra.get("epoch"))


# ---------------------------------------------------------------------------
# keras.callbacks.BackupAndRestore in multi-process runs.
# ---------------------------------------------------------------------------
#
# Keras' BackupAndRestore writes `latest.weights.h5` and a JSON file of
# metadata from every process, and removes the directory from every process
# at the end: in a multi-process run the processes race (one removes what
# another still writes), a process killed while writing leaves a torn file,
# and the states of SeedGenerators (dropout) are not in the file, so a
# resumed run draws other random numbers. In multi-process runs the patched
# methods below back up into `backup_dir/latest.ckpt`, a sharded checkpoint
# of this package (each rank writes its shards; the replacement of the
# previous backup is crash-safe at every instant, see _files), and remove
# the directory from rank 0 between barriers. One-process runs keep Keras'
# own behaviour; a backup Keras wrote in one process is still restored in a
# multi-process run.

BACKUP_NAME = "latest.ckpt"
PREVIOUS_BACKUP_NAME = "previous.ckpt"


def backup_save(original, callback):
    """Keras `BackupAndRestore._save_model` (a routine backup: said at INFO,
    `_pending.routine_saves`). Collective: call on every rank."""
    if not runtime.is_multi_process():
        return original(callback)
    with _pending.routine_saves():
        write_backup(callback)
    return None


def backup_should_save_on_batch(original, callback, batch):
    """Keras `BackupAndRestore._should_save_on_batch`: with
    `save_freq=False`, never (Keras took False for 0 and saved after every
    batch): such a backup is written only at a preemption, and at no epoch
    end either."""
    if _keras.backup_skips_batch_saves(callback):
        return False
    return original(callback, batch)


def backup_at_preemption(callback) -> str | None:
    """Write `callback`'s backup at the step `fit` has reached; None when
    its newest backup is already there. Collective: call on every rank."""
    if getattr(callback, "_ktd_saved_at", None) == position.reached():
        return None
    return write_backup(callback)


def write_backup(callback) -> str:
    """Write a BackupAndRestore callback's sharded backup now (the previous
    one kept as `previous.ckpt` with `double_checkpoint`); its path.
    Collective: call on every rank."""
    latest_path = os.path.join(callback.backup_dir, BACKUP_NAME)
    groups = _storage.storage_groups(callback.backup_dir)  # makes the folder
    if _storage.leads(groups):
        if callback.double_checkpoint:
            _files.settle(latest_path)
            if _location.has_marker(latest_path):
                previous = os.path.join(
                    callback.backup_dir, PREVIOUS_BACKUP_NAME
                )
                _files.settle(previous)
                if os.path.exists(previous):
                    _files.remove_checkpoint(previous)
                _files.rename(latest_path, previous)
    agreement.barrier()
    epoch, batch = _keras.backup_position(callback)
    extra = {"epoch": epoch, "batch": batch}
    _add_position(extra)
    callback._ktd_saved_at = position.reached()
    _dcp.save(callback.model, latest_path, extra=extra)
    return latest_path


def backup_load(original, callback):
    """Keras `BackupAndRestore._load_model`. Collective: call on every rank."""
    model = callback.model
    if not model.built:
        return original(callback)  # Keras' error for an unbuilt model
    candidates = [os.path.join(callback.backup_dir, BACKUP_NAME)]
    if callback.double_checkpoint:
        candidates.append(
            os.path.join(callback.backup_dir, PREVIOUS_BACKUP_NAME)
        )
    candidates = [path for path in candidates if _location.is_checkpoint(path)]
    for index, path in enumerate(candidates):
        try:
            extra = _dcp.load(model, path) or {}
        except DamagedCheckpointError as error:
            if index + 1 == len(candidates):
                raise
            logger.error(
                "BackupAndRestore: the backup %s is damaged (%s); resuming "
                "from the one before it, %s.",
                path,
                error,
                candidates[index + 1],
            )
            continue
        _resume(model, extra, path)
        return None
    return original(callback)


def backup_train_end(original, callback, logs=None):
    """Keras `BackupAndRestore.on_train_end`. Collective: call on every rank."""
    if not runtime.is_multi_process():
        return original(callback, logs)
    if callback.delete_checkpoint:
        groups = _storage.storage_groups(callback.backup_dir)
        agreement.barrier()
        if _storage.leads(groups) and os.path.exists(callback.backup_dir):
            shutil.rmtree(callback.backup_dir)
        _storage.forget_storage(callback.backup_dir)
        agreement.barrier()
    return None

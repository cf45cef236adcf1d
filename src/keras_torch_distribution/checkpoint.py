"""Sharded checkpoints of Keras models over `torch.distributed.checkpoint`.

    from keras_torch_distribution import checkpoint

    checkpoint.save(model, "ckpt/epoch-3", extra={"epoch": 3})
    extra = checkpoint.load(model, "ckpt/epoch-3")    # -> {"epoch": 3}

What is stored, keyed by Keras variable paths:
- ``model/<path>`` for every variable of ``model.variables`` (weights,
  non-trainable state such as BatchNormalization statistics), its Keras path
  without the model's own name (``model/col/kernel``), and
  ``model/<layer>/seed_generator_<i>`` for the states of the layers'
  SeedGenerators (what a resume needs for its random draws);
- ``optimizer/<path>`` for every variable of ``model.optimizer.variables``
  without the optimizer's name (``optimizer/iteration``,
  ``optimizer/learning_rate``, ``optimizer/col/kernel/momentum``: slots are
  keyed by their model variable's key), unless ``optimizer=False``;
so a checkpoint survives code that builds the same model again, even where
Keras numbers the model, optimizer or generator names differently.
- ``keras_checkpoint.json``: the format, the variables and their shapes, the
  number of processes that wrote it and the JSON-serializable ``extra`` (for
  example the epoch and step to resume from).

A variable whose layout shards it is saved as its DTensor, so each rank
writes only its own shards; replicated variables (plain tensors) are written
once (DCP de-duplicates them). Loading goes through DCP's planner into the
target model's own tensors, so it reshards: a checkpoint written by 2
processes with one mesh/LayoutMap loads on 1, 2 or 4 processes with another
mesh, another LayoutMap or no distribution at all, each rank reading only
the blocks it holds (plain targets read the full values).

Completeness: every rank writes into ``<path>.incomplete``; once DCP has
finished on every rank, rank 0 writes ``keras_checkpoint.json`` into it and
renames the directory to ``<path>`` (a replaced checkpoint is first moved to
``<path>.old`` and removed after). A checkpoint being written when a process
died is therefore never found at ``<path>``, and `load` of anything that is
not a complete checkpoint raises.

`async_save` stages the values into CPU memory, writes in a background
thread over a separate gloo process group, and returns a
`PendingCheckpoint` whose `result()` completes it (collective).
"""

import json
import os
import re
import shutil
import threading
import warnings

import keras
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from keras_torch_distribution import _keras_compat
from keras_torch_distribution import runtime
from keras_torch_distribution.log import logger

FORMAT = "keras_torch_distribution.checkpoint"
FORMAT_VERSION = 1
MARKER = "keras_checkpoint.json"
INCOMPLETE_SUFFIX = ".incomplete"
OLD_SUFFIX = ".old"
MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optimizer/"

__all__ = [
    "CheckpointMismatchError",
    "NotACheckpointError",
    "PendingCheckpoint",
    "ShardedCheckpoint",
    "async_save",
    "is_checkpoint",
    "latest",
    "load",
    "save",
    "variables_by_key",
]


class NotACheckpointError(FileNotFoundError):
    """A path holds no complete checkpoint."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's variables do not match the model's."""

    def __init__(self, message, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


# ---------------------------------------------------------------------------
# The state dict: Keras variables by path.
# ---------------------------------------------------------------------------


def _strip(prefix, path):
    return path[len(prefix):] if path.startswith(prefix) else path


def _model_keys(model):
    """{id(variable): key} for the model's variables.

    A key is the variable's Keras path without the model's own name (so a
    model rebuilt as `sequential_1` still matches `sequential`); the state of
    a SeedGenerator, whose path is a global counter, is keyed by its layer.
    """
    keys = {}
    for layer_name, states in _keras_compat.layer_seed_states(model):
        for index, state in enumerate(states):
            keys[id(state)] = f"{layer_name}/seed_generator_{index}"
    prefix = model.name + "/"
    for variable in model.variables:
        keys.setdefault(id(variable), _strip(prefix, variable.path))
    return keys


def _optimizer_key(optimizer, variable, trainable_keys):
    """An optimizer variable's path without the optimizer's name, with the
    model variable it belongs to (if any) written as that variable's key:
    'adam_1/sequential_1_col_kernel_momentum' -> 'col/kernel/momentum'."""
    name = _strip(optimizer.name + "/", variable.path)
    best = None
    for underscored, key in trainable_keys:
        if name.startswith(underscored + "_") and (
            best is None or len(underscored) > len(best[0])
        ):
            best = (underscored, key)
    if best is None:
        return name
    return best[1] + "/" + name[len(best[0]) + 1 :]


def _variables(model, optimizer):
    """{key: variable} for the model (and its optimizer's) variables."""
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so it has no variables to "
            "save or load. Build it first (call it on a batch, or "
            "`model.build(input_shape)`)."
        )
    model_keys = _model_keys(model)
    entries = [(MODEL_PREFIX + model_keys[id(v)], v) for v in model.variables]
    opt = _optimizer_of(model)
    if optimizer and opt is not None and opt.built:
        trainable_keys = [
            (v.path.replace("/", "_"), model_keys[id(v)])
            for v in model.trainable_variables
        ]
        entries += [
            (OPTIMIZER_PREFIX + _optimizer_key(opt, v, trainable_keys), v)
            for v in opt.variables
        ]
    named = {}
    for key, variable in entries:
        if key in named and named[key] is not variable:
            raise ValueError(
                f"Two variables of model {model.name!r} have the checkpoint "
                f"key {key!r} ({named[key].path!r} and {variable.path!r}), so "
                "a checkpoint cannot tell them apart. Give the layers (or "
                "their weights) unique names."
            )
        named[key] = variable
    return named


def variables_by_key(model, optimizer=True):
    """{checkpoint key: variable} of what `save` stores for `model` (no
    collective)."""
    return _variables(model, optimizer)


def _tensor(variable):
    """The tensor DCP reads from and loads into: the variable's own storage
    (a DTensor for a sharded variable), without autograd."""
    return _keras_compat.raw_value(variable).detach()


def _state_dict(variables):
    return {key: _tensor(v) for key, v in variables.items()}


def _optimizer_of(model):
    """The model's optimizer, None for a model never compiled."""
    return getattr(model, "optimizer", None)


def _optimizer_ready_for(model, saved_keys):
    """Build the model's optimizer when the checkpoint holds its state."""
    opt = _optimizer_of(model)
    if opt is None or opt.built:
        return
    if any(k.startswith(OPTIMIZER_PREFIX) for k in saved_keys):
        opt.build(model.trainable_variables)


# ---------------------------------------------------------------------------
# Paths and completion.
# ---------------------------------------------------------------------------


def _normalize(path):
    path = os.fspath(path)
    if not path:
        raise ValueError("The checkpoint path is empty; give a directory path.")
    return os.path.abspath(path.rstrip(os.sep) or os.sep)


def is_checkpoint(path):
    """True when `path` is a complete checkpoint written by `save`."""
    path = _normalize(path)
    return os.path.isfile(os.path.join(path, MARKER)) and os.path.isfile(
        os.path.join(path, ".metadata")
    )


def read_marker(path):
    path = _normalize(path)
    if not is_checkpoint(path):
        hint = ""
        if os.path.isdir(path + INCOMPLETE_SUFFIX):
            hint = (
                f" {path + INCOMPLETE_SUFFIX!r} exists: a checkpoint was being "
                "written there when a process stopped; it is incomplete and "
                "will never be loaded."
            )
        if os.path.isdir(path + OLD_SUFFIX) and is_checkpoint(path + OLD_SUFFIX):
            hint += (
                f" The previous complete checkpoint is at {path + OLD_SUFFIX!r} "
                "(a process stopped while replacing it); load that one."
            )
        what = "does not exist" if not os.path.exists(path) else (
            f"has no {MARKER!r} and '.metadata'"
        )
        raise NotACheckpointError(
            f"{path!r} is not a complete checkpoint: it {what}. Expected a "
            "directory written by keras_torch_distribution.checkpoint.save "
            f"(or ShardedCheckpoint); pass such a directory.{hint}"
        )
    with open(os.path.join(path, MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT:
        raise NotACheckpointError(
            f"{path!r}/{MARKER} has format {marker.get('format')!r}, expected "
            f"{FORMAT!r}. Pass a directory written by checkpoint.save."
        )
    return marker


def _barrier(group=None):
    if runtime.num_processes() > 1:
        dist.barrier(group=group)


def _no_dist():
    return not runtime.is_initialized()


class _OneProcessIsIntended(warnings.catch_warnings):
    """Silence DCP's warning that it assumes one process when
    torch.distributed is not started (a plain one-process Keras run)."""

    def __enter__(self):
        result = super().__enter__()
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        return result


def _prepare_directory(path, group=None):
    """Check the target, clear a stale temporary directory. Collective."""
    if os.path.exists(path) and not is_checkpoint(path):
        raise FileExistsError(
            f"Cannot save a checkpoint to {path!r}: it exists and is not a "
            "checkpoint, and saving would replace it. Choose another path or "
            "remove it."
        )
    if runtime.process_id() == 0:
        shutil.rmtree(path + INCOMPLETE_SUFFIX, ignore_errors=True)
        os.makedirs(path + INCOMPLETE_SUFFIX)
    _barrier(group)


def _finish(path, marker, group=None):
    """Rank 0 marks the temporary directory complete and renames it into
    place; every rank returns once it is there. Collective."""
    _barrier(group)
    if runtime.process_id() == 0:
        temporary = path + INCOMPLETE_SUFFIX
        marker_path = os.path.join(temporary, MARKER)
        with open(marker_path, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = path + OLD_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(temporary, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)


def _marker(variables, optimizer, extra):
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "keras_version": keras.__version__,
        "torch_version": torch.__version__,
        "num_processes": runtime.num_processes(),
        "optimizer": bool(optimizer),
        "variables": {k: list(v.shape) for k, v in variables.items()},
        "extra": extra,
    }


def _check_extra(extra):
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"extra={extra!r} cannot be stored: it must be JSON-serializable "
            f"({error}). Pass plain dicts, lists, strings and numbers, e.g. "
            "extra={'epoch': 3, 'step': 120}."
        ) from error


def _begin_save(model, path, optimizer, extra, group=None):
    _check_extra(extra)
    path = _normalize(path)
    variables = _variables(model, optimizer)
    optimizer = any(k.startswith(OPTIMIZER_PREFIX) for k in variables)
    _prepare_directory(path, group)
    return path, variables, _marker(variables, optimizer, extra)


def save(model, path, optimizer=True, extra=None):
    """Save `model` (and its optimizer) as a sharded checkpoint at `path`.

    Each rank writes only the shards it holds; replicated variables are
    written once. `extra` (JSON-serializable, e.g. ``{"epoch": 3}``) is
    stored with it and returned by `load`. `path` is a directory; an
    existing checkpoint there is replaced only once the new one is complete.
    Collective: call on every rank.
    """
    path, variables, marker = _begin_save(model, path, optimizer, extra)
    with _OneProcessIsIntended():
        dcp.save(
            _state_dict(variables),
            checkpoint_id=path + INCOMPLETE_SUFFIX,
            no_dist=_no_dist(),
        )
    _finish(path, marker)
    return path


_async_group = []


def _async_process_group():
    """A gloo group of all ranks for background saves, created once so the
    writer thread's collectives never interleave with training's."""
    if _no_dist():
        return None
    if not _async_group:
        _async_group.append(dist.new_group(backend="gloo"))
    return _async_group[0]


class PendingCheckpoint:
    """An `async_save` in progress. `result()` waits for the files and makes
    the checkpoint complete (renames it into place); until then `path` holds
    no checkpoint. Collective: call `result()` on every rank."""

    def __init__(self, future, path, marker, group):
        self._future = future
        self.path = path
        self._marker = marker
        self._group = group
        self._done = False
        self._lock = threading.Lock()

    def done(self):
        """True once this rank's files are written (no collective)."""
        return self._future.done()

    def result(self):
        """Wait for every rank's files, then complete the checkpoint.
        Collective: call on every rank."""
        with self._lock:
            if not self._done:
                self._future.result()
                _finish(self.path, self._marker, self._group)
                self._done = True
        return self.path


def async_save(model, path, optimizer=True, extra=None):
    """Like `save`, but returns after copying the values into CPU memory;
    the files are written by a background thread (torch's
    `dcp.async_save`, over a separate gloo process group made on the first
    call). Training may change the variables meanwhile. Call `result()` on
    the returned `PendingCheckpoint` (every rank) before the next save to
    the same path and before exiting: only then is the checkpoint complete.
    Collective: call on every rank.
    """
    group = _async_process_group()
    path, variables, marker = _begin_save(model, path, optimizer, extra, group)
    with _OneProcessIsIntended():
        future = dcp.async_save(
            _state_dict(variables),
            checkpoint_id=path + INCOMPLETE_SUFFIX,
            process_group=group,
            no_dist=_no_dist(),
        )
    return PendingCheckpoint(future, path, marker, group)


def _check_matches(model, path, marker, variables, saved):
    """Raise CheckpointMismatchError listing what does not match."""
    missing = sorted(k for k in variables if k not in saved)
    unexpected = sorted(k for k in saved if k not in variables)
    mismatched = sorted(
        (k, tuple(saved[k]), tuple(variables[k].shape))
        for k in variables
        if k in saved and tuple(saved[k]) != tuple(variables[k].shape)
    )
    if not (missing or unexpected or mismatched):
        return
    lines = [
        f"Checkpoint {path!r} does not match model {model.name!r}:"
    ]
    if missing:
        lines.append(f"- missing from the checkpoint ({len(missing)}): {missing}")
    if unexpected:
        lines.append(
            f"- in the checkpoint but not in the model ({len(unexpected)}): "
            f"{unexpected}"
        )
    if mismatched:
        lines.append(
            "- shape mismatches (checkpoint shape, model shape): "
            + ", ".join(f"{k}: {a} vs {b}" for k, a, b in mismatched)
        )
    hint = "Build the same model (same layer names) as the one saved"
    if any(k.startswith(OPTIMIZER_PREFIX) for k in missing + unexpected):
        hint += (
            "; pass optimizer=False to load only the model variables "
            "(a checkpoint saved with optimizer=False, or a model compiled "
            "with another optimizer)"
        )
    lines.append(hint + ".")
    raise CheckpointMismatchError(
        "\n".join(lines), missing, unexpected, mismatched
    )


def load(model, path, optimizer=True):
    """Load the checkpoint at `path` into `model` (and its optimizer); return
    the `extra` it was saved with.

    Reshards: the model may use any mesh, LayoutMap or none, on any number
    of processes; each rank reads the blocks it holds. The model's optimizer
    is built first when the checkpoint holds optimizer state.
    `optimizer=False` loads only the model variables. Raises
    NotACheckpointError for a path that is not a complete checkpoint and
    CheckpointMismatchError listing missing, unexpected and mis-shaped
    variables. Collective: call on every rank.
    """
    path = _normalize(path)
    marker = read_marker(path)
    saved = marker["variables"]
    _variables(model, False)  # raises for an unbuilt model
    if optimizer:
        _optimizer_ready_for(model, saved)
    else:
        saved = {k: v for k, v in saved.items() if k.startswith(MODEL_PREFIX)}
    variables = _variables(model, optimizer)
    if optimizer and _optimizer_of(model) is None:
        saved = {k: v for k, v in saved.items() if k.startswith(MODEL_PREFIX)}
    _check_matches(model, path, marker, variables, saved)
    with _OneProcessIsIntended():
        dcp.load(_state_dict(variables), checkpoint_id=path, no_dist=_no_dist())
    logger.info("loaded %d variables from %s", len(variables), path)
    return marker.get("extra")


def read_extra(path):
    """The `extra` a checkpoint was saved with (no collective)."""
    return read_marker(path).get("extra")


_NAME = re.compile(r"^ckpt-(\d+)$")


def latest(directory):
    """The newest complete checkpoint `ShardedCheckpoint` wrote in
    `directory` (the highest step), or None."""
    directory = _normalize(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match and is_checkpoint(os.path.join(directory, name)):
            found.append((int(match.group(1)), name))
    return os.path.join(directory, max(found)[1]) if found else None


class ShardedCheckpoint(keras.callbacks.Callback):
    """Save a sharded checkpoint every epoch (or every `save_freq` batches)
    into `directory/ckpt-<step>`, with ``extra={"epoch", "batch", "step"}``.

    `restore=True` loads the newest complete checkpoint of `directory` when
    `fit` begins and resumes from the epoch after it (checkpoints taken in
    the middle of an epoch resume at that epoch's start, as BackupAndRestore
    does). `max_to_keep` keeps only the newest ones. `async_save=True` writes
    in the background; each save completes the previous one first and
    `fit` completes the last before it returns. Every rank must run the
    callback (saving is collective).
    """

    def __init__(
        self,
        directory,
        save_freq="epoch",
        optimizer=True,
        max_to_keep=None,
        restore=False,
        async_save=False,
    ):
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
        self.directory = _normalize(directory)
        self.save_freq = save_freq
        self.optimizer = optimizer
        self.max_to_keep = max_to_keep
        self.restore = restore
        self.async_save = async_save
        self._pending = None
        self._step = 0
        self._epoch = 0
        self._batches_since_save = 0

    def on_train_begin(self, logs=None):
        self._step = 0
        if self.restore:
            found = latest(self.directory)
            if found is not None:
                extra = load(self.model, found, optimizer=self.optimizer) or {}
                self._step = int(extra.get("step", 0))
                _keras_compat.set_initial_epoch(self.model, int(extra.get("epoch", 0)))
                logger.info("resuming from %s (epoch %s)", found, extra.get("epoch"))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self.save_freq == "epoch":
            return
        self._batches_since_save += 1
        if self._batches_since_save >= self.save_freq:
            self._batches_since_save = 0
            self._save(epoch=self._epoch, batch=batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs=None):
        self._complete_pending()

    def _complete_pending(self):
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            self._prune()

    def _save(self, epoch, batch):
        self._complete_pending()
        if runtime.process_id() == 0:
            os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"ckpt-{self._step:09d}")
        extra = {"epoch": epoch, "batch": batch, "step": self._step}
        if self.async_save:
            self._pending = async_save(self.model, path, self.optimizer, extra)
        else:
            save(self.model, path, self.optimizer, extra)
            self._prune()

    def _prune(self):
        """Rank 0 removes all but the newest `max_to_keep`. Collective."""
        if self.max_to_keep is None:
            return
        if runtime.process_id() == 0:
            found = sorted(
                name for name in os.listdir(self.directory) if _NAME.match(name)
                and is_checkpoint(os.path.join(self.directory, name))
            )
            for name in found[: -self.max_to_keep]:
                shutil.rmtree(os.path.join(self.directory, name))
        _barrier()


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
# of this module (each rank writes its shards, complete or absent, with the
# epoch in its `extra`), and remove the directory from rank 0 between
# barriers. One-process runs keep Keras' own behaviour; a backup Keras wrote
# in one process is still restored in a multi-process run.

BACKUP_NAME = "latest.ckpt"
PREVIOUS_BACKUP_NAME = "previous.ckpt"


def _multi_process():
    return runtime.num_processes() > 1


def backup_save(original, callback):
    """BackupAndRestore._save_model. Collective: call on every rank."""
    if not _multi_process():
        return original(callback)
    latest_path = os.path.join(callback.backup_dir, BACKUP_NAME)
    if runtime.process_id() == 0:
        os.makedirs(callback.backup_dir, exist_ok=True)
        if callback.double_checkpoint and is_checkpoint(latest_path):
            previous = os.path.join(callback.backup_dir, PREVIOUS_BACKUP_NAME)
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(latest_path, previous)
    _barrier()
    save(
        callback.model,
        latest_path,
        extra={"epoch": callback._current_epoch, "batch": callback._last_batch_seen},
    )


def backup_load(original, callback):
    """BackupAndRestore._load_model. Collective: call on every rank."""
    model = callback.model
    if not model.built:
        return original(callback)  # Keras' error for an unbuilt model
    candidates = [os.path.join(callback.backup_dir, BACKUP_NAME)]
    if callback.double_checkpoint:
        candidates.append(os.path.join(callback.backup_dir, PREVIOUS_BACKUP_NAME))
    for path in candidates:
        if is_checkpoint(path):
            extra = load(model, path) or {}
            _keras_compat.set_initial_epoch(model, int(extra.get("epoch", 0)))
            logger.info("BackupAndRestore: resuming at epoch %s from %s",
                        extra.get("epoch"), path)
            return None
    return original(callback)


def backup_train_end(original, callback, logs=None):
    """BackupAndRestore.on_train_end. Collective: call on every rank."""
    if not _multi_process():
        return original(callback, logs)
    if callback.delete_checkpoint:
        _barrier()
        if runtime.process_id() == 0:
            shutil.rmtree(callback.backup_dir, ignore_errors=True)
        _barrier()
    return None

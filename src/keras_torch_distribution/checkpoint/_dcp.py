"""Saving and loading through `torch.distributed.checkpoint` (DCP), checked:
`save`, `async_save`, `load`.

Every file goes through the checked file system (`_streams`), `.metadata`
is read by the restricted unpickler (`_unpickler`), and a save is complete
only once its marker is written (`_files`).

`async_save` returns a `PendingCheckpoint` (`_pending`); one never
completed with `result()` is completed (with a warning) when the
interpreter exits (`complete_at_exit`).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING
from typing import Any

import keras
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import keras_torch_distribution.checkpoint._checksums as _checksums
import keras_torch_distribution.checkpoint._files as _files
import keras_torch_distribution.checkpoint._keys as _keys
import keras_torch_distribution.checkpoint._location as _location
import keras_torch_distribution.checkpoint._storage as _storage
from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import note
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import CheckpointError
from keras_torch_distribution.checkpoint._pending import PendingCheckpoint
from keras_torch_distribution.checkpoint._pending import _complete_all_pending
from keras_torch_distribution.checkpoint._pending import _complete_pending_for
from keras_torch_distribution.checkpoint._pending import _discarded_on_failure
from keras_torch_distribution.checkpoint._pending import _unfinished
from keras_torch_distribution.checkpoint._pending import _unfinished_lock
from keras_torch_distribution.checkpoint._pending import note_saved
from keras_torch_distribution.checkpoint._staging import staging_memory
from keras_torch_distribution.checkpoint._streams import _no_dist
from keras_torch_distribution.checkpoint._streams import _OneProcessIsIntended
from keras_torch_distribution.checkpoint._streams import _Reader
from keras_torch_distribution.checkpoint._streams import _translated
from keras_torch_distribution.checkpoint._streams import _Writer
from keras_torch_distribution.checkpoint._unpickler import read_metadata

if TYPE_CHECKING:
    pass


def _marker(variables, optimizer, extra):
    return {
        "format": _location.FORMAT,
        "format_version": _location.FORMAT_VERSION,
        "keras_version": keras.__version__,
        "torch_version": torch.__version__,
        "num_processes": runtime.num_processes(),
        "optimizer": bool(optimizer),
        "variables": {k: list(v.shape) for k, v in variables.items()},
        "mesh": _mesh_of(_keras.current_distribution()),
        "extra": extra,
    }


def _mesh_of(distribution):
    """The distribution's mesh (shape, axis names, batch axis) for the
    marker, so that `ktd report` advises on the axes fit does; None
    without one."""
    mesh = getattr(distribution, "device_mesh", None)
    if mesh is None:
        return None
    return {
        "shape": [int(n) for n in mesh.shape],
        "axis_names": list(mesh.axis_names),
        "batch_axis": getattr(distribution, "batch_dim_name", None),
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


def _agree_on(call):
    """Every rank is in `call`: a save on some ranks only raises on every
    rank, naming what the others do (`agreement.compare`)."""
    if runtime.is_multi_process():
        agreement.compare(call, [])


def _begin_save(model, path, optimizer, extra, group=None):
    _check_extra(extra)
    path = _location.normalize(path)
    _complete_pending_for(path)
    variables = _keys.variables_by_key(model, optimizer)
    optimizer = _keys.has_optimizer_state(variables)
    _files.prepare_directory(path, group)
    return path, variables, _marker(variables, optimizer, extra)


def save(
    model: keras.Model,
    path: str | os.PathLike[str],
    optimizer: bool = True,
    extra: Any = None,
) -> str:
    """Save `model` (and its optimizer) as a sharded checkpoint at `path`.

    Each rank writes only the shards it holds; replicated variables are
    written once. `extra` (JSON-serializable, e.g. ``{"epoch": 3}``) is
    stored with it and returned by `load`. `path` is a directory; an
    existing checkpoint there is replaced only once the new one is complete.
    Raises CheckpointWriteError naming the file, the rank and the operating
    system's error when a rank cannot write. Collective: call on every rank.

    Args:
        model: the built `keras.Model` to save.
        path: the checkpoint's directory.
        optimizer: whether to save the model's optimizer state too (when
            the model has a built optimizer).
        extra: JSON-serializable data stored with the checkpoint (for
            example the epoch and step to resume from), returned by `load`.

    Returns:
        The checkpoint's directory, as an absolute path.
    """
    started = time.perf_counter()
    _agree_on("checkpoint.save()")
    path, variables, marker = _begin_save(model, path, optimizer, extra)
    writer = _Writer(path + _location.INCOMPLETE_SUFFIX)
    with (
        _discarded_on_failure(path),
        _OneProcessIsIntended(),
        _translated("save", path),
    ):
        dcp.save(
            _keys.state_dict(variables),
            storage_writer=writer,
            no_dist=_no_dist(),
        )
    size = _files.finish(path, marker, writer.fs.written)
    note_saved(path, size, started)
    return path


_async_group = {}  # world group -> its gloo group for background saves


def _async_process_group():
    """A gloo group of all ranks for background saves, created once per
    process group (a group from before the process group was destroyed and
    started again is dead) so the writer thread's collectives never
    interleave with training's. Collective the first time: every rank
    saves."""
    if _no_dist():
        return None
    world = dist.group.WORLD
    if world not in _async_group:
        _async_group.clear()
        _async_group[world] = dist.new_group(backend="gloo")
    return _async_group[world]


def async_save(
    model: keras.Model,
    path: str | os.PathLike[str],
    optimizer: bool = True,
    extra: Any = None,
) -> PendingCheckpoint:
    """Like `save`, but returns after copying the values into CPU memory
    (on CUDA, pinned memory reused by the next saves: `StagingMemory`;
    pending saves then complete before the next one copies); the files are
    written by a background thread (torch's
    `dcp.async_save`, over a separate gloo process group made on the first
    call). Training may change the variables meanwhile. Call `result()` on
    the returned `PendingCheckpoint` (every rank) before exiting: only then
    is the checkpoint complete (a later save to the same path completes it
    first; one still pending at exit is completed then, with a warning).
    Collective: call on every rank.

    Args:
        model: the built `keras.Model` to save.
        path: the checkpoint's directory.
        optimizer: whether to save the model's optimizer state too (when
            the model has a built optimizer).
        extra: JSON-serializable data stored with the checkpoint (for
            example the epoch and step to resume from), returned by `load`.

    Returns:
        A `PendingCheckpoint`; its `result()` (on every rank) completes the
        checkpoint and returns its directory.
    """
    _agree_on("checkpoint.async_save()")
    group = _async_process_group()
    path, variables, marker = _begin_save(model, path, optimizer, extra, group)
    writer = _Writer(path + _location.INCOMPLETE_SUFFIX)
    state_dict = _keys.state_dict(variables)
    stager = staging_memory.stager_for(state_dict)
    staging = {}
    if stager is not None:
        # The saves still writing read the staged copy this one overwrites:
        # they complete first (collective: every rank has the same ones).
        _complete_all_pending()
        staging["async_stager"] = stager
    with _OneProcessIsIntended(), _translated("save", path):
        future = dcp.async_save(
            state_dict,
            storage_writer=writer,
            process_group=group,
            no_dist=_no_dist(),
            **staging,
        )
    pending = PendingCheckpoint(future, path, marker, group, writer)
    with _unfinished_lock:
        _unfinished.append(pending)
    return pending


def complete_at_exit() -> None:
    """Complete every async save whose `result()` was never called, loudly.
    The first step of the package's exit sequence (`_install.exit_sequence`),
    before the process group goes. Collective (every rank has the same
    pending saves, and exits through here)."""
    with _unfinished_lock:
        pending = list(_unfinished)
    for handle in pending:
        if handle._group is not None and not runtime.is_initialized():
            logger.error(
                "checkpoint.async_save to %s was never completed with "
                ".result(), and torch.distributed is already shut down, so it "
                "cannot be completed now: %s is incomplete and will never be "
                "loaded. Call .result() on every rank before "
                "destroy_process_group() or exiting.",
                handle.path,
                handle.path + _location.INCOMPLETE_SUFFIX,
            )
            with _unfinished_lock:
                _unfinished.remove(handle)
            continue
        logger.warning(
            "checkpoint.async_save to %s was never completed with .result(); "
            "completing it at exit. Call .result() on every rank before "
            "exiting (ShardedCheckpoint does this when fit ends).",
            handle.path,
        )
        try:
            handle.result()
        except (CheckpointError, RuntimeError) as error:
            # RuntimeError: torch's collective errors (a peer is gone). The
            # exit sequence goes on; the save stays incomplete, never loaded.
            logger.error(
                "completing checkpoint.async_save to %s at exit failed (%s): "
                "%s stays incomplete and is never loaded; the next start "
                "uses the newest complete checkpoint.",
                handle.path,
                error,
                handle.path + _location.INCOMPLETE_SUFFIX,
            )


def forget_process_groups() -> None:
    """Drop the background-save group once the process group is destroyed
    (it is dead then), so that torch frees it while the interpreter runs;
    and the staging memory and which ranks share which folders with it."""
    _async_group.clear()
    staging_memory.clear()
    _storage.forget_storage()


def load(
    model: keras.Model, path: str | os.PathLike[str], optimizer: bool = True
) -> Any:
    """Load the checkpoint at `path` into `model` (and its optimizer); return
    the `extra` it was saved with.

    Reshards: the model may use any mesh, LayoutMap or none, on any number
    of processes; each rank reads the blocks it holds. The model's optimizer
    is built first when the checkpoint holds optimizer state.
    `optimizer=False` loads only the model variables.

    Nothing in the checkpoint is run: its `.metadata` is read with an
    unpickler that admits only DCP's metadata classes, and every file is
    checked against the size and CRC-32 its writer recorded before it is
    read. Raises NotACheckpointError for a path that is not a complete
    checkpoint, DamagedCheckpointError (naming the file and the rank that
    wrote it) for a damaged one, UnsafeCheckpointError for metadata that
    refers to anything else, and CheckpointMismatchError listing missing,
    unexpected and mis-shaped variables. Collective: call on every rank.

    Args:
        model: the built `keras.Model` to load into.
        path: the checkpoint's directory.
        optimizer: whether to load the optimizer state too (when the
            checkpoint holds it).

    Returns:
        The `extra` the checkpoint was saved with (None when none was).
    """
    started = time.perf_counter()
    path = _location.normalize(path)

    def check():
        directory, marker = _location.locate(path)
        _checksums.check_sizes(directory, marker)
        return directory, marker, read_metadata(directory, marker)

    directory, marker, metadata = agreement.agree(check)
    if not _checksums.file_entries(marker):
        logger.warning(
            "%s was written before checkpoints carried checksums "
            "(format_version 1): its files cannot be verified.",
            directory,
        )
    saved = marker["variables"]
    _keys.variables_by_key(model, False)  # raises for an unbuilt model
    if optimizer:
        _keys.optimizer_ready_for(model, saved)
    else:
        saved = _keys.model_keys_only(saved)
    variables = _keys.variables_by_key(model, optimizer)
    if optimizer and _keys.optimizer_of(model) is None:
        saved = _keys.model_keys_only(saved)
    _keys.check_matches(model, path, variables, saved)
    reader = _Reader(directory, marker, metadata)
    with _OneProcessIsIntended(), _translated("load", directory):
        dcp.load(
            _keys.state_dict(variables),
            storage_reader=reader,
            no_dist=_no_dist(),
        )
    size = sum(e["bytes"] for e in _checksums.file_entries(marker).values())
    note(
        "checkpoint restored: %s (%d variables, %s, %.2f s)",
        directory,
        len(variables),
        human_bytes(size) if size else "size not recorded",
        time.perf_counter() - started,
    )
    return marker.get("extra")


def read_extra(path: str | os.PathLike[str]) -> Any:
    """The `extra` a checkpoint was saved with (no collective)."""
    return _location.read_marker(path).get("extra")

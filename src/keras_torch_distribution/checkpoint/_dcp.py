"""Saving and loading through `torch.distributed.checkpoint` (DCP), checked.

- Every file a rank writes goes through `_CheckedFileSystem`, which computes
  its CRC-32 while writing (`_HashingStream`) and turns an operating-system
  error into a `CheckpointWriteError` naming the file, the rank and the
  error ("No space left on device", "File too large"); the sizes and
  checksums end up in the completion marker (`_files.finish`).
- Reading never unpickles anything but DCP's metadata classes:
  `read_metadata` uses `_MetadataUnpickler`, which admits only the classes a
  `.metadata` written by `save` refers to, and then checks that every entry
  is a tensor stored in a file of the checkpoint. (DCP's own reader uses
  `pickle.load`, which runs whatever a `.metadata` file asks for; the
  tensors themselves are read with `torch.load(weights_only=True)`.)
- Before a rank reads a file, it checks the file's size and CRC-32 against
  the marker (`DamagedCheckpointError` names the file and its writer).
- DCP reports failures as `CheckpointException`, a `BaseException` whose
  message hides the cause; `_translated` re-raises it on every rank as the
  failing rank's `CheckpointError`.

`async_save` returns a `PendingCheckpoint`; one never completed with
`result()` is completed (with a warning) when the interpreter exits.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pickle
import threading
import time
import warnings
import zlib
from typing import TYPE_CHECKING
from typing import Any

import keras
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import staging as dcp_staging
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

import keras_torch_distribution.checkpoint._files as _files
import keras_torch_distribution.checkpoint._keys as _keys
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import note
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import CheckpointError
from keras_torch_distribution.checkpoint._errors import CheckpointReadError
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import UnsafeCheckpointError

if TYPE_CHECKING:
    from concurrent.futures import Future

# Computing checksums while saving; off only to measure what they cost
# (benchmarks/checkpoint_checksum.py).
CHECKSUMS_ON_SAVE = True
# How checkpoint files are opened for writing (tests put a file system that
# fills up here when they cannot mount a small one).
_open = open


# ---------------------------------------------------------------------------
# The restricted metadata reader.
# ---------------------------------------------------------------------------

# What a `.metadata` written by `save` refers to (`pickletools.dis` of one):
# DCP's metadata dataclasses, the filesystem's storage info, torch.Size,
# dtypes, the layout lookup, and the checkpoint's path as a pathlib path.
_ADMITTED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global (a function
    to call, a class to build) raises UnsafeCheckpointError naming it."""

    def __init__(self, file, path):
        super().__init__(file)
        self._path = path

    def find_class(self, module, name):
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise UnsafeCheckpointError(
            f"{self._path!r} refers to {module}.{name}, which the metadata of "
            "a checkpoint written by keras_torch_distribution never holds, so "
            "it was refused without being run. Only DCP's metadata classes, "
            "torch.Size and dtypes are admitted. Load only checkpoints you "
            "or your job wrote; this one was made or altered by something "
            "else.",
            self._path,
            0,
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(
            f"{self._path!r} holds a persistent reference ({pid!r}), which the "
            "metadata of a checkpoint written by keras_torch_distribution "
            "never holds; refused.",
            self._path,
            0,
        )


def _unsafe(path, what):
    return UnsafeCheckpointError(
        f"{path!r} {what}, which a checkpoint written by "
        "keras_torch_distribution never holds; refused. Load only checkpoints "
        "you or your job wrote.",
        path,
        0,
    )


def read_metadata(
    directory: str, marker: dict[str, Any]
) -> dcp_metadata.Metadata:
    """DCP's Metadata of the checkpoint in `directory`, unpickled with the
    restricted unpickler after its size and checksum are verified, and
    checked: every entry a tensor, every file one the marker lists."""
    path = os.path.join(directory, _files.METADATA)
    entries = _files.file_entries(marker)
    if _files.METADATA in entries:
        _files.verify_file(directory, _files.METADATA, entries[_files.METADATA])
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as error:  # a torn or garbled pickle
            raise DamagedCheckpointError(
                f"{path!r} cannot be read as DCP metadata "
                f"({type(error).__name__}: {error}): the file is damaged. Load "
                "another checkpoint.",
                path,
                0,
            ) from error
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise _unsafe(
            path, f"holds a {type(metadata).__name__}, not DCP Metadata"
        )
    for key, entry in (metadata.state_dict_metadata or {}).items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise _unsafe(path, f"stores {key!r} as {type(entry).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise _unsafe(path, "has no storage table")
    for index, info in metadata.storage_data.items():
        if not isinstance(info, dcp_filesystem._StorageInfo):
            raise _unsafe(path, f"stores {index!r} as {type(info).__name__}")
        name = info.relative_path
        if (
            not isinstance(name, str)
            or os.path.basename(name) != name
            or name in ("", ".", "..")
            or (entries and name not in entries)
        ):
            raise _unsafe(
                path,
                f"points {index.fqn!r} at the file {name!r}, "
                "which is not one of the checkpoint's files",
            )
        if info.transform_descriptors:
            raise _unsafe(
                path,
                f"stores {index.fqn!r} through the transforms "
                f"{info.transform_descriptors!r}",
            )
    return metadata


# ---------------------------------------------------------------------------
# Checked file streams.
# ---------------------------------------------------------------------------


class _HashingStream:
    """A file being written: CRC-32 of every byte written, and the first
    operating-system error seen (torch's zip writer reports a failed write
    as 'unexpected pos', hiding the errno)."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0
        self.error = None
        self.hashing = CHECKSUMS_ON_SAVE

    def _io(self, method, *args):
        try:
            return method(*args)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise

    def write(self, data):
        written = self._io(self._raw.write, data)
        if self.hashing:
            self.crc = zlib.crc32(data, self.crc)
        return written

    def tell(self):
        return self._raw.tell()

    def flush(self):
        return self._io(self._raw.flush)

    def fileno(self):
        return self._raw.fileno()

    def close(self):
        return self._io(self._raw.close)

    @property
    def closed(self):
        return self._raw.closed


def _os_error_of(error, stream=None):
    """The operating-system error behind `error` (its cause chain, or what
    the stream saw), or None."""
    if stream is not None and stream.error is not None:
        return stream.error
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _CheckedFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system, checked: streams written are hashed and
    recorded in `written` ({name: {"bytes", "crc32"}}); a stream read is
    verified first against `expected` (the marker's entries) and a failure
    while reading names the file and its writer."""

    def __init__(self, marker=None):
        super().__init__()
        self._marker = marker or {}
        self._expected = _files.file_entries(self._marker)
        self._verified = set()
        self._lock = threading.Lock()
        self.written = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        path = os.fspath(path)
        if "w" in mode:
            with self._writing(path, mode) as stream:
                yield stream
        else:
            with self._reading(path, mode) as stream:
                yield stream

    @contextlib.contextmanager
    def _writing(self, path, mode):
        stream = None
        try:
            with _open(path, mode) as raw:
                stream = _HashingStream(raw)
                yield stream
                if not raw.closed:
                    stream.flush()
        except CheckpointError:
            raise
        except Exception as error:
            cause = _os_error_of(error, stream)
            reason = (
                f"{cause.strerror or cause} (errno {cause.errno})"
                if cause is not None
                else f"{type(error).__name__}: {error}"
            )
            rank = runtime.process_id()
            raise CheckpointWriteError(
                f"Rank {rank} could not write checkpoint file {path!r}: "
                f"{reason}. Free space or raise the limit (df -h, ulimit -f) "
                "or save elsewhere; the checkpoint was not completed and the "
                "previous one (if any) is unchanged.",
                path,
                rank,
            ) from error
        if stream.hashing:
            size = os.path.getsize(path)
            with self._lock:
                self.written[os.path.basename(path)] = {
                    "bytes": size,
                    _files.CHECKSUM: _files.crc32_hex(stream.crc),
                }

    @contextlib.contextmanager
    def _reading(self, path, mode):
        directory, name = os.path.split(path)
        entry = self._expected.get(name)
        if entry is not None and name not in self._verified:
            _files.verify_file(directory, name, entry)
            with self._lock:
                self._verified.add(name)
        try:
            with open(path, mode) as stream:
                yield stream
        except CheckpointError:
            raise
        except Exception as error:
            writer = _files.writer_of(self._marker, name)
            what = str(error) or "the file ends early"
            raise CheckpointReadError(
                f"Rank {runtime.process_id()} could not read checkpoint file "
                f"{path!r} (written by rank {writer}): "
                f"{type(error).__name__}: {what}. "
                "The file is damaged or was not written completely; load "
                "another checkpoint.",
                path,
                writer,
            ) from error

    def rename(self, path, new_path):
        super().rename(path, new_path)
        with self._lock:
            entry = self.written.pop(os.path.basename(os.fspath(path)), None)
            if entry is not None:
                self.written[os.path.basename(os.fspath(new_path))] = entry


class _Writer(dcp.FileSystemWriter):
    def __init__(self, directory):
        super().__init__(directory)
        self.fs = _CheckedFileSystem()


class _Reader(dcp.FileSystemReader):
    """Reads the checkpoint with `metadata` already read (restricted) and
    every file verified before it is read."""

    def __init__(self, directory, marker, metadata):
        super().__init__(directory)
        self.fs = _CheckedFileSystem(marker)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


@contextlib.contextmanager
def _translated(action, path):
    """Re-raise DCP's CheckpointException (a BaseException hiding its cause)
    as the first failing rank's CheckpointError, on every rank."""
    try:
        yield
    except CheckpointException as error:
        failures = sorted(error.failures.items())
        ranks = [rank for rank, _ in failures]
        ours = [
            (r, e) for r, (e, _) in failures if isinstance(e, CheckpointError)
        ]
        rank, cause = ours[0] if ours else (failures[0][0], failures[0][1][0])
        if isinstance(cause, CheckpointError):
            if len(ranks) > 1:
                cause.args = (f"{cause.args[0]} (ranks {ranks} failed)",)
            raise cause from error
        kind = CheckpointWriteError if action == "save" else CheckpointReadError
        raise kind(
            f"Checkpoint {action} of {path!r} failed on rank {rank} (ranks "
            f"{ranks} failed): {type(cause).__name__}: {cause}",
            path,
            rank,
        ) from error


class _OneProcessIsIntended(warnings.catch_warnings):
    """Silence DCP's warning that it assumes one process when
    torch.distributed is not started (a plain one-process Keras run)."""

    def __enter__(self):
        result = super().__enter__()
        warnings.filterwarnings(
            "ignore",
            message=(
                "torch.distributed is disabled, unavailable or uninitialized"
            ),
        )
        return result


def _no_dist():
    return not runtime.is_initialized()


# ---------------------------------------------------------------------------
# save, async_save, load.
# ---------------------------------------------------------------------------


def _marker(variables, optimizer, extra):
    return {
        "format": _files.FORMAT,
        "format_version": _files.FORMAT_VERSION,
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
    path = _files.normalize(path)
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
    path, variables, marker = _begin_save(model, path, optimizer, extra)
    writer = _Writer(path + _files.INCOMPLETE_SUFFIX)
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
    _saved(path, size, started)
    return path


def _saved(path, size, started):
    note(
        "checkpoint saved: %s (%s, %.2f s)",
        path,
        human_bytes(size),
        time.perf_counter() - started,
    )


@contextlib.contextmanager
def _discarded_on_failure(path, group=None):
    """A save that fails (on every rank: DCP gathers failures) leaves no
    `path`.incomplete behind. Collective: call on every rank."""
    try:
        yield
    except CheckpointError:
        _files.discard_incomplete(path, group)
        raise


_async_group = {}  # world group -> its gloo group for background saves
_unfinished = []  # PendingCheckpoints whose result() was not called yet
_unfinished_lock = threading.Lock()


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


# torch's async_save takes a stager of its own (`async_stager=`) and its
# BlockingAsyncStager can keep the staged copy (`cache_staged_state_dict`,
# in pinned memory): both since torch 2.4ish; detected, not assumed.
_CACHED_STAGING = (
    "async_stager" in inspect.signature(dcp.async_save).parameters
    and hasattr(dcp_staging, "BlockingAsyncStager")
    and "cache_staged_state_dict"
    in inspect.signature(dcp_staging.BlockingAsyncStager.__init__).parameters
)


class StagingMemory:
    """Where async saves copy the values before returning, on CUDA: one
    pinned host copy of this rank's state, made by the first save and
    reused by the next ones (torch's BlockingAsyncStager with
    cache_staged_state_dict=True), as torchtitan stages. Pinned memory
    makes the device-to-host copy fast; reusing it spares a new host copy
    per save. It is kept while the saved variables keep their structure
    (keys, shapes, dtypes, layouts) and made again when it changes; it
    holds one copy of this rank's state in host memory for as long.

    Without CUDA (nothing to pin) or on a torch without these, each save
    stages into fresh memory as torch's FileSystemWriter does."""

    def __init__(self) -> None:
        self.stager = None
        self.structure = None  # of the state dict `stager` holds a copy of

    def stager_for(
        self, state_dict: dict[str, torch.Tensor]
    ) -> dcp_staging.BlockingAsyncStager | None:
        """The stager for `state_dict`, or None (the writer stages)."""
        if not pinned_staging_available():
            return None
        structure = _structure(state_dict)
        if structure != self.structure:
            self.stager = dcp_staging.BlockingAsyncStager(
                cache_staged_state_dict=True
            )
            self.structure = structure
        return self.stager

    def clear(self) -> None:
        self.stager = self.structure = None


staging_memory = StagingMemory()


def pinned_staging_available() -> bool:
    """True where async saves stage into reused pinned memory: this torch
    has the stager, and the values are on CUDA (CPU memory needs no
    staging copy pinned for a device)."""
    return _CACHED_STAGING and runtime.uses_cuda()


def _structure(state_dict):
    """What a staged copy of `state_dict` must match to be reused."""
    entries = []
    for key, value in sorted(state_dict.items()):
        local = value.to_local() if isinstance(value, DTensor) else value
        entries.append(
            (
                key,
                type(value).__name__,
                tuple(value.shape),
                str(value.dtype),
                tuple(local.shape),
                str(getattr(value, "placements", None)),
            )
        )
    return tuple(entries)


class PendingCheckpoint:
    """An `async_save` in progress. `result()` waits for the files and makes
    the checkpoint complete (renames it into place); until then `path` holds
    no checkpoint. One never completed is completed when the interpreter
    exits, with a warning. Collective: call `result()` on every rank."""

    def __init__(
        self,
        future: Future,
        path: str,
        marker: dict[str, Any],
        group: dist.ProcessGroup | None,
        writer: _Writer,
    ) -> None:
        self._future = future
        self.path = path
        self._marker = marker
        self._group = group
        self._writer = writer
        self._done = False
        self._lock = threading.Lock()
        self._started = time.perf_counter()  # for the note at completion

    def done(self) -> bool:
        """True once this rank's files are written (no collective)."""
        return self._future.done()

    def result(self) -> str:
        """Wait for every rank's files, then complete the checkpoint.
        Collective: call on every rank.

        Returns:
            The checkpoint's directory, complete.
        """
        with self._lock:
            if not self._done:
                with _unfinished_lock:
                    if self in _unfinished:
                        _unfinished.remove(self)
                with (
                    _discarded_on_failure(self.path, self._group),
                    _translated("save", self.path),
                ):
                    self._future.result()
                size = _files.finish(
                    self.path,
                    self._marker,
                    self._writer.fs.written,
                    self._group,
                )
                self._done = True
                _saved(self.path, size, self._started)
        return self.path


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
    group = _async_process_group()
    path, variables, marker = _begin_save(model, path, optimizer, extra, group)
    writer = _Writer(path + _files.INCOMPLETE_SUFFIX)
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


def _complete_all_pending():
    """Complete this process's pending async saves (every rank has the same
    ones: async_save is collective). Collective: call on every rank."""
    with _unfinished_lock:
        pending = list(_unfinished)
    for handle in pending:
        handle.result()


def _complete_pending_for(path):
    """Complete this process's pending async saves to `path` (every rank has
    the same ones: async_save is collective) before it is written again."""
    with _unfinished_lock:
        pending = [p for p in _unfinished if p.path == path]
    for handle in pending:
        handle.result()


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
                handle.path + _files.INCOMPLETE_SUFFIX,
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
                handle.path + _files.INCOMPLETE_SUFFIX,
            )


def forget_process_groups() -> None:
    """Drop the background-save group once the process group is destroyed
    (it is dead then), so that torch frees it while the interpreter runs;
    and the staging memory and which ranks share which folders with it."""
    _async_group.clear()
    staging_memory.clear()
    _files.forget_storage()


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
    path = _files.normalize(path)

    def check():
        directory, marker = _files.locate(path)
        _files.check_sizes(directory, marker)
        return directory, marker, read_metadata(directory, marker)

    directory, marker, metadata = agreement.agree(check)
    if not _files.file_entries(marker):
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
    size = sum(e["bytes"] for e in _files.file_entries(marker).values())
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
    return _files.read_marker(path).get("extra")

"""Keras files from multi-process runs: every rank takes part, rank 0 writes.

`model.save` / `model.save_weights` run on every rank (gathering a sharded
variable is a collective, done variable by variable as Keras writes them),
but only rank 0's file lands at the path; the others write into a temporary
directory that is removed. Every rank returns once the file is complete.
The same holds for every file Keras' weight stores write (`H5IOStore`,
`ShardedH5IOStore`, `NpzIOStore`), whichever API opens them (keras_hub's
`save_lora_weights` among others): on ranks other than 0 a store opened for
writing at a path writes into a scratch directory instead, and closing a
store waits until every rank has closed its own, so rank 0's file is
complete when any rank goes on (to read it back, say).
Loading reads shard by shard: while sharded variables exist, a reading
store hands out its datasets unread (`stored_item`), so that a sharded
variable reads only its block (see `_distributed.stored_values`), and a
`.keras` archive's weights are read from an extracted file, not from a
whole copy in memory (`whole_file_in_memory`).
File-writing callbacks (CSVLogger, TensorBoard) write, and `model.summary()`
prints, from rank 0 only. ModelCheckpoint runs on every rank (its saves are
collective), and so does the folder Keras makes for its files when it finds
none: the ranks race to make it, so a folder another rank made meanwhile is
no error (`makedirs`).
"""

import copy
import inspect
import os
import shutil
import tempfile
import weakref

import h5py
import keras
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution import _log
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._distributed import safetensors_file
from keras_torch_distribution._distributed import stored_values
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._variables import born_sharded
from keras_torch_distribution._variables import left_whole


def _collective_write(original, model, filepath, *args, **kwargs):
    if not runtime.is_multi_process():
        return original(model, filepath, *args, **kwargs)
    # Every rank is here: a rank-0-only save raises on every rank, naming
    # what the others do, instead of waiting for them.
    agreement.compare(f"model.{original.__name__}()", [])
    if runtime.process_id() == 0:
        try:
            return original(model, filepath, *args, **kwargs)
        finally:
            dist.barrier(group=runtime.cpu_group())
    with tempfile.TemporaryDirectory(prefix="ktd-discard-") as directory:
        discard = os.path.join(directory, os.path.basename(str(filepath)))
        try:
            return original(model, discard, *args, **kwargs)
        finally:
            dist.barrier(group=runtime.cpu_group())


def save(original, model, filepath, *args, **kwargs):
    """Keras `Model.save`. Collective: call on every rank."""
    return _collective_write(original, model, filepath, *args, **kwargs)


def save_weights(original, model, filepath, *args, **kwargs):
    """Keras `Model.save_weights`. Collective: call on every rank."""
    return _collective_write(original, model, filepath, *args, **kwargs)


def load_weights(original, model, *args, **kwargs):
    """Keras `Model.load_weights` (keras_hub's `from_preset` loads through
    it): once loaded, the warning about large variables the layout map
    leaves whole (`_variables.left_whole`), as `fit` gives it: a model
    loaded from a preset and only called or generated from is told too."""
    result = original(model, *args, **kwargs)
    left_whole.warn_if_left_whole(
        model.variables, _keras.current_distribution()
    )
    return result


def store_init(original, store, *args, **kwargs):
    """Keras weight store `__init__`: a store opened for writing at a path
    writes into a scratch directory on ranks other than 0 (see the module
    docstring). Collective with `store_close`: every rank opens and closes
    the store."""
    bound = inspect.signature(original).bind(store, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    path_name = "root_path" if "root_path" in arguments else "path_or_io"
    path = arguments[path_name]
    collective = (
        arguments.get("mode") == "w"
        and arguments.get("archive") is None
        and isinstance(path, (str, os.PathLike))
        and runtime.is_multi_process()
    )
    scratch = None
    if collective and runtime.process_id() != 0:
        scratch = tempfile.mkdtemp(prefix="ktd-discard-")
        arguments[path_name] = os.path.join(
            scratch, os.path.basename(str(path))
        )
    store._ktd_collective_write = (collective, scratch)
    try:
        return original(*bound.args, **bound.kwargs)
    except BaseException:
        store._ktd_collective_write = (False, None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def stored_item(original, store, key):
    """Keras `H5IOStore.__getitem__` (the sharded store's too): while
    sharded variables exist, a dataset of a file opened for reading comes
    back unread, as a `stored_values.StoredValue`: assigned to a sharded
    variable it reads only this rank's block; used any other way it is
    read whole, as Keras reads it. Scalars are read as Keras reads them."""
    if not (
        _keras.h5_store_reading(store) and born_sharded.has_sharded_variables()
    ):
        return original(store, key)
    dataset = _keras.h5_store_dataset(store, key)
    if not isinstance(dataset, h5py.Dataset) or not dataset.shape:
        return original(store, key)
    filename = dataset.file.filename
    reopen = (
        filename
        if _keras.h5_store_on_disk(store) and os.path.isfile(filename)
        else None
    )
    value = stored_values.StoredValue(
        dataset,
        bfloat16=dataset.attrs.get("dtype", None) == "bfloat16",
        reopen=reopen,
    )
    handed_out = store.__dict__.setdefault("_ktd_handed_out", weakref.WeakSet())
    handed_out.add(value)
    return value


class ArchiveLoads:
    """How many `.keras` archives this process is loading now (Keras'
    `_load_model_from_fileobj` in progress)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.depth = 0


archive_loads = ArchiveLoads()


def load_archive(original, *args, **kwargs):
    """Keras `saving_lib._load_model_from_fileobj`, which loads a `.keras`
    archive: while it runs, `whole_file_in_memory` may answer "no"."""
    archive_loads.depth += 1
    try:
        return original(*args, **kwargs)
    finally:
        archive_loads.depth -= 1


def whole_file_in_memory(original, model):
    """Keras `saving_lib.is_memory_sufficient`, which decides whether a
    `.keras` archive's `model.weights.h5` is read into memory whole (a
    `BytesIO` of the file on every rank) or extracted to a temporary file
    beside the archive and read from there: False while a multi-process
    run with sharded variables loads an archive (`load_archive`), so that
    no rank holds the whole file in memory and each reads only its blocks
    from the extracted file (`stored_item`). Keras' answer otherwise (saving
    included)."""
    if (
        archive_loads.depth
        and runtime.is_multi_process()
        and born_sharded.has_sharded_variables()
    ):
        return False
    return original(model)


class ShardedPorts:
    """How many keras_hub `SafetensorLoader.port_weight` calls into a
    sharded variable are in progress in this process."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.depth = 0


sharded_ports = ShardedPorts()


def port_weight(original, loader, keras_variable, hf_weight_key, hook_fn=None):
    """keras_hub `SafetensorLoader.port_weight` (keras_hub is a library on
    Keras), which reads a Hugging Face tensor whole, transforms it with
    `hook_fn` and assigns it: into a sharded variable, the tensor is
    handed to `hook_fn` unread (a `stored_values.TensorFileValue`, through
    the file `loader_file` gave the loader), so that the transposes,
    reshapes and casts keras_hub's converters apply are recorded and
    `assign` reads only this rank's block of the stored tensor. Into any
    other variable, keras_hub's own."""
    if not born_sharded.is_sharded(keras_variable):
        return original(loader, keras_variable, hf_weight_key, hook_fn)
    sharded_ports.depth += 1
    try:
        return original(loader, keras_variable, hf_weight_key, hook_fn)
    finally:
        sharded_ports.depth -= 1


class LoaderPaths:
    """The local path keras_hub's safetensors loader asked for last
    (`loader_path`): the file it opens next (`loader_file`)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.last = None


loader_paths = LoaderPaths()


def loader_path(original, preset, path):
    """keras_hub `safetensor_utils.get_file` (keras_hub is a library on
    Keras; its loader looks it up as an attribute of that module), which
    the loader calls for the local path of the safetensors file it opens
    next: the path is noted, so that `loader_file` can read that file
    itself."""
    local = original(preset, path)
    loader_paths.last = local
    return local


def loader_file(original, loader, context):
    """keras_hub `SafetensorLoader.enter_context` (contextlib's, which the
    loader keeps each safetensors file it opens with, for a library on
    Keras): while sharded variables exist, a safetensors file comes back
    as a `SliceReadingFile`: its `get_tensor` hands the tensor out unread
    while `port_weight` ports it into a sharded variable, and the tensor's
    blocks are read from the file at the path the loader asked for
    (`loader_path`) with positioned reads (`SafetensorsFile`), closed with
    the loader. Where that path is unknown or holds other tensors, the
    file is keras_hub's own (whole reads), with a warning."""
    opened = original(loader, context)
    path, loader_paths.last = loader_paths.last, None
    if not (
        born_sharded.has_sharded_variables()
        and hasattr(opened, "get_tensor")
        and hasattr(opened, "keys")
    ):
        return opened
    reader = safetensors_file.SafetensorsFile(path, opened) if path else None
    if reader is None or set(reader.keys()) != set(opened.keys()):
        _log.warn_once(
            ("safetensors path unknown", path),
            "keras_hub opened a safetensors file whose path the package "
            "did not see (last asked for: %r); its tensors are read whole "
            "on every rank, as keras_hub reads them. Load with keras_hub's "
            "SafetensorLoader, which asks get_file for each file's path.",
            path,
        )
        if reader is not None:
            reader.close()
        return opened
    loader.callback(reader.close)
    return SliceReadingFile(opened, reader)


class SliceReadingFile:
    """A safetensors file (`safe_open(path, framework="np")`) a keras_hub
    loader keeps open, beside the same file read box by box (`reader`, a
    `SafetensorsFile`). `get_tensor(key)` reads the tensor whole, as the
    file does, except while `port_weight` ports into a sharded variable:
    then it hands it out unread (`stored_values.tensor_file_value`), and
    its blocks are read by `reader`. Everything else is the file's own."""

    def __init__(self, file, reader):
        self._file = file
        self._reader = reader

    def get_tensor(self, key):
        if sharded_ports.depth:
            return stored_values.tensor_file_value(self._reader, key)
        return self._file.get_tensor(key)

    def __getattr__(self, name):
        return getattr(self._file, name)


def store_close(original, store):
    """Keras weight store `close`: once rank 0's file is complete, every
    rank goes on. Collective for stores opened for writing at a path.
    Values a reading store handed out unread that are still in use and
    cannot be read after the file closes are read first (`stored_item`)."""
    for value in list(store.__dict__.get("_ktd_handed_out", ())):
        value.keep()
    collective, scratch = getattr(store, "_ktd_collective_write", (False, None))
    try:
        return original(store)
    finally:
        store._ktd_collective_write = (False, None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if collective:
            dist.barrier(group=runtime.cpu_group())


def makedirs(original, path):
    """Keras `file_utils.makedirs`: in multi-process runs a folder that
    exists when it is made (another rank made it meanwhile) is no error.

    Keras' callbacks and saving call it on every rank after finding that
    the folder does not exist (ModelCheckpoint for its file's folder,
    BackupAndRestore in one process, `saving_lib`'s folders); ranks that
    share a file system race between the two. Keras' own behaviour is
    kept in one process, for remote paths (whose `makedirs` never fails on
    an existing folder) and for a path that exists but is not a folder.
    """
    try:
        return original(path)
    except FileExistsError:
        if runtime.is_multi_process() and os.path.isdir(path):
            return None
        raise


def summary(original, model, *args, **kwargs):
    """Keras `Model.summary`: printed by rank 0 only. A `print_fn` passed
    in is called on every rank (it may collect the text)."""
    if runtime.process_id() != 0:
        bound = inspect.signature(original).bind(model, *args, **kwargs)
        if bound.arguments.get("print_fn") is None:
            bound.arguments["print_fn"] = _discard
            return original(*bound.args, **bound.kwargs)
    return original(model, *args, **kwargs)


def _discard(*args, **kwargs):
    del args, kwargs


def callbacks_for_this_rank(callbacks):
    """The callbacks this rank runs: on ranks other than 0, those that only
    write files (CSVLogger, TensorBoard) are left out, so rank 0 writes
    each file once. The user's list and callbacks are not changed."""
    if runtime.process_id() == 0 or not callbacks:
        return callbacks
    # A list, or Keras' CallbackList (fit passes one to evaluate).
    listed = list(getattr(callbacks, "callbacks", callbacks))
    kept = [c for c in listed if not isinstance(c, _FILE_WRITERS)]
    if len(kept) == len(listed):
        return callbacks
    if hasattr(callbacks, "callbacks"):
        narrowed = copy.copy(callbacks)
        narrowed.callbacks = kept
        return narrowed
    return kept


_FILE_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)

"""Keras files from multi-process runs: every rank takes part, rank 0 writes.

`model.save` / `model.save_weights` run on every rank (gathering a sharded
variable is a collective, done variable by variable as Keras writes them),
but only rank 0's file lands at the path; the others write into a temporary
directory that is removed. Every rank returns once the file is complete.
File-writing callbacks (CSVLogger, TensorBoard) write from rank 0 only.
"""

import atexit
import os
import shutil
import tempfile

import keras
import torch.distributed as dist

from keras_torch_distribution import runtime


def _collective_write(original, model, filepath, *args, **kwargs):
    if runtime.num_processes() == 1:
        return original(model, filepath, *args, **kwargs)
    if runtime.process_id() == 0:
        try:
            return original(model, filepath, *args, **kwargs)
        finally:
            dist.barrier()
    with tempfile.TemporaryDirectory(prefix="ktd-discard-") as directory:
        discard = os.path.join(directory, os.path.basename(str(filepath)))
        try:
            return original(model, discard, *args, **kwargs)
        finally:
            dist.barrier()


def save(original, model, filepath, *args, **kwargs):
    """Keras `Model.save`. Collective: call on every rank."""
    return _collective_write(original, model, filepath, *args, **kwargs)


def save_weights(original, model, filepath, *args, **kwargs):
    """Keras `Model.save_weights`. Collective: call on every rank."""
    return _collective_write(original, model, filepath, *args, **kwargs)


def callbacks_for_this_rank(callbacks):
    """On ranks other than 0, point file-writing callbacks at nowhere."""
    if runtime.process_id() == 0 or not callbacks:
        return callbacks
    # A list, or Keras' CallbackList (fit passes one to evaluate).
    for callback in getattr(callbacks, "callbacks", callbacks):
        if isinstance(callback, keras.callbacks.CSVLogger):
            callback.filename = os.devnull
        elif isinstance(callback, keras.callbacks.TensorBoard):
            callback.log_dir = _scratch_directory()
    return callbacks


_scratch = []


def _scratch_directory():
    if not _scratch:
        _scratch.append(tempfile.mkdtemp(prefix="ktd-tensorboard-"))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]

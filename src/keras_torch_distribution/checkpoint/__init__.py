"""Sharded checkpoints of Keras models over `torch.distributed.checkpoint`.

    from keras_torch_distribution import checkpoint

    checkpoint.save(model, "ckpt/epoch-3", extra={"epoch": 3})
    extra = checkpoint.load(model, "ckpt/epoch-3")    # -> {"epoch": 3}

What is stored, keyed by Keras variable paths (see `_keys`): the model's
variables (``model/col/kernel``, SeedGenerator states), the optimizer's
(``optimizer/iteration``, ``optimizer/col/kernel/momentum``) unless
``optimizer=False``, and ``keras_checkpoint.json``: the format, the
variables and their shapes, the number of processes that wrote it, the
JSON-serializable ``extra`` (for example the epoch and step to resume from)
and every file with its size, CRC-32 and the rank that wrote it.

A variable whose layout shards it is saved as its DTensor, so each rank
writes only its own shards; replicated variables (plain tensors) are written
once (DCP de-duplicates them). Loading goes through DCP's planner into the
target model's own tensors, so it reshards: a checkpoint written by 2
processes with one mesh/LayoutMap loads on 1, 2 or 4 processes with another
mesh, another LayoutMap or no distribution at all, each rank reading only
the blocks it holds (plain targets read the full values).

Trust: loading runs nothing from the checkpoint. DCP's `.metadata` is
unpickled admitting only DCP's metadata classes (`_unpickler`), tensors are read
with `torch.load(weights_only=True)`, and every file is checked against its
recorded size and CRC-32 before it is read. The checksums detect accidents
(truncation, flipped bits), not forgery: whoever can write the checkpoint
can rewrite its marker too.

Completeness and crashes (`_files`, `_storage`): every rank writes into
``<path>.incomplete``; rank 0 completes it with the marker and moves it into
place, so a checkpoint being written when a process died is never loaded,
and replacing one is crash-safe at every instant. On hosts that do not share
the folder, the lowest rank of each host does so in its host's copy, and a
copy lacking other hosts' files raises SplitCheckpointError naming them.

Modules, bottom first (a module imports only those above it):

- `_errors`: the checkpoint errors.
- `_keys`: Keras variable paths to checkpoint keys.
- `_location`: where a checkpoint lives: its file names, the directory
  holding the newest complete checkpoint of a path, its marker.
- `_checksums`: each file's size and CRC-32, checked before it is read.
- `_storage`: which ranks share a checkpoint's folder (one per host on
  local disks).
- `_files`: completion and crash-safe replacement.
- `_unpickler`: the restricted reader of DCP's `.metadata`.
- `_streams`: the checked file streams every file goes through.
- `_staging`: the pinned memory async saves copy into, reused.
- `_pending`: saves in progress (`PendingCheckpoint`).
- `_dcp`: save, async_save, load.
- `callbacks`: ShardedCheckpoint, BackupAndRestore.
- `inspect`: what `ktd report CHECKPOINT` prints.
"""

from keras_torch_distribution.checkpoint._dcp import async_save
from keras_torch_distribution.checkpoint._dcp import load
from keras_torch_distribution.checkpoint._dcp import read_extra
from keras_torch_distribution.checkpoint._dcp import save
from keras_torch_distribution.checkpoint._errors import CheckpointError
from keras_torch_distribution.checkpoint._errors import CheckpointMismatchError
from keras_torch_distribution.checkpoint._errors import CheckpointReadError
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import NotACheckpointError
from keras_torch_distribution.checkpoint._errors import SplitCheckpointError
from keras_torch_distribution.checkpoint._errors import UnsafeCheckpointError
from keras_torch_distribution.checkpoint._keys import variables_by_key
from keras_torch_distribution.checkpoint._location import FORMAT
from keras_torch_distribution.checkpoint._location import FORMAT_VERSION
from keras_torch_distribution.checkpoint._location import MARKER
from keras_torch_distribution.checkpoint._location import is_checkpoint
from keras_torch_distribution.checkpoint._location import read_marker
from keras_torch_distribution.checkpoint._pending import PendingCheckpoint
from keras_torch_distribution.checkpoint.callbacks import ShardedCheckpoint
from keras_torch_distribution.checkpoint.callbacks import latest

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "NotACheckpointError",
    "PendingCheckpoint",
    "ShardedCheckpoint",
    "SplitCheckpointError",
    "UnsafeCheckpointError",
    "async_save",
    "is_checkpoint",
    "latest",
    "load",
    "read_extra",
    "read_marker",
    "save",
    "variables_by_key",
]

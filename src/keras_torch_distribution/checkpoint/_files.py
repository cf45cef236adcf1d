"""The files of a checkpoint: completion and crash-safe replacement.

A checkpoint at ``path`` is a directory holding DCP's files (one
``__<rank>_<n>.distcp`` per writing rank and ``.metadata``) and the
completion marker ``keras_checkpoint.json``. Every rank writes into
``path.incomplete``; once DCP has finished on every rank, rank 0 writes the
marker there (atomically: a temporary file renamed into place) with the size
and CRC-32 of every file and the rank that wrote it, then moves the
directory into place. A directory holding the marker is complete; one
without it is never loaded.

"Rank 0" above and below is, on hosts that do not share the checkpoint's
folder, the lowest rank of each storage (`storage_groups`): each completes
and renames its host's copy, which holds the files of that host's ranks,
the same marker (it also names each file's host and the ranks of each
storage) and `.metadata` (received from rank 0). Such a copy alone does not
load (`split_error`); the copies merged into one folder do.

Replacing a checkpoint takes these steps (rank 0):

1. the marker lands in ``path.incomplete`` (now complete);
2. ``path`` -> ``path.old``;
3. ``path.incomplete`` -> ``path``;
4. ``path.old`` -> ``path.old.removing``, then removed.

`resolve` finds the newest complete checkpoint of ``path`` whatever instant
a crash stopped these steps at: ``path.incomplete`` once it holds the marker
(it is always newer: a save starts by clearing it), else ``path``, else
``path.old``; `settle` (run by rank 0 at the next save, or by the callbacks'
clean-up) finishes the interrupted steps and removes what is left over.
A directory is removed by renaming it to ``*.removing`` first, so a
half-removed checkpoint never looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Any

import torch.distributed as dist

from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._checksums import CHECKSUM
from keras_torch_distribution.checkpoint._location import INCOMPLETE_SUFFIX
from keras_torch_distribution.checkpoint._location import MARKER
from keras_torch_distribution.checkpoint._location import METADATA
from keras_torch_distribution.checkpoint._location import OLD_SUFFIX
from keras_torch_distribution.checkpoint._location import REMOVING_SUFFIX
from keras_torch_distribution.checkpoint._location import has_marker
from keras_torch_distribution.checkpoint._location import normalize
from keras_torch_distribution.checkpoint._storage import _cannot_write
from keras_torch_distribution.checkpoint._storage import leads
from keras_torch_distribution.checkpoint._storage import storage_groups

# ---------------------------------------------------------------------------
# Collective steps of a save (each an `agreement` step).
# ---------------------------------------------------------------------------


def prepare_directory(
    path: str, group: dist.ProcessGroup | None = None
) -> None:
    """Check the target, settle what an interrupted save left, clear a stale
    temporary directory (on every storage, by the lowest rank that sees it:
    `storage_groups`). Collective: call on every rank."""
    groups = storage_groups(os.path.dirname(path), group)

    def make_temporary():
        if os.path.exists(path) and not has_marker(path):
            raise FileExistsError(
                f"Cannot save a checkpoint to {path!r}: it exists and is not "
                "a checkpoint, and saving would replace it. Choose another "
                "path or remove it."
            )
        if not leads(groups):
            return
        try:
            settle(path)
            os.makedirs(path + INCOMPLETE_SUFFIX)
        except OSError as error:
            raise _cannot_write(path, error) from error

    agreement.agree(make_temporary, group)


def discard_incomplete(
    path: str, group: dist.ProcessGroup | None = None
) -> None:
    """Remove what a failed save wrote (`path`.incomplete) so that it does
    not hold the disk until the next save. Collective: call on every rank
    (every rank has seen the failure)."""
    temporary = normalize(path) + INCOMPLETE_SUFFIX
    groups = storage_groups(os.path.dirname(temporary), group)
    if leads(groups) and os.path.exists(temporary):
        try:
            remove_checkpoint(temporary)
        except OSError as error:
            logger.error(
                "could not remove %s after the failed save: %s; remove it by "
                "hand (it is incomplete and will never be loaded).",
                temporary,
                error,
            )
    agreement.barrier(group)


def finish(
    path: str,
    marker: dict[str, Any],
    written: dict[str, dict[str, Any]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Record every rank's files (`written`: {name: {"bytes", "crc32"}} of
    this rank) in the marker, which completes the temporary directory, and
    move it into place: on each storage (`storage_groups`), its lowest rank
    does it in its copy, where the others put `.metadata` (DCP writes it on
    rank 0 only) next to its ranks' files. Every rank returns once every
    copy is in place; returns the bytes of every rank's files. Collective:
    call on every rank."""
    groups = storage_groups(os.path.dirname(path), group)
    temporary = path + INCOMPLETE_SUFFIX
    split = len(groups) > 1

    def files_of_this_rank():
        mine = {"files": written, "host": socket.gethostname()}
        if split and runtime.process_id() == 0:
            with open(os.path.join(temporary, METADATA), "rb") as f:
                mine["metadata"] = f.read()
        return mine

    everyone = agreement.gather(files_of_this_rank, group)

    def complete():
        if not leads(groups):
            return
        files = {}
        for rank, theirs in enumerate(everyone):
            for name, entry in theirs["files"].items():
                files[name] = dict(entry, rank=rank, host=theirs["host"])
        completed = dict(marker, checksum=CHECKSUM, files=files)
        if split:
            completed["storage_groups"] = groups
            if not os.path.exists(os.path.join(temporary, METADATA)):
                _write_atomically(
                    os.path.join(temporary, METADATA), everyone[0]["metadata"]
                )
        try:
            write_json_atomically(os.path.join(temporary, MARKER), completed)
            settle(path)
        except OSError as error:
            raise _cannot_write(path, error) from error

    agreement.agree(complete, group)
    return sum(
        entry["bytes"]
        for theirs in everyone
        for entry in theirs["files"].values()
    )


# ---------------------------------------------------------------------------
# Rank 0's file operations (each storage's lowest rank).
# ---------------------------------------------------------------------------


# Rank 0's renames and removals go through these two (tests wrap them to
# stop at each step of a replacement).
def rename(source: str, target: str) -> None:
    os.rename(source, target)


def _rmtree(directory):
    shutil.rmtree(directory)


def _fsync_directory(directory):
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_json_atomically(path: str, value: Any) -> None:
    """Write JSON to `path` through a temporary file renamed into place, so
    that `path` is either absent or whole."""
    text = json.dumps(value, indent=1, sort_keys=True)
    _write_atomically(path, text.encode("utf-8"))


def _write_atomically(path, data):
    """Write the bytes `data` to `path` through a temporary file renamed
    into place."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    rename(temporary, path)
    _fsync_directory(os.path.dirname(path))


def remove_checkpoint(directory: str) -> None:
    """Remove a checkpoint directory: renamed to ``*.removing`` first (so a
    half-removed one never looks complete), then deleted."""
    trash = directory + REMOVING_SUFFIX
    if os.path.exists(trash):
        _rmtree(trash)
    rename(directory, trash)
    _rmtree(trash)


def settle(path: str) -> None:
    """Finish an interrupted replacement of the checkpoint at `path` and
    remove its leftovers: afterwards `path` holds the newest complete
    checkpoint (if any) and no ``.incomplete``, ``.old`` or ``.removing``
    directory of it remains. Rank 0 only; follow with a barrier."""
    path = normalize(path)
    temporary, old = path + INCOMPLETE_SUFFIX, path + OLD_SUFFIX
    if os.path.exists(path + REMOVING_SUFFIX):
        _rmtree(path + REMOVING_SUFFIX)
    if has_marker(temporary):
        if os.path.exists(path):
            if os.path.exists(old):
                remove_checkpoint(old)
            rename(path, old)
        rename(temporary, path)
        _fsync_directory(os.path.dirname(path))
    elif not os.path.exists(path) and has_marker(old):
        rename(old, path)
        _fsync_directory(os.path.dirname(path))
    if os.path.exists(old):
        remove_checkpoint(old)
    if os.path.exists(temporary):
        remove_checkpoint(temporary)  # a save that never completed

"""The files of a checkpoint: completion, crash-safe replacement, checksums.

A checkpoint at ``path`` is a directory holding DCP's files (one
``__<rank>_<n>.distcp`` per writing rank and ``.metadata``) and the
completion marker ``keras_checkpoint.json``. Every rank writes into
``path.incomplete``; once DCP has finished on every rank, rank 0 writes the
marker there (atomically: a temporary file renamed into place) with the size
and CRC-32 of every file and the rank that wrote it, then moves the
directory into place. A directory holding the marker is complete; one
without it is never loaded.

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

import json
import os
import pickle
import shutil
import zlib

import torch.distributed as dist

from keras_torch_distribution.checkpoint._errors import CheckpointReadError
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import NotACheckpointError
from keras_torch_distribution.distributed import runtime
from keras_torch_distribution.log import logger

FORMAT = "keras_torch_distribution.checkpoint"
# 2: the marker lists every file with its size, CRC-32 and writing rank.
FORMAT_VERSION = 2
MARKER = "keras_checkpoint.json"
METADATA = ".metadata"
INCOMPLETE_SUFFIX = ".incomplete"
OLD_SUFFIX = ".old"
REMOVING_SUFFIX = ".removing"
CHECKSUM = "crc32"
_CHUNK = 8 * 2**20


def normalize(path):
    path = os.fspath(path)
    if not path:
        raise ValueError("The checkpoint path is empty; give a directory path.")
    return os.path.abspath(path.rstrip(os.sep) or os.sep)


# ---------------------------------------------------------------------------
# Which directory holds the checkpoint of a path.
# ---------------------------------------------------------------------------


def has_marker(directory):
    """True when `directory` holds a completion marker and DCP's metadata."""
    return os.path.isfile(os.path.join(directory, MARKER)) and os.path.isfile(
        os.path.join(directory, METADATA)
    )


def resolve(path):
    """The directory holding the newest complete checkpoint of `path`
    (`path` itself, or what an interrupted replacement left), or None."""
    path = normalize(path)
    for directory in (path + INCOMPLETE_SUFFIX, path, path + OLD_SUFFIX):
        if has_marker(directory):
            return directory
    return None


def is_checkpoint(path):
    """True when `path` holds a complete checkpoint written by `save` (also
    one whose replacement a crash interrupted)."""
    return resolve(path) is not None


def locate(path):
    """(directory, marker) of the complete checkpoint of `path`; raises
    NotACheckpointError (DamagedCheckpointError for an unreadable marker)."""
    path = normalize(path)
    directory = resolve(path)
    if directory is None:
        hint = ""
        if os.path.isdir(path + INCOMPLETE_SUFFIX):
            hint = (
                f" {path + INCOMPLETE_SUFFIX!r} exists: a checkpoint was being "
                "written there when a process stopped; it is incomplete and "
                "will never be loaded."
            )
        what = (
            "does not exist"
            if not os.path.exists(path)
            else _missing_files(path)
        )
        raise NotACheckpointError(
            f"{path!r} is not a complete checkpoint: it {what}. Expected a "
            "directory written by keras_torch_distribution.checkpoint.save "
            f"(or ShardedCheckpoint); pass such a directory.{hint}"
        )
    if directory != path:
        logger.warning(
            "%s: a process stopped while replacing this checkpoint; using the "
            "newest complete one, %s (the next save there tidies up).",
            path,
            directory,
        )
    return directory, _read_marker_file(directory)


def _missing_files(directory):
    """What `directory` lacks to be a checkpoint, e.g. "has no '.metadata'"."""
    if not os.path.isdir(directory):
        return "is a file, not a checkpoint directory"
    missing = [
        name
        for name in (MARKER, METADATA)
        if not os.path.isfile(os.path.join(directory, name))
    ]
    return "has no " + " and no ".join(repr(name) for name in missing)


def read_marker(path):
    """The completion marker (a dict) of the checkpoint at `path`."""
    return locate(path)[1]


def _read_marker_file(directory):
    marker_path = os.path.join(directory, MARKER)
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedCheckpointError(
            f"{marker_path!r} is not valid JSON ({error}): the checkpoint's "
            "completion marker is damaged. Load another checkpoint.",
            marker_path,
            0,
        ) from error
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        found = (
            marker.get("format")
            if isinstance(marker, dict)
            else type(marker).__name__
        )
        raise NotACheckpointError(
            f"{marker_path!r} has format {found!r}, expected {FORMAT!r}. Pass "
            "a directory written by checkpoint.save."
        )
    version = marker.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise NotACheckpointError(
            f"{marker_path!r} has format_version {version!r}; this version of "
            f"keras_torch_distribution reads 1 to {FORMAT_VERSION}. Upgrade "
            "keras_torch_distribution to load it."
        )
    if version >= 2 and not isinstance(marker.get("files"), dict):
        raise DamagedCheckpointError(
            f"{marker_path!r} lists no 'files' (their sizes and checksums), "
            f"which format_version {version} requires: the marker is damaged. "
            "Load another checkpoint.",
            marker_path,
            0,
        )
    return marker


# ---------------------------------------------------------------------------
# Checksums.
# ---------------------------------------------------------------------------


def crc32_hex(value):
    return f"{value & 0xFFFFFFFF:08x}"


def file_checksum(path):
    """(bytes, CRC-32 as 8 hex digits) of the file at `path`, read in chunks."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc32_hex(crc)


def file_entries(marker):
    """{file name: {"rank", "bytes", "crc32"}} the marker records ({} for a
    checkpoint written before checksums, format_version 1)."""
    return marker.get("files") or {}


def writer_of(marker, name):
    """The rank that wrote file `name`, from the marker or DCP's naming
    (``__<rank>_<n>.distcp``); None when unknown."""
    entry = file_entries(marker).get(name)
    if entry is not None:
        return entry.get("rank")
    if name.startswith("__"):
        head = name[2:].split("_")[0]
        if head.isdigit():
            return int(head)
    return None


def _damaged(directory, name, entry, what):
    path = os.path.join(directory, name)
    return DamagedCheckpointError(
        f"Checkpoint file {path!r} (written by rank {entry.get('rank')}) is "
        f"damaged: {what}. The checkpoint cannot be loaded as it was saved; "
        "load an older checkpoint or save it again.",
        path,
        entry.get("rank"),
    )


def check_size(directory, name, entry):
    """Raise DamagedCheckpointError if the file is missing or of another size
    than its writer recorded (a stat, no read)."""
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise _damaged(directory, name, entry, "the file is missing") from None
    if size != entry["bytes"]:
        kind = "truncated" if size < entry["bytes"] else "longer than written"
        raise _damaged(
            directory,
            name,
            entry,
            f"it has {size} bytes, its writer wrote {entry['bytes']} ({kind})",
        )


def verify_file(directory, name, entry):
    """Raise DamagedCheckpointError unless the file has the size and CRC-32
    its writer recorded (reads the whole file)."""
    check_size(directory, name, entry)
    _, crc = file_checksum(os.path.join(directory, name))
    if crc != entry[CHECKSUM]:
        raise _damaged(
            directory,
            name,
            entry,
            f"its CRC-32 is {crc}, its writer recorded {entry[CHECKSUM]} (its "
            "bytes changed after it was written: a flipped bit, a partial copy "
            "or another program)",
        )


def check_sizes(directory, marker):
    """Every file the marker lists exists with its recorded size."""
    for name, entry in sorted(file_entries(marker).items()):
        check_size(directory, name, entry)


def problems(directory, marker):
    """Every damaged file of a checkpoint (sizes and checksums, reading all
    of them), as DamagedCheckpointError instances; [] when intact."""
    found = []
    for name, entry in sorted(file_entries(marker).items()):
        try:
            verify_file(directory, name, entry)
        except DamagedCheckpointError as error:
            found.append(error)
    return found


# ---------------------------------------------------------------------------
# Collective steps.
# ---------------------------------------------------------------------------


def barrier(group=None):
    """Every rank waits for the others, on `group` (default: the group for
    CPU tensors, `runtime.cpu_group()`, which needs no current GPU).
    Collective: call on every rank."""
    if runtime.is_multi_process():
        dist.barrier(group=group or runtime.cpu_group())


def agree(step, group=None):
    """Run `step()` on every rank; if it raised on any rank, raise on every
    rank (the first failing rank's error), so that no rank goes on into a
    collective the others left. Returns this rank's result.
    Collective: call on every rank."""
    result, error = None, None
    try:
        result = step()
    except Exception as caught:  # re-raised below, on every rank
        error = caught
    if runtime.is_multi_process():
        group = group or runtime.cpu_group()
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, _portable(error), group=group)
        first = next((e for e in errors if e is not None), None)
        if error is None and first is not None:
            raise first
    if error is not None:
        raise error
    return result


def _portable(error):
    """`error` if it survives pickling, else a CheckpointReadError with its
    text (what another rank can raise)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # an exception type that cannot cross processes
        return CheckpointReadError(
            f"on rank {runtime.process_id()}: {type(error).__name__}: {error}",
            None,
            runtime.process_id(),
        )
    return error


def prepare_directory(path, group=None):
    """Check the target, settle what an interrupted save left, clear a stale
    temporary directory. Collective: call on every rank."""
    if os.path.exists(path) and not has_marker(path):
        raise FileExistsError(
            f"Cannot save a checkpoint to {path!r}: it exists and is not a "
            "checkpoint, and saving would replace it. Choose another path or "
            "remove it."
        )

    def make_temporary():
        if runtime.process_id() != 0:
            return
        try:
            settle(path)
            os.makedirs(path + INCOMPLETE_SUFFIX)
        except OSError as error:
            raise CheckpointWriteError(
                (
                    f"Cannot save a checkpoint to {path!r}: "
                    f"{type(error).__name__}: {error.strerror or error} "
                    f"({error.filename or path!r}). Choose a folder this job "
                    "can write to, or make it writable (e.g. `chmod u+w` on "
                    "the folder)."
                ),
                path,
                0,
            ) from error

    agree(make_temporary, group)


def discard_incomplete(path, group=None):
    """Remove what a failed save wrote (`path`.incomplete) so that it does
    not hold the disk until the next save. Collective: call on every rank
    (every rank has seen the failure)."""
    temporary = normalize(path) + INCOMPLETE_SUFFIX
    if runtime.process_id() == 0 and os.path.exists(temporary):
        try:
            remove_checkpoint(temporary)
        except OSError as error:
            logger.error(
                "could not remove %s after the failed save: %s; remove it by "
                "hand (it is incomplete and will never be loaded).",
                temporary,
                error,
            )
    barrier(group)


def finish(path, marker, written, group=None):
    """Rank 0 records every rank's files (`written`: {name: {"bytes",
    "crc32"}} of this rank) in the marker, which completes the temporary
    directory, and moves it into place; every rank returns once it is there.
    Collective: call on every rank."""
    everyone = [written]
    if runtime.is_multi_process():
        group = group or runtime.cpu_group()
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, written, group=group)
    if runtime.process_id() == 0:
        files = {}
        for rank, rank_files in enumerate(everyone):
            for name, entry in rank_files.items():
                files[name] = dict(entry, rank=rank)
        marker = dict(marker, checksum=CHECKSUM, files=files)
        write_json_atomically(
            os.path.join(path + INCOMPLETE_SUFFIX, MARKER), marker
        )
        settle(path)
    barrier(group)


# ---------------------------------------------------------------------------
# Rank 0's file operations.
# ---------------------------------------------------------------------------


# Rank 0's renames and removals go through these two (tests wrap them to
# stop at each step of a replacement).
def rename(source, target):
    os.rename(source, target)


def _rmtree(directory):
    shutil.rmtree(directory)


def _fsync_directory(directory):
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_json_atomically(path, value):
    """Write JSON to `path` through a temporary file renamed into place, so
    that `path` is either absent or whole."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    rename(temporary, path)
    _fsync_directory(os.path.dirname(path))


def remove_checkpoint(directory):
    """Remove a checkpoint directory: renamed to ``*.removing`` first (so a
    half-removed one never looks complete), then deleted."""
    trash = directory + REMOVING_SUFFIX
    if os.path.exists(trash):
        _rmtree(trash)
    rename(directory, trash)
    _rmtree(trash)


def settle(path):
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

"""The files of a checkpoint: completion, crash-safe replacement, checksums.

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

import json
import os
import secrets
import shutil
import socket
import zlib

import torch.distributed as dist

from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import NotACheckpointError
from keras_torch_distribution.checkpoint._errors import SplitCheckpointError

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
    """Every file the marker lists exists with its recorded size; a copy
    that lacks the files of other hosts raises SplitCheckpointError."""
    split = split_error(directory, marker)
    if split is not None:
        raise split
    for name, entry in sorted(file_entries(marker).items()):
        check_size(directory, name, entry)


def split_error(directory, marker):
    """A SplitCheckpointError naming the files `directory` lacks when it is
    one host's copy of a checkpoint saved on hosts that did not share its
    folder (the marker's `storage_groups`); else None."""
    groups = marker.get("storage_groups") or []
    entries = file_entries(marker)
    missing = {
        name: (entry.get("rank"), entry.get("host"))
        for name, entry in sorted(entries.items())
        if not os.path.exists(os.path.join(directory, name))
    }
    if len(groups) < 2 or not missing:
        return None
    ranks = sorted({rank for rank, _ in missing.values() if rank is not None})
    hosts = sorted({host for _, host in missing.values() if host})
    shown = ", ".join(repr(name) for name in list(missing)[:8])
    if len(missing) > 8:
        shown += f" and {len(missing) - 8} more"
    source = f"{hosts[0]}:" if hosts else "HOST:"
    return SplitCheckpointError(
        f"{directory!r} holds only this host's part of a checkpoint saved "
        "on hosts that did not share its folder (each of the rank groups "
        f"{groups} wrote into a copy of its own): it lacks {len(missing)} "
        f"file(s) written by rank(s) {ranks} "
        f"on host(s) {hosts}: {shown}. Copy every host's copy into one "
        "directory before loading (to resume on these hosts: onto each of "
        f"them), e.g. `rsync -a {source}{directory}/ {directory}/` from "
        "each of the other hosts (the files do not overlap; "
        "the marker and .metadata are the same on every host), or save to "
        "a shared filesystem. A merged copy loads on any number of "
        "processes and hosts.",
        directory,
        ranks[0] if ranks else None,
        missing,
    )


def problems(directory, marker):
    """Every damaged file of a checkpoint (sizes and checksums, reading all
    of them), as DamagedCheckpointError instances ([SplitCheckpointError]
    for one host's copy of a checkpoint split among hosts); [] when
    intact."""
    split = split_error(directory, marker)
    if split is not None:
        return [split]
    found = []
    for name, entry in sorted(file_entries(marker).items()):
        try:
            verify_file(directory, name, entry)
        except DamagedCheckpointError as error:
            found.append(error)
    return found


# ---------------------------------------------------------------------------
# Collective steps of a save (each an `agreement` step).
# ---------------------------------------------------------------------------


def _cannot_write(path, error):
    return CheckpointWriteError(
        (
            f"Cannot save a checkpoint to {path!r}: "
            f"{type(error).__name__}: {error.strerror or error} "
            f"({error.filename or path!r}). Choose a folder this job "
            "can write to, or make it writable (e.g. `chmod u+w` on "
            "the folder)."
        ),
        path,
        runtime.process_id(),
    )


def prepare_directory(path, group=None):
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


def discard_incomplete(path, group=None):
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


def finish(path, marker, written, group=None):
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
# Which ranks share a checkpoint's storage.
# ---------------------------------------------------------------------------
#
# Hosts without a shared filesystem each have their own copy of a
# checkpoint's folder, and a rank sees only the files of the ranks on its
# host. Each rank writes a probe file into the folder, then reads every
# rank's: the ranks that read each other's probes share a storage. The
# lowest rank of each such group does there what rank 0 does on one shared
# filesystem: settle and make the temporary directory, write the marker,
# rename, tidy.

PROBE_PREFIX = ".ktd-storage-probe-"
_storage = {}  # (folder, world process group) -> storage groups


def storage_groups(folder, group=None):
    """The ranks that see the same files in `folder` (made on every rank
    of a multi-process run when missing): lists of ranks, each sorted,
    ordered by their lowest rank. [[0, 1, 2, 3]] on one shared filesystem,
    [[0, 1], [2, 3]] for two hosts of two ranks with local disks, [[0]] in
    one process.

    The first call for a folder probes it (every rank writes a file of a
    few bytes there with a random token, then reads some others': two
    all_gather_objects of a few bytes, `_probe_storage`); the answer is
    kept for the run (`forget_storage`). Collective: call on every rank."""
    if not runtime.is_multi_process():
        return [[runtime.process_id()]]
    key = (normalize(folder), dist.group.WORLD)
    if key not in _storage:
        _storage[key] = _probe_storage(key[0], group or runtime.cpu_group())
        if len(_storage[key]) > 1 and runtime.process_id() == 0:
            logger.info(
                "%s is not one shared folder: the ranks %s each see their "
                "own copy; the lowest rank of each completes its copy of "
                "every checkpoint saved there.",
                key[0],
                _storage[key],
            )
    return _storage[key]


def forget_storage(folder=None):
    """Forget which ranks share `folder` (every folder by default): after
    the folder is removed, or when the process group goes."""
    if folder is None:
        _storage.clear()
        return
    folder = normalize(folder)
    for key in [key for key in _storage if key[0] == folder]:
        del _storage[key]


def leads(groups):
    """True when this rank is the lowest of its storage group: the one that
    completes, renames and tidies the checkpoints that storage holds."""
    rank = runtime.process_id()
    return any(members[0] == rank for members in groups)


def _probe_storage(folder, group):
    """Storage groups of `folder`, found by probe files. Ranks on one host
    normally see one storage: the first rank of each host reads the probes
    of the first ranks of the others, and every other rank reads only its
    host's first rank's, or, where it does not see that (a container with
    mounts of its own), those of every host's first rank and of its own
    host's ranks. So a job of R ranks on H hosts opens about H*H + R
    probe files in all, not R*R."""
    rank = runtime.process_id()
    token = secrets.token_hex(8)
    probe = os.path.join(folder, f"{PROBE_PREFIX}{rank}")

    def write_probe():
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w", encoding="ascii") as f:
                f.write(token)
        except OSError as error:
            raise _cannot_write(folder, error) from error
        return socket.gethostname(), token

    # Every probe is written before any is read, and every token is known.
    written = agreement.gather(write_probe, group)
    hosts = [host for host, _ in written]

    def sees(other):
        name = os.path.join(folder, f"{PROBE_PREFIX}{other}")
        try:
            with open(name, encoding="ascii", errors="replace") as f:
                return f.read() == written[other][1]
        except FileNotFoundError:  # that rank's probe is on another storage
            return False

    firsts = {}
    for other, host in enumerate(hosts):
        firsts.setdefault(host, other)
    first = firsts[hosts[rank]]

    def read_probes():
        if rank == first:
            wanted = set(firsts.values())
        elif sees(first):
            return [first]
        else:
            wanted = set(firsts.values()) | {
                other for other, host in enumerate(hosts) if host == hosts[rank]
            }
        return sorted(other for other in wanted if sees(other))

    seen = agreement.gather(read_probes, group)
    try:
        os.remove(probe)
    except OSError as error:
        logger.warning("could not remove the probe file %s: %s", probe, error)
    return _groups_from(seen)


def _groups_from(seen):
    """Storage groups from the ranks each rank saw the probes of: ranks
    that saw each other's (transitively) share a storage."""
    parent = list(range(len(seen)))

    def root(rank):
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    for rank, others in enumerate(seen):
        for other in others:
            if 0 <= other < len(seen):
                parent[root(other)] = root(rank)
    found = {}
    for rank in range(len(seen)):
        found.setdefault(root(rank), []).append(rank)
    return sorted(found.values())


# ---------------------------------------------------------------------------
# Rank 0's file operations (each storage's lowest rank).
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

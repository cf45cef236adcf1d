"""Which ranks share a checkpoint's storage (a folder all of them see, or
one copy per host).

Hosts without a shared filesystem each have their own copy of a
checkpoint's folder, and a rank sees only the files of the ranks on its
host. Each rank writes a probe file into the folder, then reads every
rank's: the ranks that read each other's probes share a storage. The
lowest rank of each such group does there what rank 0 does on one shared
filesystem: settle and make the temporary directory, write the marker,
rename, tidy.
"""

import os
import secrets
import socket

import torch.distributed as dist

from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError
from keras_torch_distribution.checkpoint._location import normalize

PROBE_PREFIX = ".ktd-storage-probe-"
_storage = {}  # (folder, world process group) -> storage groups


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


def storage_groups(
    folder: str, group: dist.ProcessGroup | None = None
) -> list[list[int]]:
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


def forget_storage(folder: str | None = None) -> None:
    """Forget which ranks share `folder` (every folder by default): after
    the folder is removed, or when the process group goes."""
    if folder is None:
        _storage.clear()
        return
    folder = normalize(folder)
    for key in [key for key in _storage if key[0] == folder]:
        del _storage[key]


def leads(groups: list[list[int]]) -> bool:
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

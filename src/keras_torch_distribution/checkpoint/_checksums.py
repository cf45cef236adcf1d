"""Checksums: each file's size and CRC-32, as its writer recorded them in
the marker, checked before the file is read.

The checksums detect accidents (truncation, flipped bits), not forgery.
A copy of a checkpoint that lacks the files other hosts wrote (hosts that
did not share the folder) is named by `split_error`.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import SplitCheckpointError

CHECKSUM = "crc32"
_CHUNK = 8 * 2**20


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def file_checksum(path: str) -> tuple[int, str]:
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


def file_entries(marker: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{file name: {"rank", "bytes", "crc32"}} the marker records ({} for a
    checkpoint written before checksums, format_version 1)."""
    return marker.get("files") or {}


def writer_of(marker: dict[str, Any], name: str) -> int | None:
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


def check_size(directory: str, name: str, entry: dict[str, Any]) -> None:
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


def verify_file(directory: str, name: str, entry: dict[str, Any]) -> None:
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


def check_sizes(directory: str, marker: dict[str, Any]) -> None:
    """Every file the marker lists exists with its recorded size; a copy
    that lacks the files of other hosts raises SplitCheckpointError."""
    split = split_error(directory, marker)
    if split is not None:
        raise split
    for name, entry in sorted(file_entries(marker).items()):
        check_size(directory, name, entry)


def split_error(
    directory: str, marker: dict[str, Any]
) -> SplitCheckpointError | None:
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


def problems(
    directory: str, marker: dict[str, Any]
) -> list[DamagedCheckpointError]:
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

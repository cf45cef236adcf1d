"""Where a checkpoint lives: the names of its files and which directory
holds the newest complete checkpoint of a path.

A checkpoint at ``path`` is a directory holding DCP's files (one
``__<rank>_<n>.distcp`` per writing rank and ``.metadata``) and the
completion marker ``keras_checkpoint.json``. A directory holding the marker
is complete; one without it is never loaded. `resolve` finds the newest
complete checkpoint of ``path`` whatever instant a crash stopped a
replacement at (`_files`): ``path.incomplete`` once it holds the marker (it
is always newer: a save starts by clearing it), else ``path``, else
``path.old``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from keras_torch_distribution._log import logger
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import NotACheckpointError

FORMAT = "keras_torch_distribution.checkpoint"
# 2: the marker lists every file with its size, CRC-32 and writing rank.
FORMAT_VERSION = 2
MARKER = "keras_checkpoint.json"
METADATA = ".metadata"
INCOMPLETE_SUFFIX = ".incomplete"
OLD_SUFFIX = ".old"
REMOVING_SUFFIX = ".removing"


def normalize(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not path:
        raise ValueError("The checkpoint path is empty; give a directory path.")
    return os.path.abspath(path.rstrip(os.sep) or os.sep)


# ---------------------------------------------------------------------------
# Which directory holds the checkpoint of a path.
# ---------------------------------------------------------------------------


def has_marker(directory: str) -> bool:
    """True when `directory` holds a completion marker and DCP's metadata."""
    return os.path.isfile(os.path.join(directory, MARKER)) and os.path.isfile(
        os.path.join(directory, METADATA)
    )


def resolve(path: str | os.PathLike[str]) -> str | None:
    """The directory holding the newest complete checkpoint of `path`
    (`path` itself, or what an interrupted replacement left), or None."""
    path = normalize(path)
    for directory in (path + INCOMPLETE_SUFFIX, path, path + OLD_SUFFIX):
        if has_marker(directory):
            return directory
    return None


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when `path` holds a complete checkpoint written by `save` (also
    one whose replacement a crash interrupted)."""
    return resolve(path) is not None


def locate(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
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


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
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

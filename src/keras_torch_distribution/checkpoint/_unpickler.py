"""The restricted metadata reader: DCP's `.metadata` unpickled admitting
only DCP's metadata classes.

`read_metadata` uses `_MetadataUnpickler`, which admits only the classes a
`.metadata` written by `save` refers to, and then checks that every entry is
a tensor stored in a file of the checkpoint. (DCP's own reader uses
`pickle.load`, which runs whatever a `.metadata` file asks for; the tensors
themselves are read with `torch.load(weights_only=True)`.)
"""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

import keras_torch_distribution.checkpoint._checksums as _checksums
import keras_torch_distribution.checkpoint._location as _location
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._errors import UnsafeCheckpointError

if TYPE_CHECKING:
    pass


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
    path = os.path.join(directory, _location.METADATA)
    entries = _checksums.file_entries(marker)
    if _location.METADATA in entries:
        _checksums.verify_file(
            directory, _location.METADATA, entries[_location.METADATA]
        )
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

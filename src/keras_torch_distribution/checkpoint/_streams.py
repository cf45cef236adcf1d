"""Checked file streams: every file DCP writes or reads goes through
`_CheckedFileSystem`.

- Writing, it computes each file's CRC-32 (`_HashingStream`) and turns an
  operating-system error into a `CheckpointWriteError` naming the file, the
  rank and the error ("No space left on device", "File too large"); the
  sizes and checksums end up in the completion marker (`_files.finish`).
- Before a rank reads a file, it checks the file's size and CRC-32 against
  the marker (`DamagedCheckpointError` names the file and its writer).
- DCP reports failures as `CheckpointException`, a `BaseException` whose
  message hides the cause; `_translated` re-raises it on every rank as the
  failing rank's `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import zlib
from typing import TYPE_CHECKING

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

import keras_torch_distribution.checkpoint._checksums as _checksums
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.checkpoint._errors import CheckpointError
from keras_torch_distribution.checkpoint._errors import CheckpointReadError
from keras_torch_distribution.checkpoint._errors import CheckpointWriteError

if TYPE_CHECKING:
    pass


# Computing checksums while saving; off only to measure what they cost
# (benchmarks/checkpoint_checksum.py).
CHECKSUMS_ON_SAVE = True
# How checkpoint files are opened for writing (tests put a file system that
# fills up here when they cannot mount a small one).
_open = open


class _HashingStream:
    """A file being written: CRC-32 of every byte written, and the first
    operating-system error seen (torch's zip writer reports a failed write
    as 'unexpected pos', hiding the errno)."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0
        self.error = None
        self.hashing = CHECKSUMS_ON_SAVE

    def _io(self, method, *args):
        try:
            return method(*args)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise

    def write(self, data):
        written = self._io(self._raw.write, data)
        if self.hashing:
            self.crc = zlib.crc32(data, self.crc)
        return written

    def tell(self):
        return self._raw.tell()

    def flush(self):
        return self._io(self._raw.flush)

    def fileno(self):
        return self._raw.fileno()

    def close(self):
        return self._io(self._raw.close)

    @property
    def closed(self):
        return self._raw.closed


def _os_error_of(error, stream=None):
    """The operating-system error behind `error` (its cause chain, or what
    the stream saw), or None."""
    if stream is not None and stream.error is not None:
        return stream.error
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _CheckedFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system, checked: streams written are hashed and
    recorded in `written` ({name: {"bytes", "crc32"}}); a stream read is
    verified first against `expected` (the marker's entries) and a failure
    while reading names the file and its writer."""

    def __init__(self, marker=None):
        super().__init__()
        self._marker = marker or {}
        self._expected = _checksums.file_entries(self._marker)
        self._verified = set()
        self._lock = threading.Lock()
        self.written = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        path = os.fspath(path)
        if "w" in mode:
            with self._writing(path, mode) as stream:
                yield stream
        else:
            with self._reading(path, mode) as stream:
                yield stream

    @contextlib.contextmanager
    def _writing(self, path, mode):
        stream = None
        try:
            with _open(path, mode) as raw:
                stream = _HashingStream(raw)
                yield stream
                if not raw.closed:
                    stream.flush()
        except CheckpointError:
            raise
        except Exception as error:
            cause = _os_error_of(error, stream)
            reason = (
                f"{cause.strerror or cause} (errno {cause.errno})"
                if cause is not None
                else f"{type(error).__name__}: {error}"
            )
            rank = runtime.process_id()
            raise CheckpointWriteError(
                f"Rank {rank} could not write checkpoint file {path!r}: "
                f"{reason}. Free space or raise the limit (df -h, ulimit -f) "
                "or save elsewhere; the checkpoint was not completed and the "
                "previous one (if any) is unchanged.",
                path,
                rank,
            ) from error
        if stream.hashing:
            size = os.path.getsize(path)
            with self._lock:
                self.written[os.path.basename(path)] = {
                    "bytes": size,
                    _checksums.CHECKSUM: _checksums.crc32_hex(stream.crc),
                }

    @contextlib.contextmanager
    def _reading(self, path, mode):
        directory, name = os.path.split(path)
        entry = self._expected.get(name)
        if entry is not None and name not in self._verified:
            _checksums.verify_file(directory, name, entry)
            with self._lock:
                self._verified.add(name)
        try:
            with open(path, mode) as stream:
                yield stream
        except CheckpointError:
            raise
        except Exception as error:
            writer = _checksums.writer_of(self._marker, name)
            what = str(error) or "the file ends early"
            raise CheckpointReadError(
                f"Rank {runtime.process_id()} could not read checkpoint file "
                f"{path!r} (written by rank {writer}): "
                f"{type(error).__name__}: {what}. "
                "The file is damaged or was not written completely; load "
                "another checkpoint.",
                path,
                writer,
            ) from error

    def rename(self, path, new_path):
        super().rename(path, new_path)
        with self._lock:
            entry = self.written.pop(os.path.basename(os.fspath(path)), None)
            if entry is not None:
                self.written[os.path.basename(os.fspath(new_path))] = entry


class _Writer(dcp.FileSystemWriter):
    def __init__(self, directory):
        super().__init__(directory)
        self.fs = _CheckedFileSystem()


class _Reader(dcp.FileSystemReader):
    """Reads the checkpoint with `metadata` already read (restricted) and
    every file verified before it is read."""

    def __init__(self, directory, marker, metadata):
        super().__init__(directory)
        self.fs = _CheckedFileSystem(marker)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


@contextlib.contextmanager
def _translated(action, path):
    """Re-raise DCP's CheckpointException (a BaseException hiding its cause)
    as the first failing rank's CheckpointError, on every rank."""
    try:
        yield
    except CheckpointException as error:
        failures = sorted(error.failures.items())
        ranks = [rank for rank, _ in failures]
        ours = [
            (r, e) for r, (e, _) in failures if isinstance(e, CheckpointError)
        ]
        rank, cause = ours[0] if ours else (failures[0][0], failures[0][1][0])
        if isinstance(cause, CheckpointError):
            if len(ranks) > 1:
                cause.args = (f"{cause.args[0]} (ranks {ranks} failed)",)
            raise cause from error
        kind = CheckpointWriteError if action == "save" else CheckpointReadError
        raise kind(
            f"Checkpoint {action} of {path!r} failed on rank {rank} (ranks "
            f"{ranks} failed): {type(cause).__name__}: {cause}",
            path,
            rank,
        ) from error


class _OneProcessIsIntended(warnings.catch_warnings):
    """Silence DCP's warning that it assumes one process when
    torch.distributed is not started (a plain one-process Keras run)."""

    def __enter__(self):
        result = super().__enter__()
        warnings.filterwarnings(
            "ignore",
            message=(
                "torch.distributed is disabled, unavailable or uninitialized"
            ),
        )
        return result


def _no_dist():
    return not runtime.is_initialized()

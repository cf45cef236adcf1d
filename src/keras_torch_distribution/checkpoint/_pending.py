"""Saves in progress: `PendingCheckpoint`, what `async_save` returns, and
the ones not completed yet (completed before the same path is written
again, or at exit).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING
from typing import Any

import torch.distributed as dist

import keras_torch_distribution.checkpoint._files as _files
from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import note
from keras_torch_distribution.checkpoint._errors import CheckpointError
from keras_torch_distribution.checkpoint._streams import _translated
from keras_torch_distribution.checkpoint._streams import _Writer

if TYPE_CHECKING:
    from concurrent.futures import Future


@contextlib.contextmanager
def _discarded_on_failure(path, group=None):
    """A save that fails (on every rank: DCP gathers failures) leaves no
    `path`.incomplete behind. Collective: call on every rank."""
    try:
        yield
    except CheckpointError:
        _files.discard_incomplete(path, group)
        raise


def note_saved(path, size, started):
    """The line a save prints at the default level: path, size, seconds
    (at INFO for a routine backup, `routine_saves`)."""
    say = logger.info if _routine.depth else note
    say(
        "checkpoint saved: %s (%s, %.2f s)",
        path,
        human_bytes(size),
        time.perf_counter() - started,
    )


class _Routine(threading.local):
    depth = 0


_routine = _Routine()


@contextlib.contextmanager
def routine_saves():
    """Saves in this block are BackupAndRestore's routine backups (every
    epoch, or every N batches): said at INFO, not at the default level, as
    Keras' own BackupAndRestore says nothing (a line per epoch was noise,
    and landed inside the progress bar's line)."""
    _routine.depth += 1
    try:
        yield
    finally:
        _routine.depth -= 1


_unfinished = []  # PendingCheckpoints whose result() was not called yet
_unfinished_lock = threading.Lock()


class PendingCheckpoint:
    """An `async_save` in progress. `result()` waits for the files and makes
    the checkpoint complete (renames it into place); until then `path` holds
    no checkpoint. One never completed is completed when the interpreter
    exits, with a warning. Collective: call `result()` on every rank."""

    def __init__(
        self,
        future: Future,
        path: str,
        marker: dict[str, Any],
        group: dist.ProcessGroup | None,
        writer: _Writer,
    ) -> None:
        self._future = future
        self.path = path
        self._marker = marker
        self._group = group
        self._writer = writer
        self._done = False
        self._lock = threading.Lock()
        self._started = time.perf_counter()  # for the note at completion

    def done(self) -> bool:
        """True once this rank's files are written (no collective)."""
        return self._future.done()

    def result(self) -> str:
        """Wait for every rank's files, then complete the checkpoint.
        Collective: call on every rank.

        Returns:
            The checkpoint's directory, complete.
        """
        with self._lock:
            if not self._done:
                with _unfinished_lock:
                    if self in _unfinished:
                        _unfinished.remove(self)
                with (
                    _discarded_on_failure(self.path, self._group),
                    _translated("save", self.path),
                ):
                    self._future.result()
                size = _files.finish(
                    self.path,
                    self._marker,
                    self._writer.fs.written,
                    self._group,
                )
                self._done = True
                note_saved(self.path, size, self._started)
        return self.path


def _complete_all_pending():
    """Complete this process's pending async saves (every rank has the same
    ones: async_save is collective). Collective: call on every rank."""
    with _unfinished_lock:
        pending = list(_unfinished)
    for handle in pending:
        handle.result()


def _complete_pending_for(path):
    """Complete this process's pending async saves to `path` (every rank has
    the same ones: async_save is collective) before it is written again."""
    with _unfinished_lock:
        pending = [p for p in _unfinished if p.path == path]
    for handle in pending:
        handle.result()

"""The checkpoint package's errors.

Each one says which file (or directory) is involved, which rank wrote it
(reading) or was writing it (writing), the cause and what to do. They are
plain `Exception`s: torch's own `CheckpointException` is a `BaseException`
that `except Exception` misses, so the package re-raises it as one of these.
Every error survives pickling with its `path` and `rank`, because torch's
checkpoint code gathers each rank's exception to every other rank.
"""


class NotACheckpointError(FileNotFoundError):
    """A path holds no complete checkpoint."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's variables do not match the model's."""

    def __init__(self, message, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class CheckpointError(Exception):
    """Writing or reading a checkpoint failed.

    `path` is the file (or directory) involved, `rank` the process that
    wrote it (when reading) or was writing it (when writing); either is None
    when unknown.
    """

    def __init__(self, message, path=None, rank=None):
        super().__init__(message)
        self.path = path
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.path, self.rank))


class CheckpointWriteError(CheckpointError):
    """A rank could not write its files (a full disk, a file-size limit, a
    read-only folder...); the message carries the operating system's error."""


class CheckpointReadError(CheckpointError):
    """A checkpoint file could not be read."""


class UnsafeCheckpointError(CheckpointReadError, NotACheckpointError):
    """A checkpoint's `.metadata` refers to something a checkpoint of this
    package never holds (a class outside DCP's metadata classes, a file
    outside the checkpoint): it was not written by `checkpoint.save`, and is
    refused without running any of it. Also a `NotACheckpointError`."""


class DamagedCheckpointError(CheckpointReadError, NotACheckpointError):
    """A checkpoint file differs from what its writer recorded (size or
    checksum): truncated, bit-flipped or replaced. It is also a
    `NotACheckpointError`: the path holds no intact checkpoint."""


class SplitCheckpointError(CheckpointReadError, NotACheckpointError):
    """A checkpoint saved on hosts that do not share a directory is loaded
    from one host's copy: each host holds only the files its ranks wrote,
    and the files of the others are missing. `missing` lists them as
    {file name: (writing rank, its host)}. Copying every host's directory
    into one makes it loadable, on any number of processes."""

    def __init__(self, message, path=None, rank=None, missing=None):
        super().__init__(message, path, rank)
        self.missing = dict(missing or {})

    def __reduce__(self):
        return (
            type(self),
            (self.args[0], self.path, self.rank, self.missing),
        )

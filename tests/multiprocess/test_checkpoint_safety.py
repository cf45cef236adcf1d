"""Checkpoints that are hostile, damaged, unwritable or half-replaced, on
gloo ranks.

- A `.metadata` whose pickle would run a command is refused, naming the file
  and the class, by `checkpoint.load`, `ShardedCheckpoint(restore=True)`,
  `BackupAndRestore` (2 ranks) and `ktd report`; the command never runs.
  `.keras` files keep Keras' safe_mode under a distribution.
- A shard with a flipped byte or cut short is refused on every rank, naming
  the file and the rank that wrote it; `ktd report` calls it damaged.
- A full disk (a 1 MiB tmpfs, or a file layer that fills up when mounting is
  not possible) and a file-size limit (RLIMIT_FSIZE on rank 1) raise
  CheckpointWriteError naming the file, the rank and the OS error on every
  rank; a truncated shard of a checkpoint without checksums raises
  CheckpointReadError naming the file and its writer.
- BackupAndRestore resumes from the last complete backup whatever step of
  replacing `latest.ckpt` rank 0 stopped at (the directory is copied before
  each step, as a crash there would leave it), with the weights of an
  uninterrupted run; `*.incomplete` folders left by crashes are removed.

Metadata pointing outside the checkpoint (one process) is in
unit/test_checkpoint_files.py; an `async_save` never completed with
`.result()` being completed at exit is in e2e/test_checkpoint_process_exit.py.
"""

import contextlib
import errno
import os
import pickle
import shutil
import subprocess

import pytest

from helpers import SAVE_RULES
from helpers import assert_same_values
from helpers import checkpoint_data
from helpers import checkpoint_model
from helpers import checkpoint_values
from helpers import distribute
from helpers import record_file
from helpers import resume_fit
from helpers import rewrite_marker
from helpers import train_and_save


def _big_model():
    """About 1.5 MiB of weights and Adam slots, half per rank when sharded."""
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(512, name="col"),
            keras.layers.Dense(4, name="row"),
        ],
        name="big",
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _error(call):
    """What `call()` raised (type name, message, path, rank), or None; torch's
    CheckpointException is a BaseException."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        call()
    except (Exception, CheckpointException) as error:  # returned to the test
        return (
            type(error).__name__,
            str(error),
            getattr(error, "path", None),
            getattr(error, "rank", None),
        )
    return None


# ---------------------------------------------------------------------------
# 1. Nothing in a checkpoint is run.
# ---------------------------------------------------------------------------


class _RunsACommand:
    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _poison(path, flag):
    """Give the checkpoint's DCP metadata planner data that runs `touch flag`
    when unpickled (and loads fine otherwise), and record its checksum."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()  # our own file
    metadata.planner_data = _RunsACommand(flag)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    record_file(path, ".metadata")


def open_malicious(path, run_directory, backup_dir):
    import keras

    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    x, y = checkpoint_data()
    errors = {"load": _error(lambda: checkpoint.load(checkpoint_model(), path))}
    callback = checkpoint.ShardedCheckpoint(run_directory, restore=True)
    errors["ShardedCheckpoint"] = _error(
        lambda: checkpoint_model().fit(
            x, y, epochs=1, verbose=0, callbacks=[callback]
        )
    )
    callback = keras.callbacks.BackupAndRestore(backup_dir)
    errors["BackupAndRestore"] = _error(
        lambda: checkpoint_model().fit(
            x, y, epochs=1, verbose=0, callbacks=[callback]
        )
    )
    return errors


def test_malicious_metadata_runs_nothing_and_names_the_class(
    pool2, tmp_path, capsys
):
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution_cli import main as ktd_main

    flag = tmp_path / "ran"
    source = tmp_path / "source"
    checkpoint.save(
        checkpoint_model(), source, extra={"epoch": 1, "step": 4, "batch": 0}
    )
    paths = {
        "load": tmp_path / "ckpt",
        "ShardedCheckpoint": tmp_path / "run" / "ckpt-000000004",
        "BackupAndRestore": tmp_path / "backup" / "latest.ckpt",
    }
    for path in paths.values():
        shutil.copytree(source, path)
        _poison(str(path), str(flag))
    errors = pool2.run(
        open_malicious,
        str(paths["load"]),
        str(tmp_path / "run"),
        str(tmp_path / "backup"),
    )
    assert not flag.exists()  # the command never ran
    for rank_errors in errors:
        for what, path in paths.items():
            kind, message, where, _ = rank_errors[what]
            assert kind == "UnsafeCheckpointError", (what, message)
            assert (
                "posix.system" in message and str(path / ".metadata") in message
            )
            assert where == str(path / ".metadata")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="posix.system"):
        checkpoint.load(checkpoint_model(), paths["load"])
    assert ktd_main(["report", str(paths["load"])]) == 2
    report = capsys.readouterr().err
    assert "posix.system" in report and ".metadata" in report
    assert not flag.exists()  # the command never ran


def save_and_load_keras_file_with_a_lambda(path):
    import keras

    from keras_torch_distribution._processes import runtime

    distribute(SAVE_RULES)
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, name="col"),
            keras.layers.Lambda(lambda t: t * 2.0, name="double"),
            keras.layers.Dense(4, name="row"),
        ]
    )
    model.save(path)  # collective; rank 0 writes
    assert os.path.exists(path), runtime.process_id()
    return _error(lambda: keras.saving.load_model(path))


def test_keras_file_loading_keeps_safe_mode_under_a_distribution(
    pool2, tmp_path
):
    for kind, message, _, _ in pool2.run(
        save_and_load_keras_file_with_a_lambda, str(tmp_path / "lambda.keras")
    ):
        assert kind == "ValueError"
        assert "safe_mode" in message and "Lambda" in message


# ---------------------------------------------------------------------------
# 2. Damaged files are named, with the rank that wrote them.
# ---------------------------------------------------------------------------


def load_errors(path):
    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    return _error(lambda: checkpoint.load(checkpoint_model(), path))


def test_flipped_or_truncated_shard_is_refused_naming_file_and_writer(
    pool2, tmp_path, capsys
):
    from keras_torch_distribution_cli import main as ktd_main

    path = str(tmp_path / "ckpt")
    pool2.run(train_and_save, path)
    shard = os.path.join(path, "__1_0.distcp")
    original = open(shard, "rb").read()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    cases = {
        "flipped": (bytes(flipped), "CRC-32"),
        "truncated": (original[:-100], "truncated"),
    }
    for name, (content, says) in cases.items():
        with open(shard, "wb") as f:
            f.write(content)
        for kind, message, where, rank in pool2.run(load_errors, path):
            assert kind == "DamagedCheckpointError", (name, message)
            assert where == shard and rank == 1
            assert "written by rank 1" in message and says in message
        assert ktd_main(["report", path]) == 2
        report = capsys.readouterr()
        assert "damaged" in report.err and "__1_0.distcp" in report.err, report
        assert "written by rank 1" in report.err
    with open(shard, "wb") as f:
        f.write(original)
    assert ktd_main(["report", path]) == 0
    assert (
        "intact: every file has the size and CRC-32" in capsys.readouterr().out
    )


# ---------------------------------------------------------------------------
# 3. Errors name the file, the rank and the operating system's error.
# ---------------------------------------------------------------------------


class _FillingFile:
    """A file on a disk with `room` bytes left (shared by every file)."""

    room = 0

    def __init__(self, raw):
        self._raw = raw

    def write(self, data):
        size = memoryview(data).nbytes
        if size > _FillingFile.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FillingFile.room -= size
        return self._raw.write(data)

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._raw.close()


def save_errors(path, fill_after=None, size_limit_rank=None):
    """Save the big model; a disk that fills after `fill_after` bytes (the
    fake layer), or a 64 KiB file-size limit on rank `size_limit_rank`."""
    import resource
    import signal

    from keras_torch_distribution import checkpoint
    from keras_torch_distribution._processes import runtime

    distribute({r".*col/kernel": (None, "model"), r".*col/bias": ("model",)})
    model = _big_model()
    limit = runtime.process_id() == size_limit_rank
    with contextlib.ExitStack() as undo:
        if fill_after is not None:
            from keras_torch_distribution.checkpoint import _streams

            _FillingFile.room = fill_after
            undo.callback(setattr, _streams, "_open", _streams._open)
            _streams._open = lambda p, mode: _FillingFile(open(p, mode))
        if limit:
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            undo.callback(
                signal.signal,
                signal.SIGXFSZ,
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
            )
            undo.callback(
                resource.setrlimit, resource.RLIMIT_FSIZE, (soft, hard)
            )
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        error = _error(lambda: checkpoint.save(model, path))
    return error, checkpoint.is_checkpoint(path)


@contextlib.contextmanager
def _small_disk(directory):
    """A 1 MiB tmpfs at `directory` (yields None), or, where mounting is not
    allowed, the bytes the fake file layer lets each rank write (less than
    either rank's part of the big model)."""
    os.makedirs(directory)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", directory],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield None if mounted else 256 * 1024
    finally:
        if mounted:
            subprocess.run(["umount", directory], check=True)


def _assert_names_the_failure(error, says):
    kind, message, where, rank = error
    assert kind == "CheckpointWriteError", message
    assert where.endswith(f"__{rank}_0.distcp"), (where, message)
    assert f"Rank {rank} could not write checkpoint file" in message
    assert says in message and where in message


def test_full_disk_and_file_size_limit_name_file_rank_and_os_error(
    pool2, tmp_path
):
    full = str(tmp_path / "full")
    with _small_disk(full) as fill_after:
        results = pool2.run(save_errors, os.path.join(full, "ckpt"), fill_after)
    for error, complete in results:
        _assert_names_the_failure(error, "No space left on device")
        assert not complete
    assert results[0][0] == results[1][0]  # the same error on every rank
    path = str(tmp_path / "limited" / "ckpt")
    for error, complete in pool2.run(save_errors, path, None, 1):
        _assert_names_the_failure(error, "File too large")
        assert error[3] == 1 and not complete


def test_truncated_shard_without_checksums_names_file_and_writer(
    pool2, tmp_path
):
    path = str(tmp_path / "ckpt")
    pool2.run(train_and_save, path)

    def as_version_1(marker):  # written before checksums
        marker["format_version"] = 1
        marker.pop("files", None)

    rewrite_marker(path, as_version_1)
    shard = os.path.join(path, "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    for kind, message, where, rank in pool2.run(load_errors, path):
        assert kind == "CheckpointReadError", message
        assert where == shard and rank == 1
        assert "(written by rank 1)" in message and shard in message


# ---------------------------------------------------------------------------
# 6. Recovery: a crash at each step of a replacement, leftovers, async exit.
# ---------------------------------------------------------------------------


def backup_with_snapshots(backup_dir, snapshots):
    """fit 3 epochs with BackupAndRestore; on rank 0, copy the backup folder
    before each rename or removal that replaces the epoch-1 backup by the
    epoch-2 one (what rank 0 dying there would leave), and once after."""
    import keras

    from keras_torch_distribution._processes import runtime
    from keras_torch_distribution.checkpoint import _files

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    during = {"epoch": None}

    def snapshot():
        if runtime.process_id() == 0 and during["epoch"] == 1:
            count = len(os.listdir(snapshots))
            shutil.copytree(backup_dir, os.path.join(snapshots, f"{count:02d}"))

    def stopping_first(step):
        def wrapped(*args):
            snapshot()
            return step(*args)

        return wrapped

    class Track(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            during["epoch"] = epoch  # runs before the backup's on_epoch_end

        def on_epoch_begin(self, epoch, logs=None):
            snapshot()  # after the replacement
            during["epoch"] = None

    os.makedirs(snapshots, exist_ok=True)
    rename, rmtree = _files.rename, _files._rmtree
    _files.rename, _files._rmtree = (
        stopping_first(rename),
        stopping_first(rmtree),
    )
    try:
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[Track(), keras.callbacks.BackupAndRestore(backup_dir)],
        )
    finally:
        _files.rename, _files._rmtree = rename, rmtree
    return checkpoint_values(model)


def resume(backup_dir):
    """fit 3 epochs with BackupAndRestore(backup_dir): (epochs run, values)."""
    return resume_fit(backup_dir, None, kill=False, epochs=3)


def test_backup_resumes_from_last_complete_backup_after_a_crash_at_each_step(
    pool2, tmp_path
):
    snapshots = tmp_path / "snapshots"
    reference = pool2.run(
        backup_with_snapshots, str(tmp_path / "backup"), str(snapshots)
    )[0]
    names = sorted(os.listdir(snapshots))
    # marker in place, latest -> old, incomplete -> latest, old -> removing,
    # removing removed; then the state after all of them.
    assert len(names) == 6, names
    for index, name in enumerate(names):
        for seen, values in pool2.run(resume, str(snapshots / name)):
            # Until the marker is in place the new backup is incomplete: the
            # epoch-1 backup is the last complete one; from then on epoch 2's.
            assert seen == ([1, 2] if index == 0 else [2]), (
                name,
                sorted(os.listdir(snapshots / name)),
            )
            assert_same_values(values, reference)


def fit_over_leftovers(directory, max_to_keep):
    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    callback = checkpoint.ShardedCheckpoint(
        directory, max_to_keep=max_to_keep, restore=True
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    )
    return sorted(os.listdir(directory))


def test_incomplete_folders_are_removed_and_max_to_keep_counts_complete_ones(
    pool2, tmp_path
):
    from keras_torch_distribution import checkpoint

    directory = tmp_path / "run"
    model = checkpoint_model()
    model.fit(
        *checkpoint_data(), batch_size=8, epochs=1, shuffle=False, verbose=0
    )
    checkpoint.save(
        model,
        directory / "ckpt-000000004",
        extra={"epoch": 1, "batch": 0, "step": 4},
    )
    for leftover in ("ckpt-000000008.incomplete", "ckpt-000000002.removing"):
        (directory / leftover).mkdir()
        (directory / leftover / "__1_0.distcp").write_bytes(b"partial")
    # Resumes after epoch 1 and saves after epochs 2 and 3.
    assert pool2.run(fit_over_leftovers, str(directory), None)[0] == [
        "ckpt-000000004",
        "ckpt-000000008",
        "ckpt-000000012",
    ]
    (directory / "ckpt-000000016.incomplete").mkdir()
    assert pool2.run(fit_over_leftovers, str(directory), 2)[0] == [
        "ckpt-000000008",
        "ckpt-000000012",
    ]

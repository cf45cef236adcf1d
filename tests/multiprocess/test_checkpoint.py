"""Sharded checkpoints (torch.distributed.checkpoint) and resuming after a crash.

Saved on 2 gloo ranks under ModelParallel, loaded in one process, on 2 ranks
with another LayoutMap and on 4 ranks with a 2x2 mesh: values are compared
exactly. The crash test launches this file as a script with torchrun on 2
processes, kills rank 1 (SIGKILL) after epoch 2, launches the job again and
checks that BackupAndRestore resumes from its last backup and ends with the
weights of an uninterrupted run (dropout included).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAVE_RULES = {
    r".*col/kernel": (None, "model"),
    r".*col/bias": ("model",),
    r".*row/kernel": ("model", None),
}
# The same model laid out the other way round.
OTHER_RULES = {
    r".*col/kernel": ("model", None),
    r".*row/kernel": (None, "model"),
    r".*row/bias": ("model",),
}


def _model(width=16, last="row"):
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu", name="col"),
            keras.layers.Dropout(0.25, seed=7, name="drop"),
            keras.layers.Dense(4, name=last),
        ],
        name="net",
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _distribute(rules, mesh_shape=None, axis_names=("model",)):
    import keras

    if rules is None:
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        mesh_shape or (len(devices),), list(axis_names), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def _values(model):
    """{checkpoint key: global value} of the model's and optimizer's variables.
    Collective: call on every rank."""
    from keras_torch_distribution import checkpoint

    return {k: np.asarray(v) for k, v in checkpoint.variables_by_key(model).items()}


def _placements(model):
    from torch.distributed.tensor import DTensor

    return {
        v.path: str(v.value.placements)
        for v in model.variables
        if isinstance(v.value, DTensor)
    }


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# ---------------------------------------------------------------------------
# Functions run on the ranks.
# ---------------------------------------------------------------------------


def train_and_save(path, rules=SAVE_RULES):
    from keras_torch_distribution import checkpoint

    _distribute(rules)
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    checkpoint.save(model, path, extra={"epoch": 2, "step": 8})
    saved = _values(model)
    # Training on from here is what a resumed run must reproduce.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return saved, _values(model), _placements(model)


def load_and_continue(path, rules, mesh_shape=None, axis_names=("model",)):
    from keras_torch_distribution import checkpoint

    _distribute(rules, mesh_shape, axis_names)
    model = _model()
    extra = checkpoint.load(model, path)
    loaded = _values(model)
    placements = _placements(model)
    continued = None
    if rules is not None and mesh_shape is None:
        x, y = _data()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        continued = _values(model)
    return extra, loaded, placements, continued


def shard_files(path):
    """Which files hold the chunks of each saved key."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    files = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, []).append(info.relative_path)
    return {k: sorted(v) for k, v in files.items()}


def async_then_change(path):
    import keras

    from keras_torch_distribution import checkpoint

    _distribute(SAVE_RULES)
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    before = _values(model)
    pending = checkpoint.async_save(model, path, extra={"epoch": 1})
    # Training goes on while the files are written.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    complete_early = checkpoint.is_checkpoint(path)
    pending.result()
    keras.backend.clear_session()
    _distribute(OTHER_RULES)
    fresh = _model()
    extra = checkpoint.load(fresh, path)
    return before, _values(fresh), extra, complete_early


def callback_fit(directory, epochs, restore, async_save=False):
    from keras_torch_distribution import checkpoint

    _distribute(SAVE_RULES)
    model = _model()
    x, y = _data()
    seen = []

    class Epochs(__import__("keras").callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    callback = checkpoint.ShardedCheckpoint(
        directory, max_to_keep=2, restore=restore, async_save=async_save
    )
    model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[callback, Epochs()],
    )
    return seen, sorted(os.listdir(directory)), _values(model)


def mismatch_errors(path):
    from keras_torch_distribution import checkpoint

    _distribute(SAVE_RULES)
    errors = {}
    for name, kwargs in {
        "shape": dict(width=8),
        "names": dict(last="out"),
    }.items():
        try:
            checkpoint.load(_model(**kwargs), path)
        except checkpoint.CheckpointMismatchError as error:
            errors[name] = str(error)
    return errors


# ---------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------


def test_save_on_2_load_on_1_2_and_4_with_other_layouts(pool2, pool4, tmp_path):
    from keras_torch_distribution import checkpoint

    path = str(tmp_path / "ckpt")
    results = pool2.run(train_and_save, path)
    saved, after, placements = results[0]
    _assert_same(results[1][0], saved)
    assert placements["net/col/kernel"] == "(Shard(dim=1),)"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left
    assert "optimizer/iteration" in json.loads(
        (tmp_path / "ckpt" / checkpoint.MARKER).read_text()
    )["variables"]

    # Each rank wrote its own shards; replicated variables once.
    files = shard_files(path)
    assert files["model/col/kernel"] == ["__0_0.distcp", "__1_0.distcp"]
    assert files["optimizer/col/kernel/momentum"] == [
        "__0_0.distcp", "__1_0.distcp"
    ]
    assert len(files["model/row/bias"]) == 1
    assert len(files["optimizer/iteration"]) == 1

    # One process, no distribution: full values.
    import keras

    keras.distribution.set_distribution(None)
    model = _model()
    assert checkpoint.load(model, path) == {"epoch": 2, "step": 8}
    _assert_same(_values(model), saved)
    assert int(np.asarray(model.optimizer.iterations)) == 8

    # 2 processes, another LayoutMap; training on matches the saving run.
    for extra, loaded, placed, continued in pool2.run(
        load_and_continue, path, OTHER_RULES
    ):
        assert extra == {"epoch": 2, "step": 8}
        assert placed["net/col/kernel"] == "(Shard(dim=0),)"
        assert placed["net/row/bias"] == "(Shard(dim=0),)"
        _assert_same(loaded, saved)
        for key in after:
            np.testing.assert_allclose(continued[key], after[key], rtol=1e-6, atol=1e-7)

    # 4 processes on a 2x2 mesh sharding the kernel on both axes.
    rules = {r".*col/kernel": ("batch", "model"), r".*row/kernel": ("model", None)}
    for _, loaded, placed, _ in pool4.run(
        load_and_continue, path, rules, (2, 2), ("batch", "model")
    ):
        assert placed["net/col/kernel"] == "(Shard(dim=0), Shard(dim=1))"
        _assert_same(loaded, saved)


def test_resumed_training_is_exact_on_the_same_layout(pool2, tmp_path):
    path = str(tmp_path / "ckpt")
    _, after, _ = pool2.run(train_and_save, path)[0]
    for _, _, _, continued in pool2.run(load_and_continue, path, SAVE_RULES):
        _assert_same(continued, after)


def test_one_process_checkpoint_loads_sharded_on_2(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    checkpoint.save(model, tmp_path / "one", extra=[1, "a"])
    for extra, loaded, placed, _ in pool2.run(
        load_and_continue, str(tmp_path / "one"), SAVE_RULES, (2,)
    ):
        assert extra == [1, "a"]
        assert placed["net/col/kernel"] == "(Shard(dim=1),)"
        _assert_same(loaded, _values(model))


def test_async_save_keeps_the_values_of_its_call(pool2, tmp_path):
    path = str(tmp_path / "async")
    for before, loaded, extra, complete_early in pool2.run(async_then_change, path):
        assert extra == {"epoch": 1}
        _assert_same(loaded, before)
        assert complete_early is False  # only result() completes it
    assert sorted(os.listdir(tmp_path)) == ["async"]


def test_callback_saves_every_epoch_keeps_two_and_restores(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    directory = str(tmp_path / "run")
    seen, names, values = pool2.run(callback_fit, directory, 3, False)[0]
    assert seen == [0, 1, 2]
    assert names == ["ckpt-000000008", "ckpt-000000012"]
    assert checkpoint.read_extra(checkpoint.latest(directory)) == {
        "epoch": 3, "batch": 0, "step": 12
    }
    model = _model()
    checkpoint.load(model, checkpoint.latest(directory))
    _assert_same(_values(model), values)
    # A second fit with restore=True starts after epoch 3.
    seen, names, _ = pool2.run(callback_fit, directory, 5, True)[1]
    assert seen == [3, 4]
    assert names == ["ckpt-000000016", "ckpt-000000020"]
    # Saving in the background: fit completes the last one before returning.
    directory = str(tmp_path / "background")
    _, names, values = pool2.run(callback_fit, directory, 3, False, True)[0]
    assert names == ["ckpt-000000008", "ckpt-000000012"]
    model = _model()
    checkpoint.load(model, checkpoint.latest(directory))
    _assert_same(_values(model), values)


def test_incomplete_and_foreign_paths_are_refused(tmp_path):
    from keras_torch_distribution import checkpoint

    model = _model()
    with pytest.raises(checkpoint.NotACheckpointError, match="does not exist"):
        checkpoint.load(model, tmp_path / "nothing")
    # What a process that died while writing leaves behind.
    (tmp_path / "ckpt.incomplete").mkdir()
    (tmp_path / "ckpt.incomplete" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(checkpoint.NotACheckpointError, match="incomplete"):
        checkpoint.load(model, tmp_path / "ckpt")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.NotACheckpointError, match="is not a complete checkpoint"):
        checkpoint.load(model, tmp_path / "plain")
    with pytest.raises(FileExistsError, match="exists and is not a checkpoint"):
        checkpoint.save(model, tmp_path / "plain")
    assert (tmp_path / "plain" / "notes.txt").read_text() == "mine"
    with pytest.raises(TypeError, match="JSON-serializable"):
        checkpoint.save(model, tmp_path / "x", extra={"f": object()})
    # A save over the stale temporary directory completes and replaces it.
    checkpoint.save(model, tmp_path / "ckpt")
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt.incomplete").exists()
    unbuilt = __import__("keras").Sequential([__import__("keras").layers.Dense(2)])
    with pytest.raises(ValueError, match="is not built"):
        checkpoint.load(unbuilt, tmp_path / "ckpt")


def test_mismatches_list_missing_unexpected_and_shapes(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    path = str(tmp_path / "ckpt")
    pool2.run(train_and_save, path)
    errors = pool2.run(mismatch_errors, path)[0]
    assert "shape mismatches" in errors["shape"]
    assert "model/col/kernel: (6, 16) vs (6, 8)" in errors["shape"]
    assert "missing from the checkpoint (6): ['model/out/bias'" in errors["names"]
    assert "in the checkpoint but not in the model (6): ['model/row/bias'" in errors["names"]
    assert "optimizer=False" in errors["names"]
    # Without the optimizer, a model compiled with another one loads.
    import keras

    model = _model()
    model.compile(keras.optimizers.SGD(), "mse")
    with pytest.raises(checkpoint.CheckpointMismatchError, match="optimizer/col/kernel/momentum"):
        checkpoint.load(model, path)
    checkpoint.load(model, path, optimizer=False)


# ---------------------------------------------------------------------------
# BackupAndRestore: kill rank 1 in the middle of fit, restart, compare.
# ---------------------------------------------------------------------------

EPOCHS = 5
KILL_AFTER_EPOCH = 2


def _resume_fit(backup_dir, record, kill, epochs=EPOCHS):
    import keras

    from keras_torch_distribution import runtime

    _distribute(SAVE_RULES)
    model = _model()
    x, y = _data()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            if kill and epoch + 1 == KILL_AFTER_EPOCH and runtime.process_id() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), Record()]
    model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
        callbacks=callbacks,
    )
    values = _values(model)
    if record and runtime.process_id() == 0:
        np.savez(record + ".npz", **{k.replace("/", "|"): v for k, v in values.items()})
        with open(record + ".json", "w") as f:
            json.dump({"seen": seen, "backup_left": os.path.exists(backup_dir)}, f)
    return seen, values


def uninterrupted(backup_dir):
    return _resume_fit(backup_dir, None, kill=False)


def backup_twice(backup_dir):
    import keras

    from keras_torch_distribution import checkpoint

    _distribute(SAVE_RULES)
    model = _model()
    x, y = _data()
    callback = keras.callbacks.BackupAndRestore(
        backup_dir, double_checkpoint=True, delete_checkpoint=False
    )
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    return sorted(os.listdir(backup_dir)), [
        checkpoint.read_extra(os.path.join(backup_dir, name))
        for name in ("latest.ckpt", "previous.ckpt")
    ]


def test_backup_and_restore_keeps_two_sharded_backups(pool2, tmp_path):
    for names, extras in pool2.run(backup_twice, str(tmp_path / "backup")):
        assert names == ["latest.ckpt", "previous.ckpt"]
        assert extras == [{"epoch": 3, "batch": 0}, {"epoch": 2, "batch": 0}]


def _main(argv):
    """Run as a torchrun worker: python -m torch.distributed.run ... this file
    BACKUP_DIR OUT ATTEMPT (attempt 0 is killed after epoch 2)."""
    import keras

    import keras_torch_distribution  # noqa: F401

    keras.distribution.initialize()
    backup_dir, out, attempt = argv
    _resume_fit(backup_dir, os.path.join(out, f"attempt{attempt}"), kill=attempt == "0")


def _torchrun(tmp_path, attempt):
    """One launch of the 2-process job; returns (exit code, stderr)."""
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KTD_DEVICE="cpu",
        KTD_TIMEOUT_SECONDS="60",
        PYTHONWARNINGS="ignore",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", "--monitor-interval", "0.2",
        os.path.abspath(__file__), str(tmp_path / "backup"), str(tmp_path), str(attempt),
    ]
    # Its own session, so that a timeout ends torchrun and its workers.
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"torchrun did not finish within 120 s:\n{stderr[-4000:]}")
    return process.returncode, stderr


@pytest.mark.slow
def test_backup_and_restore_resumes_after_a_process_is_killed(pool2, tmp_path):
    # The job is launched, rank 1 is killed after epoch 2 (torchrun then
    # stops rank 0 and fails), and the job is launched again, as a scheduler
    # or torchrun's --max-restarts would.
    code, stderr = _torchrun(tmp_path, 0)
    assert code != 0 and "exitcode: -9" in stderr, stderr[-4000:]
    assert not (tmp_path / "attempt0.json").exists()  # killed before the end
    assert sorted(os.listdir(tmp_path / "backup")) == ["latest.ckpt"]
    code, stderr = _torchrun(tmp_path, 1)
    assert code == 0, stderr[-4000:]
    report = json.loads((tmp_path / "attempt1.json").read_text())
    # Resumed after the last backup (epoch 2), not from scratch.
    assert report["seen"] == list(range(KILL_AFTER_EPOCH, EPOCHS))
    assert report["backup_left"] is False  # deleted at the end, once
    resumed = {
        k.replace("|", "/"): v
        for k, v in np.load(tmp_path / "attempt1.npz").items()
    }
    seen, reference = pool2.run(uninterrupted, str(tmp_path / "reference"))[0]
    assert seen == list(range(EPOCHS))
    _assert_same(resumed, reference)


if __name__ == "__main__":
    _main(sys.argv[1:])

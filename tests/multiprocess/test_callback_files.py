"""Keras' file-writing callbacks on ranks that share a file system: the
folders Keras makes for their files, every run.

ModelCheckpoint runs on every rank (saving is collective) and makes its
file's folder where it finds none (`file_utils.makedirs`): the ranks race
to make it, and the slower one used to fail with `FileExistsError` (issue
31: a keras.io guide's `checkpoints/ckpt-{epoch}.keras`, in 4 of 6 runs).
Each test below fits into many fresh folders, so that the race is met
many times in one run.
"""

import builtins
import contextlib
import os

import numpy as np
import pytest

RUNS = 20  # fresh folders per test: each one a race between the ranks
EPOCHS = 2


def _model():
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(2)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(
        size=(16, 3)
    ).astype("float32")


@contextlib.contextmanager
def _writes_under(root, written):
    """Append to `written` every file under `root` this process opens for
    writing, through Python's `open` (a `.keras` file) or `h5py.File` (a
    `.weights.h5` file)."""
    import h5py

    root = os.path.realpath(root)
    plain_open, h5_file = builtins.open, h5py.File

    def record(path, mode):
        if isinstance(path, (str, os.PathLike)) and set(str(mode)) & set(
            "wax+"
        ):
            path = os.path.realpath(path)
            if path.startswith(root + os.sep):
                written.append(os.path.relpath(path, root))

    def spied_open(file, mode="r", *args, **kwargs):
        record(file, mode)
        return plain_open(file, mode, *args, **kwargs)

    def spied_h5_file(name, mode="r", *args, **kwargs):
        record(name, mode)
        return h5_file(name, mode, *args, **kwargs)

    builtins.open, h5py.File = spied_open, spied_h5_file
    try:
        yield
    finally:
        builtins.open, h5py.File = plain_open, h5_file


def fit_into_fresh_folders(root, pattern, runs, distribution, **checkpoint):
    """`runs` fits of one model, each with a ModelCheckpoint whose file
    pattern lies in a folder that does not exist yet (`root/run-<i>/
    pattern`). Returns the files this rank opened for writing under `root`
    and the model's weights after each fit."""
    import keras

    import helpers

    helpers.set_distribution(distribution)
    model = _model()
    x, y = _data()
    written, weights = [], []
    with _writes_under(root, written):
        for run in range(runs):
            path = os.path.join(root, f"run-{run}", pattern)
            callback = keras.callbacks.ModelCheckpoint(path, **checkpoint)
            model.fit(
                x,
                y,
                batch_size=8,
                epochs=EPOCHS,
                verbose=0,
                callbacks=[callback],
            )
            weights.append([np.asarray(v) for v in model.weights])
    return sorted(written), weights


@pytest.mark.parametrize(
    "pattern, distribution, checkpoint",
    [
        # The keras.io Gemma 3 guide's checkpoints.
        ("checkpoints/ckpt-{epoch}.keras", "mp", {}),
        # Nested folders, weights only.
        ("a/b/ckpt-{epoch}.weights.h5", "dp", {"save_weights_only": True}),
        (
            "best/ckpt-{epoch}.weights.h5",
            "mp",
            {"save_weights_only": True, "save_best_only": True},
        ),
    ],
    ids=["keras", "nested-weights", "best-only"],
)
def test_model_checkpoint_makes_new_folders_on_every_run(
    pool2, tmp_path, pattern, distribution, checkpoint
):
    results = pool2.run(
        fit_into_fresh_folders,
        str(tmp_path),
        pattern,
        RUNS,
        distribution,
        **checkpoint,
    )
    files = sorted(
        os.path.join(f"run-{run}", pattern.format(epoch=epoch))
        for run in range(RUNS)
        for epoch in range(1, EPOCHS + 1)
    )
    # Every epoch's file (the loss falls every epoch, so `save_best_only`
    # saves each), written once, by rank 0.
    assert results[0][0] == files
    assert results[1][0] == []
    found = sorted(
        os.path.relpath(os.path.join(directory, name), tmp_path)
        for directory, _, names in os.walk(tmp_path)
        for name in names
    )
    assert found == files
    # The last file of each run holds the weights every rank ends it with.
    for run in range(RUNS):
        plain = _model()
        plain.optimizer.build(plain.trainable_variables)
        plain.load_weights(
            tmp_path / f"run-{run}" / pattern.format(epoch=EPOCHS)
        )
        saved = [np.asarray(v) for v in plain.weights]
        for _, weights in results:
            for got, want in zip(saved, weights[run]):
                np.testing.assert_array_equal(got, want)


def make_folders(path, existing_file):
    """Keras' `makedirs` on every rank at once, for a folder that does not
    exist yet and, again, for one that does; then for a path that is a
    file. Returns the error of the last, if any."""
    import torch.distributed as dist
    from keras.src.utils import file_utils

    dist.barrier()
    file_utils.makedirs(path)
    file_utils.makedirs(path)
    try:
        file_utils.makedirs(existing_file)
    except FileExistsError as error:
        return os.path.isdir(path), type(error).__name__
    return os.path.isdir(path), None


def test_an_existing_folder_is_no_error_on_many_ranks_but_a_file_is(
    pool2, tmp_path
):
    existing_file = tmp_path / "file"
    existing_file.write_text("")
    results = pool2.run(
        make_folders, str(tmp_path / "x" / "y"), str(existing_file)
    )
    assert results == [(True, "FileExistsError")] * 2


def test_one_process_keeps_keras_makedirs_and_backups(tmp_path):
    import keras
    from keras.src.utils import file_utils

    import keras_torch_distribution  # noqa: F401

    file_utils.makedirs(str(tmp_path / "x"))
    with pytest.raises(FileExistsError):
        file_utils.makedirs(str(tmp_path / "x"))
    # BackupAndRestore makes its new nested folder as Keras does.
    backup_dir = tmp_path / "backup" / "nested"
    model = _model()
    x, y = _data()
    model.fit(
        x,
        y,
        epochs=1,
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(
                str(backup_dir), delete_checkpoint=False
            )
        ],
    )
    assert sorted(os.listdir(backup_dir)) == [
        "latest.weights.h5",
        "training_metadata.json",
    ]

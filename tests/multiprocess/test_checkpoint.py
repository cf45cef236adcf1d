"""Sharded checkpoints (torch.distributed.checkpoint) on gloo ranks.

Saved on 2 gloo ranks under ModelParallel, loaded in one process, on 2 ranks
with another LayoutMap and on 4 ranks with a 2x2 mesh: values are compared
exactly; async saves, the ShardedCheckpoint and BackupAndRestore callbacks,
and mismatches between a checkpoint and a model. Resuming after a rank is
killed is in e2e/test_checkpoint_process_exit.py; refusals in one process
are in unit/test_checkpoint_files.py.
"""

import json
import os

import numpy as np
import pytest

from helpers import SAVE_RULES
from helpers import assert_same_values
from helpers import checkpoint_data
from helpers import checkpoint_model
from helpers import checkpoint_values
from helpers import distribute
from helpers import placements_of
from helpers import train_and_save

# The same model laid out the other way round.
OTHER_RULES = {
    r".*col/kernel": ("model", None),
    r".*row/kernel": (None, "model"),
    r".*row/bias": ("model",),
}


# ---------------------------------------------------------------------------
# Functions run on the ranks.
# ---------------------------------------------------------------------------


def load_and_continue(path, rules, mesh_shape=None, axis_names=("model",)):
    from keras_torch_distribution import checkpoint

    distribute(rules, mesh_shape, axis_names)
    model = checkpoint_model()
    extra = checkpoint.load(model, path)
    loaded = checkpoint_values(model)
    placements = placements_of(model)
    continued = None
    if rules is not None and mesh_shape is None:
        x, y = checkpoint_data()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        continued = checkpoint_values(model)
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

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    before = checkpoint_values(model)
    pending = checkpoint.async_save(model, path, extra={"epoch": 1})
    # Training goes on while the files are written.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    complete_early = checkpoint.is_checkpoint(path)
    pending.result()
    keras.backend.clear_session()
    distribute(OTHER_RULES)
    fresh = checkpoint_model()
    extra = checkpoint.load(fresh, path)
    return before, checkpoint_values(fresh), extra, complete_early


def callback_fit(directory, epochs, restore, async_save=False):
    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    seen = []

    class Epochs(__import__("keras").callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    callback = checkpoint.ShardedCheckpoint(
        directory, max_to_keep=2, restore=restore, async_save=async_save
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[callback, Epochs()],
    )
    return seen, sorted(os.listdir(directory)), checkpoint_values(model)


def saves_in_one_folder(folder):
    """Two saves and an async save into `folder`, then `tidy`: (its storage
    groups, how often it was probed, what is left in it)."""
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution.checkpoint import _storage
    from keras_torch_distribution.checkpoint import callbacks

    distribute(SAVE_RULES)
    model = checkpoint_model()
    probed = []
    real = _storage._probe_storage

    def counted(*args):
        probed.append(args[0])
        return real(*args)

    _storage._probe_storage = counted
    try:
        checkpoint.save(model, os.path.join(folder, "a"))
        checkpoint.save(model, os.path.join(folder, "b"))
        checkpoint.async_save(model, os.path.join(folder, "c")).result()
        callbacks.tidy(folder)
        groups = _storage.storage_groups(folder)
    finally:
        _storage._probe_storage = real
    return groups, probed, sorted(os.listdir(folder))


def mismatch_errors(path):
    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    errors = {}
    for name, kwargs in {
        "shape": dict(width=8),
        "names": dict(last="out"),
    }.items():
        try:
            checkpoint.load(checkpoint_model(**kwargs), path)
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
    assert_same_values(results[1][0], saved)
    assert placements["net/col/kernel"] == "(Shard(dim=1),)"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left
    assert (
        "optimizer/iteration"
        in json.loads((tmp_path / "ckpt" / checkpoint.MARKER).read_text())[
            "variables"
        ]
    )

    # Each rank wrote its own shards; replicated variables once.
    files = shard_files(path)
    assert files["model/col/kernel"] == ["__0_0.distcp", "__1_0.distcp"]
    assert files["optimizer/col/kernel/momentum"] == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert len(files["model/row/bias"]) == 1
    assert len(files["optimizer/iteration"]) == 1

    # One process, no distribution: full values.
    import keras

    keras.distribution.set_distribution(None)
    model = checkpoint_model()
    assert checkpoint.load(model, path) == {"epoch": 2, "step": 8}
    assert_same_values(checkpoint_values(model), saved)
    assert int(np.asarray(model.optimizer.iterations)) == 8

    # 2 processes, another LayoutMap; training on matches the saving run.
    for extra, loaded, placed, continued in pool2.run(
        load_and_continue, path, OTHER_RULES
    ):
        assert extra == {"epoch": 2, "step": 8}
        assert placed["net/col/kernel"] == "(Shard(dim=0),)"
        assert placed["net/row/bias"] == "(Shard(dim=0),)"
        assert_same_values(loaded, saved)
        for key in after:
            np.testing.assert_allclose(
                continued[key], after[key], rtol=1e-6, atol=1e-7
            )

    # 4 processes on a 2x2 mesh sharding the kernel on both axes.
    rules = {
        r".*col/kernel": ("batch", "model"),
        r".*row/kernel": ("model", None),
    }
    for _, loaded, placed, _ in pool4.run(
        load_and_continue, path, rules, (2, 2), ("batch", "model")
    ):
        assert placed["net/col/kernel"] == "(Shard(dim=0), Shard(dim=1))"
        assert_same_values(loaded, saved)


def test_resumed_training_is_exact_on_the_same_layout(pool2, tmp_path):
    path = str(tmp_path / "ckpt")
    _, after, _ = pool2.run(train_and_save, path)[0]
    for _, _, _, continued in pool2.run(load_and_continue, path, SAVE_RULES):
        assert_same_values(continued, after)


def test_one_process_checkpoint_loads_sharded_on_2(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    model = checkpoint_model()
    x, y = checkpoint_data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    checkpoint.save(model, tmp_path / "one", extra=[1, "a"])
    for extra, loaded, placed, _ in pool2.run(
        load_and_continue, str(tmp_path / "one"), SAVE_RULES, (2,)
    ):
        assert extra == [1, "a"]
        assert placed["net/col/kernel"] == "(Shard(dim=1),)"
        assert_same_values(loaded, checkpoint_values(model))


def test_one_shared_folder_is_probed_once_and_left_clean(pool2, tmp_path):
    folder = str(tmp_path / "run")
    for groups, probed, left in pool2.run(saves_in_one_folder, folder):
        assert groups == [[0, 1]]
        assert probed == [folder]  # the first save; the rest reuse it
        assert left == ["a", "b", "c"]  # no probe file, nothing incomplete


def test_async_save_keeps_the_values_of_its_call(pool2, tmp_path):
    path = str(tmp_path / "async")
    for before, loaded, extra, complete_early in pool2.run(
        async_then_change, path
    ):
        assert extra == {"epoch": 1}
        assert_same_values(loaded, before)
        assert complete_early is False  # only result() completes it
    assert sorted(os.listdir(tmp_path)) == ["async"]


def test_callback_saves_every_epoch_keeps_two_and_restores(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    directory = str(tmp_path / "run")
    seen, names, values = pool2.run(callback_fit, directory, 3, False)[0]
    assert seen == [0, 1, 2]
    assert names == ["ckpt-000000008", "ckpt-000000012"]
    extra = checkpoint.read_extra(checkpoint.latest(directory))
    resume = extra.pop("resume")
    assert extra == {"epoch": 3, "batch": 0, "step": 12}
    # Where fit was in its data (test_preemption.py resumes from it).
    assert (resume["epoch"], resume["batch"]) == (3, 0)
    assert sorted(resume) == [
        "adapter_epoch",
        "adapter_epoch_at_source_start",
        "batch",
        "epoch",
        "rng",
        "rng_at_source_start",
        "source_batches",
    ]
    model = checkpoint_model()
    checkpoint.load(model, checkpoint.latest(directory))
    assert_same_values(checkpoint_values(model), values)
    # A second fit with restore=True starts after epoch 3.
    seen, names, _ = pool2.run(callback_fit, directory, 5, True)[1]
    assert seen == [3, 4]
    assert names == ["ckpt-000000016", "ckpt-000000020"]
    # Saving in the background: fit completes the last one before returning.
    directory = str(tmp_path / "background")
    _, names, values = pool2.run(callback_fit, directory, 3, False, True)[0]
    assert names == ["ckpt-000000008", "ckpt-000000012"]
    model = checkpoint_model()
    checkpoint.load(model, checkpoint.latest(directory))
    assert_same_values(checkpoint_values(model), values)


def test_mismatches_list_missing_unexpected_and_shapes(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    path = str(tmp_path / "ckpt")
    pool2.run(train_and_save, path)
    errors = pool2.run(mismatch_errors, path)[0]
    assert "shape mismatches" in errors["shape"]
    assert "model/col/kernel: (6, 16) vs (6, 8)" in errors["shape"]
    assert (
        "missing from the checkpoint (6): ['model/out/bias'" in errors["names"]
    )
    assert (
        "in the checkpoint but not in the model (6): ['model/row/bias'"
        in errors["names"]
    )
    assert "optimizer=False" in errors["names"]
    # Without the optimizer, a model compiled with another one loads.
    import keras

    model = checkpoint_model()
    model.compile(keras.optimizers.SGD(), "mse")
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match="optimizer/col/kernel/momentum",
    ):
        checkpoint.load(model, path)
    checkpoint.load(model, path, optimizer=False)


# ---------------------------------------------------------------------------
# BackupAndRestore
# ---------------------------------------------------------------------------


def backup_twice(backup_dir):
    import keras

    from keras_torch_distribution import checkpoint

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    callback = keras.callbacks.BackupAndRestore(
        backup_dir, double_checkpoint=True, delete_checkpoint=False
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
    return sorted(os.listdir(backup_dir)), [
        checkpoint.read_extra(os.path.join(backup_dir, name))
        for name in ("latest.ckpt", "previous.ckpt")
    ]


def test_backup_and_restore_keeps_two_sharded_backups(pool2, tmp_path):
    for names, extras in pool2.run(backup_twice, str(tmp_path / "backup")):
        assert names == ["latest.ckpt", "previous.ckpt"]
        positions = [extra.pop("resume") for extra in extras]
        assert extras == [{"epoch": 3, "batch": 0}, {"epoch": 2, "batch": 0}]
        assert [(p["epoch"], p["batch"]) for p in positions] == [(3, 0), (2, 0)]


def async_saves_with_pinned_staging(first, second):
    """Two async saves staged into reused "pinned" memory (there is no CUDA
    here to pin with: pinning is recorded, not done), the weights changed
    between them. Returns what each checkpoint holds, the values of each
    call, whether the first save was complete when the second returned,
    how many staging tensors were pinned, and whether the second save
    staged into the same memory."""
    import keras
    import torch

    from keras_torch_distribution import checkpoint
    from keras_torch_distribution.checkpoint import _staging

    pinned = []
    saved_pin, saved_available = (
        torch.Tensor.pin_memory,
        _staging.pinned_staging_available,
    )

    def pin(tensor, *args, **kwargs):
        pinned.append(tensor.numel())
        return tensor

    torch.Tensor.pin_memory = pin
    _staging.pinned_staging_available = lambda: _staging._CACHED_STAGING
    try:
        distribute(SAVE_RULES)
        model = checkpoint_model()
        x, y = checkpoint_data()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        before = checkpoint_values(model)
        pending = checkpoint.async_save(model, first)
        cache = _staging.staging_memory.stager.state_dict_cache
        pointers = {
            k: v.to_local().data_ptr()
            if hasattr(v, "to_local")
            else v.data_ptr()
            for k, v in cache.items()
            if v.dim()
        }
        pinned_once = len(pinned)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        after = checkpoint_values(model)
        second_pending = checkpoint.async_save(model, second)
        first_complete = checkpoint.is_checkpoint(first) and pending.done()
        cache = _staging.staging_memory.stager.state_dict_cache
        reused = pointers == {
            k: v.to_local().data_ptr()
            if hasattr(v, "to_local")
            else v.data_ptr()
            for k, v in cache.items()
            if v.dim()
        }
        second_pending.result()
        pending.result()
        loaded = []
        for path in (first, second):
            keras.backend.clear_session()
            distribute(OTHER_RULES)
            fresh = checkpoint_model()
            checkpoint.load(fresh, path)
            loaded.append(checkpoint_values(fresh))
        return {
            "before": before,
            "after": after,
            "loaded": loaded,
            "first_complete": first_complete,
            "pinned_once": pinned_once,
            "pinned": len(pinned),
            "reused": reused,
        }
    finally:
        torch.Tensor.pin_memory = saved_pin
        _staging.pinned_staging_available = saved_available
        _staging.staging_memory.clear()


def test_async_saves_stage_into_reused_pinned_memory(pool2, tmp_path):
    """On CUDA, async saves stage into one pinned copy made by the first
    save (torch's cache_staged_state_dict): the second save pins nothing
    new and copies into the same memory, after the first save completed
    (it was still reading that memory); each checkpoint holds its call's
    values."""
    from keras_torch_distribution.checkpoint import _staging

    if not _staging._CACHED_STAGING:
        pytest.skip("this torch has no async_stager / cache_staged_state_dict")
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    for result in pool2.run(async_saves_with_pinned_staging, first, second):
        assert result["pinned_once"] > 0
        assert result["pinned"] == result["pinned_once"]
        assert result["reused"] is True
        assert result["first_complete"] is True
        assert_same_values(result["loaded"][0], result["before"])
        assert_same_values(result["loaded"][1], result["after"])
    assert sorted(os.listdir(tmp_path)) == ["first", "second"]

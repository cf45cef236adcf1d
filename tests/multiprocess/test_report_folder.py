"""`ktd report` on the folder given to `ShardedCheckpoint` (2 gloo
processes): it reports the newest checkpoint, with its epoch and step,
each variable's blocks with equal ranks grouped, readable sizes counted
by hand from the files, and names and layouts never cut."""

import os
import re

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

LONG = "a_dense_layer_whose_name_is_longer_than_any_column_was"


def _fit_with_checkpoints(folder):
    import keras

    from keras_torch_distribution import checkpoint

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(20, name=LONG)]
        )
        model.compile("sgd", "mse")
        model.fit(
            np.ones((8, 12), "float32"),
            np.ones((8, 20), "float32"),
            batch_size=4,
            epochs=2,
            callbacks=[checkpoint.ShardedCheckpoint(folder)],
            verbose=0,
        )
    finally:
        keras.distribution.set_distribution(None)


def test_report_of_a_sharded_checkpoint_folder(pool2, tmp_path):
    from keras_torch_distribution._log import human_bytes
    from keras_torch_distribution.checkpoint import read_marker
    from keras_torch_distribution.checkpoint.inspect import checkpoint_table
    from keras_torch_distribution.checkpoint.inspect import (
        format_checkpoint_table,
    )

    folder = str(tmp_path / "ckpts")
    pool2.run(_fit_with_checkpoints, folder)
    names = sorted(os.listdir(folder))
    assert len(names) == 2  # one per epoch, 2 steps each
    newest = os.path.join(folder, names[-1])
    text = format_checkpoint_table(checkpoint_table(folder))
    lines = text.splitlines()
    assert lines[0] == f"checkpoint {newest} (the newest of 2 in {folder})"
    files = read_marker(newest)["files"]
    by_rank = {}
    for name, entry in files.items():
        by_rank[entry["rank"]] = by_rank.get(entry["rank"], 0) + entry["bytes"]
    total = human_bytes(sum(by_rank.values()))
    assert (
        lines[1]
        == f"epoch 2, step 4, batch 0, written by 2 process(es), {total}"
    )
    kernel = next(
        line for line in lines if line.startswith(f"model/{LONG}/kernel")
    )
    assert kernel.endswith("ranks 0-1: (12, 10) each, split on dim 1")
    bias = next(line for line in lines if line.startswith(f"model/{LONG}/bias"))
    # written once, by the rank DCP picks
    assert re.search(r"  rank [01]: whole  WHOLE$", bias), bias
    written = [line for line in lines if line.startswith("bytes written: ")]
    expected = "; ".join(
        f"rank {r}: {human_bytes(n)}" for r, n in sorted(by_rank.items())
    )
    assert written == [f"bytes written: {expected}"]

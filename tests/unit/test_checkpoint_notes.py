"""At the default log level, one line per checkpoint saved or restored:
its path, its size (every file the marker records, counted by hand on
disk) and the seconds it took. The shard report's text: ranks grouped,
readable sizes, nothing cut."""

import logging
import os
import re

import keras
import numpy as np

from keras_torch_distribution import _log
from keras_torch_distribution import checkpoint

MARKER = "keras_checkpoint.json"


def _notes(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == _log.NOTE]


def test_one_line_per_save_and_restore(tmp_path, caplog):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.compile("adam", "mse")
    model.fit(np.ones((4, 3)), np.ones((4, 4)), verbose=0)
    assert _log.logger.isEnabledFor(_log.NOTE)  # the default level shows it
    with caplog.at_level(logging.WARNING, logger=_log.logger.name):
        path = checkpoint.save(model, tmp_path / "one")
        checkpoint.load(model, path)
    on_disk = sum(
        os.path.getsize(os.path.join(path, name))
        for name in os.listdir(path)
        if name != MARKER
    )
    size = re.escape(_log.human_bytes(on_disk))
    saved, restored = _notes(caplog)
    assert re.fullmatch(
        rf"checkpoint saved: {re.escape(path)} \({size}, \d+\.\d\d s\)", saved
    ), saved
    assert re.fullmatch(
        rf"checkpoint restored: {re.escape(path)} \(8 variables, {size}, "
        r"\d+\.\d\d s\)",
        restored,
    ), restored


def test_human_bytes():
    assert _log.human_bytes(512) == "512 B"
    assert _log.human_bytes(14672) == "14.33 KiB"
    assert _log.human_bytes(577 * 2**20) == "577.00 MiB"


def test_the_shard_report_groups_equal_ranks_and_cuts_nothing():
    """`format_report` at world 64: one column for the 63 ranks whose
    shards are equal, one for the rank whose shard differs; a long path
    and layout whole; bytes readable, grouped."""
    from keras_torch_distribution._report import format_report

    path = "decoder_block_11/self_attention/query_projection/kernel"
    layout = "(('batch', 'data'), 'model', None)"

    def rows(rank):
        local = (2, 8, 8) if rank == 5 else (1, 8, 8)
        return [
            {
                "path": path,
                "shape": (64, 8, 8),
                "layout": layout,
                "local_shape": local,
                "bytes": 4 * 64 * (2 if rank == 5 else 1),
                "kind": "param",
            }
        ]

    text = format_report([rows(r) for r in range(64)])
    header, rule, line, params = text.splitlines()
    assert "ranks 0-4,6-63 shape" in header and "rank 5 shape" in header
    assert line.startswith(path) and layout in line
    assert line.split()[-6:] == ["(1,", "8,", "8)", "(2,", "8,", "8)"]
    assert len(header) < 200
    assert params == "param bytes: ranks 0-4,6-63: 256 B each; rank 5: 512 B"


def test_ktd_report_advises_what_fit_advises_on_the_mesh_saved_with_it():
    """A variable left whole gets one advice, the same from fit, `ktd plan`
    and `ktd report` (issue 48): the checkpoint keeps the mesh it was
    written under, so the report names that mesh's axes ('model' on a
    ('data', 'model') mesh), not a guessed 'batch'."""
    from keras_torch_distribution._variables import left_whole
    from keras_torch_distribution.checkpoint import _dcp
    from keras_torch_distribution.checkpoint import inspect

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 1), ["data", "model"], devices)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="data"
        )
    )
    try:
        marker = _dcp._marker({}, False, None)
    finally:
        keras.distribution.set_distribution(None)
    assert marker["mesh"] == {
        "shape": [1, 1],
        "axis_names": ["data", "model"],
        "batch_axis": "data",
    }
    # The same, written by 2 processes on a (1, 2) mesh.
    marker = dict(marker, num_processes=2)
    marker["mesh"] = dict(marker["mesh"], shape=[1, 2])
    rows = [
        {
            "key": "model/dense/kernel",
            "shape": (8, 64),
            "dtype": "float32",
            "blocks": [{"shape": (8, 64)}],
        },
        {
            "key": "model/dense/bias",
            "shape": (64,),
            "dtype": "float32",
            "blocks": [{"shape": (32,)}, {"shape": (32,)}],
        },
    ]
    inspect._mark_whole(rows, marker)
    axes = left_whole.suggested_axes((8, 64), {"data": 1, "model": 2}, "data")
    assert axes == (None, "model")
    assert rows[0]["whole"]["axes"] == axes
    assert left_whole.advice(rows[0]["whole"]["key"], axes) == (
        "layout_map['dense/kernel'] = (None, 'model')"
    )

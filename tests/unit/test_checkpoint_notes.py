"""At the default log level, one line per checkpoint saved or restored:
its path, its size (every file the marker records, counted by hand on
disk) and the seconds it took."""

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

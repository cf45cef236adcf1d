"""BackupAndRestore's routine backups are not said at the default level
(issue 48, item 9): Keras' own BackupAndRestore says nothing, and a NOTE
line per epoch was noise that landed inside the progress bar's line. An
explicit `checkpoint.save` still says its one line."""

import logging

import keras
import numpy as np


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


def _fit_with_backups(folder):
    from keras_torch_distribution import checkpoint

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    records = _Records()
    logger = logging.getLogger("keras_torch_distribution")
    logger.addHandler(records)
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        x = np.ones((16, 4), "float32")
        backup = keras.callbacks.BackupAndRestore(f"{folder}/backup")
        model.fit(
            x, x[:, :2], batch_size=8, epochs=3, callbacks=[backup], verbose=0
        )
        during_fit = list(records.messages)
        checkpoint.save(model, f"{folder}/explicit")
    finally:
        logger.removeHandler(records)
        keras.distribution.set_distribution(None)
    return during_fit, records.messages[len(during_fit) :]


def test_routine_backups_are_quiet_an_explicit_save_is_said(pool2, tmp_path):
    (during_fit, after), _ = pool2.run(_fit_with_backups, str(tmp_path))
    assert not [m for m in during_fit if "checkpoint saved" in m], during_fit
    assert len(after) == 1 and after[0].startswith("checkpoint saved: "), after

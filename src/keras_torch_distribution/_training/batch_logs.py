"""A batch's logs read on the host only when something shows or uses them.

After every batch, Keras' `CallbackList` turns the step's logs (the loss
and metrics: tensors on the device) into Python floats before any
callback runs, whether one reads them or not: on a GPU, a host sync per
step, with only a progress bar to feed, or none at all (`verbose=0`, or
every rank but 0 under the package). Each sync makes the host wait for
the step's last kernel before it can queue the next step's first.

Here, when no callback but Keras' progress bar reads a batch's logs --
the others being Keras' `History` and callbacks that say they do not
(`reads_batch_logs = False`, as the package's own do) -- the logs are
turned into floats only when the progress bar is about to redraw (at
most once per its `interval`, 0.05 s), and otherwise not at all: the bar
shows the same values it would have shown. A callback of any other kind
with its own `on_train_batch_end`, `on_batch_end` or `on_test_batch_end`
gets Keras' behaviour: floats after every batch.
"""

from keras_torch_distribution import _keras


def train_batch_end(original, callbacks, batch, logs=None):
    """Replaces Keras `CallbackList._on_train_batch_end`: the logs are read
    on the host only where needed (see the module docstring)."""
    _batch_end(original, callbacks, batch, logs, "on_train_batch_end")


def test_batch_end(original, callbacks, batch, logs=None):
    """Replaces Keras `CallbackList._on_test_batch_end`, as
    `train_batch_end`."""
    _batch_end(original, callbacks, batch, logs, "on_test_batch_end")


def _batch_end(original, callbacks, batch, logs, hook):
    members = list(callbacks.callbacks)
    if any(_reads_logs(member, hook) for member in members):
        original(callbacks, batch, logs)
        return
    converted = None
    for member in members:
        if not isinstance(member, _keras.ProgbarLogger):
            getattr(member, hook)(batch, logs={})
            continue
        if _keras.progbar_redraws(member):
            if converted is None:
                converted = _keras.pythonify_logs(logs)
            getattr(member, hook)(batch, logs=converted)
        else:
            # Moves the bar's count and clock on, keeping the values it has.
            getattr(member, hook)(batch, logs={})


def _reads_logs(callback, hook):
    """True when `callback` may read a batch's logs at `hook`: anything but
    Keras' progress bar and History and callbacks that say they do not."""
    if isinstance(callback, (_keras.ProgbarLogger, _keras.History)):
        return False
    if getattr(callback, "reads_batch_logs", True) is False:
        return False
    overridden = [hook]
    if hook == "on_train_batch_end":
        overridden.append("on_batch_end")  # Keras' default calls it
    return any(
        not _keras.is_default_callback_method(getattr(callback, name))
        for name in overridden
    )

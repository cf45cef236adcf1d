"""The script stopped at its first fit / evaluate / predict / save.

`stopping(step)` replaces Keras' `Model.fit`, `evaluate`, `predict`,
`save` and `save_weights` for the block: the first call records the model
and raises `Stopped` (a BaseException, so that a script's own `except
Exception` does not swallow it). At a fit where `step(model)` allows it,
the fit runs Keras' own loop up to its first training step (this
package's batch adapter gives rank 0 its rows); that step runs twice on
its batch, the first to build the optimizer and record FSDP's group order,
the second with its collectives counted (`collective_counts.tally`), as
the multi-process tests count a real step. Then the plan stops.
"""

import contextlib

from keras_torch_distribution import _keras
from keras_torch_distribution.distributed import collective_counts
from keras_torch_distribution.plan import shards

STOPPED_AT = ("fit", "evaluate", "predict", "save", "save_weights")


class Stopped(BaseException):
    """The plan has what it needs; the script goes no further."""


class Record:
    """What the stop saw: the model, where, and the counted step."""

    def __init__(self):
        self.model = None
        self.stopped_at = None
        self.tally = None  # collective_counts.Tally of one step, or None
        self.no_step = None  # why no step was simulated
        # after the step: id(variable) -> its gradient's layout
        self.gradient_layouts = None


@contextlib.contextmanager
def stopping(step):
    """Within the block, the first fit / evaluate / predict / save stops
    the script; `step(model)` -> (bool, reason) says whether a fit
    simulates one training step first. Yields the `Record`."""
    record = Record()
    owner = _keras.Model
    saved = {name: owner.__dict__.get(name) for name in STOPPED_AT}
    current = {name: getattr(owner, name) for name in STOPPED_AT}

    def stop_at(name):
        def stopped(model, *args, **kwargs):
            record.model, record.stopped_at = model, name
            if name == "fit":
                allowed, reason = step(model)
                if allowed:
                    try:
                        _one_step(record, model, current[name], args, kwargs)
                        reason = "fit returned before its first step"
                    except Exception as error:  # reported, not hidden
                        reason = (
                            "the simulated step failed: "
                            f"{type(error).__name__}: {error}"
                        )
                record.no_step = reason
            if record.tally is None:
                build_optimizer(model)
            raise Stopped(name)

        stopped.__name__ = name
        return stopped

    for name in STOPPED_AT:
        setattr(owner, name, stop_at(name))
    try:
        yield record
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _one_step(record, model, fit, args, kwargs):
    """Run `fit` to its first step; run that step twice, counting the
    second; raise Stopped."""
    make = model.make_train_function

    def make_counted(force=False):
        result = make(force)
        original = model.train_function

        def counted(data):
            original(data)
            with collective_counts.tally() as tally:
                original(data)
            record.tally = tally
            record.gradient_layouts = shards.gradient_layouts(model)
            raise Stopped("fit")

        model.train_function = counted
        return result

    model.make_train_function = make_counted
    try:
        fit(model, *args, **kwargs)
    finally:
        del model.make_train_function


def build_optimizer(model):
    """Build a compiled model's optimizer, as its first step would, in the
    script's own context (a distribution scope it fits in): its variables
    are born sharded like the model's (unwritten while planning)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", False):
        return
    if model.trainable_variables:
        optimizer.build(model.trainable_variables)

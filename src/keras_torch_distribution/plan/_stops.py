"""The script stopped at its first fit / evaluate / predict / save.

`stopping(step)` replaces Keras' `Model.fit`, `evaluate`, `predict`,
`save` and `save_weights` for the block: the first call records the model
and raises `Stopped` (a BaseException, so that a script's own `except
Exception` does not swallow it). At a fit where `step(model)` allows it,
the fit runs Keras' own loop up to its first training step (this
package's batch adapter gives rank 0 its rows); that step runs twice on
its batch, the first to build the optimizer and record FSDP's group order,
the second with its collectives counted (`_collective_counts.tally`), as
the multi-process tests count a real step, and its FSDP gathers measured
(`_gathered`). The step runs on the variables' own (unwritten) tensors, or
on fake ones (`_fake_step`: nothing allocated, for models of any size).
Then the plan stops.
"""

import contextlib

from keras_torch_distribution import _keras
from keras_torch_distribution.plan import _collective_counts
from keras_torch_distribution.plan import _fake_step
from keras_torch_distribution.plan import _gathered
from keras_torch_distribution.plan import _peers
from keras_torch_distribution.plan import _shards

STOPPED_AT = ("fit", "evaluate", "predict", "save", "save_weights")


class Stopped(BaseException):
    """The plan has what it needs; the script goes no further."""


class Record:
    """What the stop saw: the model, where, and the counted step."""

    def __init__(self):
        self.model = None
        self.stopped_at = None
        self.tally = None  # _collective_counts.Tally of one step, or None
        self.no_step = None  # why no step was simulated
        self.step_kind = None  # "real" or "fake" (see fake_step)
        self.gathered = None  # _gathered.Gathered of the counted step
        # after the step: id(variable) -> its gradient's layout
        self.gradient_layouts = None


@contextlib.contextmanager
def stopping(step):
    """Within the block, the first fit / evaluate / predict / save stops
    the script; `step(model)` -> (kind, reason) says whether a fit
    simulates one training step first: "real" (on the variables' own
    tensors), "fake" (on fake tensors, `_fake_step`) or None (`reason`
    says why not). Yields the `Record`."""
    record = Record()
    owner = _keras.Model
    saved = {name: owner.__dict__.get(name) for name in STOPPED_AT}
    current = {name: getattr(owner, name) for name in STOPPED_AT}

    def stop_at(name):
        def stopped(model, *args, **kwargs):
            record.model, record.stopped_at = model, name
            if name == "fit":
                kind, reason = step(model)
                if kind is not None:
                    with _peers.allowing():  # the step's values: meaningless
                        reason = _step_or_reason(
                            record, model, current[name], args, kwargs, kind
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


def _step_or_reason(record, model, fit, args, kwargs, kind):
    """Run the counted step (it ends in Stopped), or say why it did not."""
    record.step_kind = kind
    try:
        with _fake_step.faked(model) if kind == "fake" else _real() as in_step:
            _counted_fit(record, model, fit, args, kwargs, in_step)
    except Exception as error:  # reported in the plan, not hidden
        record.step_kind = None
        needed = _fake_step.value_needed(error) if kind == "fake" else None
        if needed is not None:
            return (
                "the step on fake tensors needs a value that fake tensors "
                f"do not have ({needed}): a Python branch on a tensor's "
                "value (.item(), bool(tensor)) or an output shape that "
                "depends on values. --step real runs the step on rank 0's "
                "own tensors, if its state fits in this machine's memory."
            )
        return f"the simulated step failed: {type(error).__name__}: {error}"
    record.step_kind = None
    return "fit returned before its first step"


@contextlib.contextmanager
def _real():
    yield lambda function: function


def _counted_fit(record, model, fit, args, kwargs, in_step):
    """Run `fit` to its first step; run that step twice (each through
    `in_step`), counting the second's collectives and measuring its FSDP
    gathers; raise Stopped."""
    make = model.make_train_function
    group_names = _gathered.batch_group_names(_shards.unique(model.variables))

    def make_counted(force=False):
        result = make(force)
        original = in_step(model.train_function)

        def counted(data):
            original(data)
            with (
                _collective_counts.tally() as tally,
                _gathered.tracking(group_names) as held,
            ):
                original(data)
            record.tally = tally
            record.gathered = held
            record.gradient_layouts = _shards.gradient_layouts(model)
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

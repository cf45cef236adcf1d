"""A training step on fake tensors: collectives counted, nothing allocated.

`faked(model)` makes the model's variables (and its optimizer's, once
built) hold fake tensors of torch's `FakeTensorMode`
(`torch._subclasses.fake_tensor`): same shapes, dtypes, DTensor meshes and
placements, no storage. Within the block every op runs on fake tensors
(the batch's real tensors become fake on first use): the step's Python
runs as on a real rank, DTensor propagates its shardings and issues its
redistributions, this package's FSDP forms its groups, and every
collective is dispatched (to torch's fake process group) with its real
shapes, so that `_collective_counts.tally` counts what a real step issues.
Nothing is computed: a step of an 8 B model costs its Python, not its
FLOPs or its bytes.

What needs values cannot run: a Python branch on a tensor's value
(`.item()`, `bool(tensor)`) or an op whose output shape depends on values
(`nonzero`, boolean masks) raises; the plan reports it (`value_needed`)
as a step it could not simulate.

What the block changes, and puts back on the way out:

- FSDP's regatherer (`_fsdp.gathering._Regatherer`) finds a saved view of a
  gathered weight by its storage's data pointer
  (`gathering.storage_key`), which is 0 for every fake tensor; within the
  block that key is the storage's identity instead (`_storage_key`, what
  the data pointer stands for on real tensors;
  tests/multiprocess/test_plan.py checks that both give a real run's
  collectives and gathers).
- Keras' `fit` runs the model once on the batch's shapes before its first
  step (its symbolic build; eagerly when tracing on the meta device fails);
  calls of the model go through the fake mode too (`_model_calls`, on the
  model's class), or that run would compute on real tensors.
- DTensor computes the shard sizes of a `_StridedShard` with small index
  tensors (`arange(n)`, `.tolist()`); that arithmetic runs on real tensors
  (`_index_math_on_real_tensors`), as on a real rank.
"""

import contextlib

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from keras_torch_distribution import _keras
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution.plan import _shards

# What a step on fake tensors cannot do (it needs the values).
_VALUE_NEEDED = (DataDependentOutputException, DynamicOutputShapeException)


def value_needed(error):
    """The op that needed a value, if `error` (or an error it was raised
    from: Keras wraps its build's errors) is a fake tensor's want of one;
    else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, _VALUE_NEEDED):
            return str(error.func)
        error = error.__cause__ or error.__context__
    return None


def _storage_key(local):
    """The identity of a tensor's storage, fake or real (a fake tensor's
    data pointer is 0): `gathering.storage_key` within `faked`."""
    return local.untyped_storage()._cdata


def _make_fake(mode, model):
    """Every variable of `model` and of its optimizer (built by Keras'
    symbolic build in fit, before the first step) as a fake tensor."""
    for variable in _shards.unique(
        model.variables
    ) + _shards.optimizer_variables(model):
        value = _keras.raw_value(variable)
        if value is not None and not _is_fake(value):
            _keras.set_raw_value(variable, _to_fake(mode, value))


def _is_fake(value):
    local = value._local_tensor if isinstance(value, DTensor) else value
    return isinstance(local, FakeTensor)


def _to_fake(mode, value):
    fake = mode.from_tensor(value)
    if isinstance(value, torch.nn.Parameter):
        fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
    return fake


@contextlib.contextmanager
def faked(model):
    """Within the block, `model`'s variables (and its optimizer's) hold fake
    tensors (they keep them after it: the plan reads only their sizes), and
    every call of the model, and of `step` (the wrapped train function),
    runs in one FakeTensorMode. Yields `step`, a decorator."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def in_mode(function):
        def run(*args, **kwargs):
            if _active(mode):
                return function(*args, **kwargs)
            _make_fake(mode, model)
            with mode:
                return function(*args, **kwargs)

        return run

    saved = gathering.storage_key
    gathering.storage_key = _storage_key
    try:
        with _index_math_on_real_tensors(), _model_calls(model, in_mode):
            yield in_mode
    finally:
        gathering.storage_key = saved


@contextlib.contextmanager
def _model_calls(model, in_mode):
    """Within the block, calls of `model` (Keras' symbolic build in fit
    runs the model eagerly on real tensors when tracing on the meta device
    fails) run through `in_mode`."""
    owner = type(model)
    own = owner.__dict__.get("__call__")
    call = owner.__call__

    def called(self, *args, **kwargs):
        if self is model:
            return in_mode(call)(self, *args, **kwargs)
        return call(self, *args, **kwargs)

    owner.__call__ = called
    try:
        yield
    finally:
        if own is None:
            del owner.__call__
        else:
            owner.__call__ = own


def _active(mode):
    """True while `mode` (a FakeTensorMode: torch keeps it in its slot for
    fake modes, not on the stack of user modes) is in force."""
    fake = torch._C._TorchDispatchModeKey.FAKE
    return torch._C._get_dispatch_mode(fake) is mode


# Functions of torch that compute ints (shard sizes and offsets) with small
# index tensors (`torch.arange(n)` split and `.tolist()`-ed): run on real
# tensors, as on a real rank, not on fake ones whose values do not exist.
_INDEX_MATH = ((_StridedShard, "local_shard_size_and_offset"),)


@contextlib.contextmanager
def _index_math_on_real_tensors():
    saved = [(owner, name, owner.__dict__[name]) for owner, name in _INDEX_MATH]
    for owner, name, function in saved:
        setattr(owner, name, _unfaked(function))
    try:
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)


def _unfaked(function):
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return run

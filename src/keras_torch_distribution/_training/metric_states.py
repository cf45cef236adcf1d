"""Metric states summed over replicas, in the step's gradient all-reduce
when it has one.

Keras computes every step's logs from its metric states (`get_metrics_result`
at the end of `train_step`); on N replicas they are the states summed over
the replicas (`trainer.metrics_result`), one all-reduce per step. A step
that all-reduces gradients anyway (those of variables the layout map
leaves replicated) carries the states in that collective instead: by then
Keras has updated the loss tracker (before backward). The sum is used
only if no state changed between that collective and `get_metrics_result`
(each state is the same tensor, at the same torch version counter: no
`assign` since, e.g. no compiled metric updated after the optimizer);
otherwise the states are summed again, as without the fold. Keras metrics
assign their states unconditionally (they are traced under jit on JAX),
so every rank takes the same branch.

What is folded: float32 states of aggregation "sum" or "none" (weight 1)
or "only_first_replica" (0 or 1), summed in float32 with the gradients'
bucket, which rounds once per addition as the float64 sum then cast to
float32 does for 2 replicas (for more, the last bit may differ: float
reduction order). A state of another dtype or aggregation turns the fold
off for that model (the separate float64 all-reduce, as before).
"""

import weakref

import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import collectives
from keras_torch_distribution._training import boundary


class FoldState:
    """The models whose metric states may ride in their optimizer's
    gradient all-reduce, and the last sum that did."""

    def __init__(self):
        self.clear()

    def clear(self):
        # optimizer -> the model whose train step applies it (seen at its
        # last get_metrics_result); weak both ways.
        self.models = weakref.WeakKeyDictionary()
        # (group, state tensors, their versions, summed values) of the last
        # fold, or None.
        self.last = None


state = FoldState()


def remember(model):
    """Note `model`'s optimizer, so that its next step may fold its metric
    states into the gradient all-reduce. Not a collective."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        state.models[optimizer] = weakref.ref(model)


def foldable(optimizer, group, gradients):
    """The metric state variables, their tensors and weighted copies to sum with
    `optimizer`'s `gradients` (local tensors), or None when the fold does
    not apply (no float32 gradient on the states' device to ride with, ...).
    Ranks running the same model agree. Not a collective."""
    ref = state.models.get(optimizer)
    model = ref() if ref is not None else None
    if model is None:
        return None
    variables = [v for m in model.metrics for v in m.variables]
    if not variables:
        return None
    tensors, weighted = [], []
    for variable in variables:
        value = _keras.raw_value(variable)
        if (
            not isinstance(value, torch.Tensor)
            or isinstance(value, DTensor)
            or value.dtype != torch.float32
        ):
            return None
        weight = _weight(variable, group)
        if weight not in (0.0, 1.0):
            return None
        tensors.append(value)
        weighted.append(value.detach() * weight)
    device = tensors[0].device
    if not any(
        g.dtype == torch.float32 and g.device == device for g in gradients
    ):
        return None
    return variables, tensors, weighted


def record(folded, group):
    """Keep the sum that `folded` (from `foldable`: the state variables,
    their tensors, their weighted copies now summed) gave. Not a
    collective."""
    variables, tensors, weighted = folded
    versions = [_keras.raw_value_version(v) for v in variables]
    state.last = (group, tensors, versions, weighted)


def reduced_states(variables, group):
    """The values of metric state `variables` summed over the replicas:
    the folded sum if no state changed since, else one float64 all-reduce.
    Collective: call on every rank."""
    folded = _folded(variables, group)
    if folded is not None:
        return folded
    state.last = None
    values = [boundary.plain(v.value).detach() for v in variables]
    weighted = [
        v.to(torch.float64) * _weight(s, group)
        for v, s in zip(values, variables)
    ]
    collectives.all_reduce(weighted, group.group, bucket_bytes=None)
    return [w.to(v.dtype) for w, v in zip(weighted, values)]


def _folded(variables, group):
    if state.last is None:
        return None
    last_group, tensors, versions, summed = state.last
    if last_group is not group or len(tensors) != len(variables):
        return None
    for variable, tensor, version in zip(variables, tensors, versions):
        if (
            _keras.raw_value(variable) is not tensor
            or _keras.raw_value_version(variable) != version
        ):
            return None
    return summed


def _weight(variable, group):
    aggregation = variable.aggregation
    if aggregation == "mean":
        return 1.0 / group.count
    if aggregation == "only_first_replica":
        return 1.0 if group.index == 0 else 0.0
    return 1.0  # "sum" (Keras metrics' default) and "none"

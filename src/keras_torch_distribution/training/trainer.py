"""Keras training on N processes: gradient sync, metrics, predictions, logs.

Replaces, through the seam, `Optimizer.apply` (gradients are aligned to
their variables and averaged over data-parallel replicas),
`Model.get_metrics_result` (metric states are summed over replicas before
results are computed, in the step's gradient all-reduce when it has one:
`metric_states`) and fit / evaluate / predict (logs and files from
rank 0); gathers the predictions of every replica, in order, for the
predict step (`replica_start.make_step_function`). The model boundary is
`boundary.py`, jit_compile `compiled.py`.
"""

import weakref

import keras
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution import saving
from keras_torch_distribution.distributed import agreement
from keras_torch_distribution.distributed import collectives
from keras_torch_distribution.distributed import replicas
from keras_torch_distribution.distributed import runtime
from keras_torch_distribution.distributed import stopping
from keras_torch_distribution.distributed import tensors
from keras_torch_distribution.fsdp import gathering
from keras_torch_distribution.training import boundary
from keras_torch_distribution.training import gradients
from keras_torch_distribution.training import metric_states
from keras_torch_distribution.training import overlap
from keras_torch_distribution.variables import born_sharded
from keras_torch_distribution.variables import left_whole


class OptimizerSync:
    """What gradient synchronisation keeps between and within steps."""

    def __init__(self):
        # Nesting of `optimizer_apply`: Keras optimizers that wrap another
        # (LossScaleOptimizer) call apply again, and only the outermost
        # call synchronises.
        self.apply_depth = 0
        # optimizer -> OverlappedReducer; its hooks sit on the parameters.
        self.reducers = weakref.WeakKeyDictionary()

    def clear(self):
        """Forget every reducer and take its gradient hooks off."""
        for reducer in list(self.reducers.values()):
            reducer.remove()
        self.reducers = weakref.WeakKeyDictionary()
        self.apply_depth = 0


optimizer_sync = OptimizerSync()


def optimizer_apply(original, optimizer, grads, trainable_variables=None):
    """Align each gradient to its variable's layout and average gradients
    over data-parallel replicas, then apply. Collective: call on every rank."""
    if optimizer_sync.apply_depth or len(grads) == 0:
        return original(optimizer, grads, trainable_variables)
    if torch.compiler.is_compiling():
        # Inside a torch.compile'd train step: gradient sync (collectives,
        # gradient hooks) and the update run eagerly, between the compiled
        # forward/backward graphs.
        return _eager_apply(original, optimizer, grads, trainable_variables)
    return _apply(original, optimizer, grads, trainable_variables)


def _apply(original, optimizer, grads, trainable_variables):
    variables = trainable_variables
    if variables is None:
        variables = _keras.optimizer_variables(optimizer)
    grads = [
        gradients.align(g, _keras.raw_value(v))
        for g, v in zip(grads, variables)
    ]
    group = replicas.current()
    if group.is_distributed:
        _synchronize(optimizer, grads, variables, group)
    optimizer_sync.apply_depth += 1
    try:
        return original(optimizer, grads, trainable_variables)
    finally:
        optimizer_sync.apply_depth -= 1
        replicas.batch_weight.reset()


_eager_apply = torch._dynamo.disable(
    _apply, reason="keras_torch_distribution: gradient sync runs eagerly"
)


def _synchronize(optimizer, grads, variables_, group):
    steps = optimizer.gradient_accumulation_steps
    reducer = (
        None if steps else _overlapped_reducer(optimizer, variables_, group)
    )
    if reducer is not None and reducer.finish(grads):
        return
    # Gradients of variables sharded on the batch axis (FSDP) arrive
    # reduce-scattered and averaged by their gather's backward.
    replicated = [gathering.gather_plan(v) is None for v in variables_]
    local = [
        tensors.local_part(g)
        for g, keep in zip(grads, replicated)
        if g is not None and keep
    ]
    scale = replicas.batch_scale()
    if steps:
        # Accumulate local gradients; average once per real step, together
        # with what was accumulated.
        if scale != 1.0:
            for t in local:
                t.mul_(scale)
        iteration = _keras.apply_count(optimizer)
        if (iteration + 1) % steps:
            return
        kept = [v for v, keep in zip(variables_, replicated) if keep]
        accumulators = _keras.gradient_accumulators(optimizer, kept)
        local += [tensors.local_part(_keras.raw_value(a)) for a in accumulators]
        scale = 1.0
    # The step's metric states ride along (`metric_states`): no all-reduce
    # of their own at the step's end.
    folded = metric_states.foldable(optimizer, group, local)
    collectives.all_reduce(
        local,
        group.group,
        scale / group.count,
        unscaled=folded[2] if folded else (),
    )
    if folded:
        metric_states.record(folded, group)


def _overlapped_reducer(optimizer, variables, group):
    """The optimizer's overlapped reducer when every trainable variable is a
    plain tensor (data parallelism); None otherwise. Built on the first step
    (whose gradients are then averaged synchronously), reused after."""
    params = [_keras.raw_value(v) for v in variables]
    reducers = optimizer_sync.reducers
    reducer = reducers.get(optimizer)
    if reducer is not None and [id(p) for p in reducer.params] == [
        id(p) for p in params
    ]:
        return reducer
    if reducer is not None:
        reducer.remove()
        del reducers[optimizer]
    if any(isinstance(p, DTensor) or not p.requires_grad for p in params):
        return None
    if born_sharded.has_sharded_variables():
        # Plain variables beside sharded ones (LoRA adapters on sharded
        # kernels) get DTensor gradients, which the synchronous path aligns
        # to their variables before averaging.
        return None
    reducer = overlap.OverlappedReducer(params, group.group, group.count)
    reducers[optimizer] = reducer
    return reducer


def metrics_result(original, model):
    """Metric results computed from states summed over replicas, identical
    on every rank. Collective: call on every rank."""
    group = replicas.current()
    if not group.is_distributed:
        return original(model)
    metrics = list(model.metrics)
    states = [v for m in metrics for v in m.variables]
    reduced = metric_states.reduced_states(states, group)
    metric_states.remember(model)
    results = {}
    start = 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(reduced[start : start + count])
        start += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def gather_predictions(outputs):
    """The outputs of one predict step with the rows of every replica, in
    input order (as one process predicting on the global batch returns
    them). Collective: call on every rank."""
    group = replicas.current()
    if not group.is_distributed:
        return outputs
    return keras.tree.map_structure(lambda t: _gather_rows(t, group), outputs)


def _gather_rows(tensor, group):
    tensor = boundary.plain(tensor).detach().contiguous()
    sizes = [None] * group.count
    dist.all_gather_object(sizes, int(tensor.shape[0]), group=group.group)
    largest = max(sizes)
    padded = torch.zeros(
        (largest,) + tuple(tensor.shape[1:]),
        dtype=tensor.dtype,
        device=tensor.device,
    )
    padded[: tensor.shape[0]] = tensor
    pieces = [torch.empty_like(padded) for _ in range(group.count)]
    dist.all_gather(pieces, padded, group=group.group)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)


def _with_last(callbacks, callback, model):
    """`callbacks` (None, a list, or Keras' CallbackList) with `callback`
    added last; the user's list is not changed. A CallbackList is made
    anew, so that Keras decides again whether it may run batch callbacks
    in a background thread (not with this one, which runs a collective)."""
    if callbacks is None:
        return [callback]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return keras.callbacks.CallbackList(
            list(callbacks.callbacks) + [callback],
            model=model,
            **(callbacks.params or {}),
        )
    return list(callbacks) + [callback]


def quiet_on_other_ranks(original, model, *args, **kwargs):
    """fit / evaluate / predict print progress, and file-writing callbacks
    write, on rank 0 only. Variables created before the distribution was
    set, that it would shard, get one warning each, and so do large
    variables the layout map leaves whole (`variables.left_whole`). Ranks that
    disagree on the call (model, distribution, input sizes) raise, naming
    the difference. Collective: call on every rank."""
    agreement.check(original.__name__, model, args, kwargs)
    distribution = _keras.current_distribution()
    born_sharded.warn_if_created_outside(model.variables, distribution)
    left_whole.warn_if_left_whole(model.variables, distribution)
    if runtime.process_id() != 0:
        kwargs["verbose"] = 0
        kwargs["callbacks"] = saving.callbacks_for_this_rank(
            kwargs.get("callbacks")
        )
    if (
        original.__name__ == "fit"
        and _keras.current_distribution() is not None
        and runtime.is_multi_process()
    ):
        kwargs["callbacks"] = _with_last(
            kwargs.get("callbacks"), stopping.StopTogether(), model
        )
    try:
        return original(model, *args, **kwargs)
    finally:
        replicas.batch_weight.forget()

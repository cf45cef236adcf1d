"""Gradient synchronization across data-parallel replicas.

Each replica's backward leaves gradients of its own rows. Before the
optimizer step, gradients are put in their variable's layout (`align`: a
sharded variable's gradient takes its placements, a plain variable's
gradient is made whole), then combined over the batch process group
(`synchronize`: summed as shares of the global batch's loss, or averaged;
the maximum for variables overwritten with their gradient, `reductions`):
overlapped with backward (`overlap`) when every trainable
variable is a plain tensor, else in flat buckets (`collectives.all_reduce`)
with the step's metric states riding along (`metric_states`). Gradients of
FSDP variables arrive reduce-scattered by their gather's backward.
"""

import weakref

from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import collectives
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._training import float8
from keras_torch_distribution._training import metric_states
from keras_torch_distribution._training import overlap
from keras_torch_distribution._training import reductions
from keras_torch_distribution._variables import born_sharded


def align(grad, value):
    """`grad` in the layout of the variable value `value`.

    Collective when a redistribution is needed: call on every rank.
    """
    if grad is None:
        return None
    if isinstance(value, DTensor):
        if not isinstance(grad, DTensor):
            return DTensor.from_local(
                grad, value.device_mesh, value.placements, run_check=False
            )
        if tuple(grad.placements) != tuple(value.placements):
            return grad.redistribute(value.device_mesh, value.placements)
        return grad
    if isinstance(grad, DTensor):
        return tensors.full_value(grad)
    return grad


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


def synchronize(optimizer, grads, variables, group):
    """Combine the aligned `grads` of `variables` over the replicas of
    `group` as `reductions.reduction` says: the maximum for variables
    overwritten with their gradient, else the sum (of gradients of the
    replicas' shares of the loss) or the mean, overlapped with backward
    when the optimizer's reducer already did it; the step's metric states
    ride along. Collective: call on every rank.

    Under gradient accumulation every micro-step's gradient is averaged
    (as without accumulation), so the accumulators Keras adds it to hold
    one process's sums on every rank: a checkpoint taken mid-accumulation
    stores the state one process would, and resumes to its weights.
    (Accumulating local gradients and averaging once per update, as DDP's
    `no_sync` does, saves the micro-steps' all-reduces but leaves each
    rank its own partial sums.)"""
    reductions.check_shared()
    grads, variables = _max_of_overwritten(grads, variables, group)
    _sum_or_mean(optimizer, grads, variables, group)
    float8.round_after_sum(grads, variables)


def _sum_or_mean(optimizer, grads, variables, group):
    """The sum (or mean) over the replicas of `grads`: overlapped, or in
    flat buckets with the metric states. Collective: call on every rank."""
    reducer = _overlapped_reducer(optimizer, variables, group)
    if reducer is not None and reducer.finish(grads):
        return
    # Gradients of variables sharded on the batch axis (FSDP) arrive
    # reduce-scattered and averaged by their gather's backward.
    replicated = [gathering.gather_plan(v) is None for v in variables]
    local = [
        tensors.local_part(g)
        for g, keep in zip(grads, replicated)
        if g is not None and keep
    ]
    # The step's metric states ride along (`metric_states`): no all-reduce
    # of their own at the step's end.
    folded = metric_states.foldable(optimizer, group, local)
    collectives.all_reduce(
        local,
        group.group,
        replicas.gradient_factor(group.count),
        unscaled=folded[2] if folded else (),
    )
    if folded:
        metric_states.record(folded, group)


def _max_of_overwritten(grads, variables, group):
    """The gradients of variables overwritten with their gradient (float8
    scales and amax histories) made their maximum over the replicas
    (`reductions`); the other gradients and variables returned, for the
    sum. Collective: call on every rank."""
    overwritten = [reductions.reduction(v) == reductions.MAX for v in variables]
    if not any(overwritten):
        return grads, variables
    reductions.max_over_replicas(
        [g for g, o in zip(grads, overwritten) if o],
        [v for v, o in zip(variables, overwritten) if o],
        group,
    )
    return (
        [g for g, o in zip(grads, overwritten) if not o],
        [v for v, o in zip(variables, overwritten) if not o],
    )


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

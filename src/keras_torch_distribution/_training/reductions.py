"""How the replicas' gradients combine, and the loss each replica
backpropagates.

One process backpropagates the mean loss of the global batch. A replica
holds some of its rows, so in a train step of Keras' own `train_step`
each replica scales its rows' mean loss to their share of the global
batch's (rows here / rows of the global batch) before backward
(`scale_loss`, where Keras scales the loss for mixed precision), and the
replicas' gradients are summed (`replicas.gradient_factor` is then 1):
every gradient inside the model, on every replica, is the one one process
computes for these rows. Keras' float8 layers quantize the output gradient
(float8 e5m2) with a scale taken from its past maxima, so a gradient N
times one process's rounds differently; without the share it was (2 times
on 2 replicas). Elsewhere (a `train_step` of one's own, an optimizer whose
`scale_loss` is its own) each replica backpropagates its rows' mean loss
and the gradients are averaged, rows weighted, as before: the same sum up
to rounding.

A variable Keras' optimizers overwrite with its "gradient" (Keras'
`overwrite_with_gradient`: the float8 layers' scales and amax histories,
whose gradient is their new value, the maximum of |x| over the batch
rolled into the history) takes the maximum over the replicas (`MAX`): the
history one process computes over the global batch. Averaged, it was the
mean of the replicas' maxima.

`reduction(variable)` names each variable's combination; the gradient
reductions apply it (`gradients.synchronize`, `overlap`, FSDP's
reduce-scatter through `replicas.gradient_factor`).
"""

import contextlib

import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import collectives
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import gathering

MEAN, SUM, MAX = "mean", "sum", "max"


class ShareState:
    """Whether the train step in progress has scaled its loss yet."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.applied = False
        replicas.batch_weight.loss_share = False


state = ShareState()


def reduction(variable):
    """How the replicas' gradients of `variable` combine this step: `MAX`
    for a variable overwritten with its gradient, `SUM` in a train step
    whose loss each replica scaled to its share of the global batch, else
    `MEAN` (rows weighted)."""
    if _keras.overwritten_with_gradient(variable):
        return MAX
    return SUM if replicas.batch_weight.loss_share else MEAN


def _scales_loss_as_keras_does(optimizer):
    """True when `optimizer.scale_loss` is Keras' own (replaced here), not
    a subclass's: only then is the share certain to be applied."""
    method = type(optimizer).scale_loss
    return (
        method is _keras.BaseOptimizer.scale_loss
        or method is _keras.LossScaleOptimizer.scale_loss
    )


@contextlib.contextmanager
def sharing_the_loss(model):
    """Within the block (one train step of Keras' own `train_step`, on
    several replicas), the loss is scaled to this replica's share before
    backward and the gradients are summed (see the module docstring)."""
    optimizer = getattr(model, "optimizer", None)
    if (
        optimizer is None
        or not replicas.current().is_distributed
        or not _scales_loss_as_keras_does(optimizer)
    ):
        yield
        return
    state.applied = False
    replicas.batch_weight.loss_share = True
    try:
        yield
    finally:
        state.clear()


def scale_loss(original, optimizer, loss):
    """Keras `BaseOptimizer.scale_loss` and `LossScaleOptimizer.scale_loss`:
    in a train step that shares the loss (`sharing_the_loss`), Keras'
    scaled loss times this replica's share of the global batch (rows here
    / rows of the global batch), once per step: backward starts from what
    one process's loss gives these rows."""
    scaled = original(optimizer, loss)
    if not replicas.batch_weight.loss_share or state.applied:
        return scaled
    state.applied = True
    share = replicas.batch_scale() / replicas.current().count
    return scaled * share


def check_shared():
    """Raise if a train step that sums the gradients never scaled its
    loss (its gradients would be N times one process's)."""
    if replicas.batch_weight.loss_share and not state.applied:
        raise RuntimeError(
            "The train step ran backward without Keras' "
            "`optimizer.scale_loss(loss)`, yet its gradients are summed over "
            "the replicas as shares of the global batch's loss: they would "
            "be N times one process's. Call `self.optimizer.scale_loss(loss)` "
            "before `loss.backward()` in the train step, or report this with "
            "the model's train_step."
        )


def max_over_replicas(grads, variables, group):
    """The gradients `grads` (new values) of the overwritten `variables`
    made their maximum over the replicas of `group`, in place, one flat
    all-reduce per dtype. Collective: call on every rank."""
    local = []
    for grad, variable in zip(grads, variables):
        if grad is None:
            continue
        if gathering.gather_plan(variable) is not None:
            _refuse_batch_sharded(variable)
        local.append(tensors.local_part(grad))
    for bucket in collectives.buckets(local, None):
        flat = collectives.FlatBucket(bucket)
        dist.all_reduce(flat.flat, op=dist.ReduceOp.MAX, group=group.group)
        flat.copy_back()


def _refuse_batch_sharded(variable):
    raise ValueError(
        f"Variable {variable.path!r} (shape {tuple(variable.shape)}) is "
        "overwritten with its gradient by Keras' optimizer (a float8 scale "
        "or amax history) and sharded on the batch axis by the layout map: "
        "its new value is the maximum over the replicas, which FSDP's "
        "reduce-scatter (a sum) cannot give. Expected it whole or sharded on "
        "model axes only; remove the LayoutMap key that matches it."
    )

"""Gradient synchronization across data-parallel replicas.

Each replica's backward leaves gradients of its own rows. Before the
optimizer step, gradients are put in their variable's layout (a sharded
variable's gradient takes its placements, a plain variable's gradient is
made whole), then averaged over the batch process group in flat buckets
(`collectives.all_reduce`).
"""

from torch.distributed.tensor import DTensor

from keras_torch_distribution.distributed import tensors


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

"""BatchNormalization's moments over the global batch, as on one device.

Each data-parallel replica holds its rows of the global batch; one process
(and JAX, whose batch is one global array) normalizes with the moments of
all rows. So while training, each BatchNormalization layer sums, over its
reduction axes, x and x*x on its rows, and one all-reduce over the batch
process group adds them up with the element count:

    mean = sum(x) / count,   variance = sum(x*x) / count - mean**2

the formula of Keras' torch `moments`. Backward all-reduces the gradients of
the sums (so every replica's rows receive the gradient that flows through the
global statistics), as torch.nn.SyncBatchNorm does. Replicas of a last,
smaller batch are weighted by rows. A masked call makes two all-reduces
(Keras' masked moments are two-pass). Direct model calls, where every
process passes the same rows, get the same statistics as on one process.

Activations sharded on model axes (DTensors) reduce their local parts over
the batch group and keep their placements. Under `jit_compile=True` the
collectives are functional collectives inside the compiled forward and
backward.
"""

import keras
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors


def moments(original, layer, inputs, mask):
    """Keras `BatchNormalization._moments`: over the global batch when this
    process is one of several data-parallel replicas. Collective: call on
    every rank."""
    group = replicas.current()
    if (
        not group.is_distributed
        or not isinstance(inputs, torch.Tensor)
        or str(_keras.torch_device()) == "meta"
        or inputs.device.type == "meta"
    ):
        return original(layer, inputs, mask)
    axes = tuple(_keras.batch_norm_reduction_axes(layer))
    # The weight of this replica's gradient against the others' in
    # backward: rows here * replicas / global rows (1.0 but for a last,
    # uneven batch) when each replica backpropagates its rows' mean loss;
    # 1.0 when each scaled its loss to its share of the global batch's
    # before backward (`_training.reductions`): the gradients are then in
    # one unit already.
    scale = 1.0 if replicas.batch_weight.loss_share else replicas.batch_scale()
    if mask is None:
        return _moments(inputs, axes, group.group, scale)
    return _masked_moments(inputs, mask, axes, group.group, scale)


def _moments(x, axes, group, scale):
    count = _count(x, axes)
    total, squares, count = _sum_over_replicas(
        [torch.sum(x, dim=axes), torch.sum(torch.square(x), dim=axes), count],
        group,
        scale,
    )
    mean = total / count
    return mean, squares / count - torch.square(mean)


def _masked_moments(x, mask, axes, group, scale):
    """Keras' masked moments (two passes), over every replica's rows."""
    keep = torch.broadcast_to(torch.unsqueeze(mask, -1), x.shape).to(torch.bool)
    weights = keep.to(x.dtype)
    total, weight_sum = _sum_over_replicas(
        [
            torch.sum(torch.where(keep, x, 0), dim=axes, keepdim=True),
            torch.sum(weights, dim=axes, keepdim=True),
        ],
        group,
        scale,
    )
    denominator = weight_sum + keras.config.epsilon()
    mean = total / denominator
    squares = torch.square(torch.where(keep, x - mean, 0))
    (spread,) = _sum_over_replicas(
        [torch.sum(squares, dim=axes, keepdim=True)], group, scale
    )
    return torch.squeeze(mean), torch.squeeze(spread / denominator)


def _count(x, axes):
    count = 1
    for axis in axes:
        count *= int(x.shape[axis])
    device = tensors.local_part(x).device
    return torch.tensor([float(count)], dtype=x.dtype, device=device)


def _sum_over_replicas(values, group, scale):
    """`values` summed over the batch group in one all-reduce; DTensors keep
    their placements (their local parts are summed)."""
    locals_ = [tensors.local_part(v) for v in values]
    flat = torch.cat([v.reshape(-1) for v in locals_])
    flat = _SumOverReplicas.apply(flat, group, scale)
    out, offset = [], 0
    for value, local in zip(values, locals_):
        piece = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        if not value.requires_grad:  # the count: no gradient flows back
            piece = piece.detach()
        if isinstance(value, DTensor):
            piece = DTensor.from_local(
                piece,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        out.append(piece)
    return out


class _SumOverReplicas(torch.autograd.Function):
    """All-reduce (sum) over the batch group. Backward all-reduces the
    gradient: each replica's loss is the mean over its own rows, so the
    statistics' gradient is the sum of every replica's, each weighted by
    its share of the rows (`scale`: 1.0 for even batches) and returned in
    this replica's units (divided by its own)."""

    @staticmethod
    def forward(ctx, flat, group, scale):
        ctx.group, ctx.scale = group, scale
        return funcol.wait_tensor(funcol.all_reduce(flat, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        grad = funcol.wait_tensor(funcol.all_reduce(grad, "sum", ctx.group))
        if ctx.scale != 1.0:
            grad = grad / ctx.scale
        return grad, None, None

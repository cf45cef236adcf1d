"""Gradient synchronization across data-parallel replicas.

Each replica's backward leaves gradients of its own rows. Before the
optimizer step, gradients are put in their variable's layout (a sharded
variable's gradient takes its placements, a plain variable's gradient is
made whole), then averaged over the batch process group in flat buckets.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_torch_distribution import tensors

BUCKET_BYTES = 25 * 1024 * 1024


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


def local_part(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_reduce_mean(local_tensors, group, count, scale=1.0):
    """Average `local_tensors` in place over `group` of `count` replicas,
    each first multiplied by `scale`. Collective: call on every rank."""
    factor = scale / count
    for bucket in _buckets(local_tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        if factor != 1.0:
            flat.mul_(factor)
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _buckets(local_tensors):
    by_kind = {}
    for t in local_tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        bucket, size = [], 0
        for t in group:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

"""Moving values between plain tensors and DTensors of a layout."""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate

from keras_torch_distribution import _keras
from keras_torch_distribution import layouts


def as_torch(value, dtype=None):
    """A torch tensor (or DTensor) on this process's Keras device."""
    if isinstance(value, DTensor):
        return value if dtype is None else value.to(dtype)
    if isinstance(value, torch.Tensor):
        value = value.to(_keras.torch_device())
        return value if dtype is None else value.to(dtype)
    if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(
        value, (list, tuple)
    ):
        array = np.asarray(value)
        return torch.as_tensor(array, dtype=dtype, device=_keras.torch_device())
    if hasattr(value, "__array__"):
        return as_torch(np.asarray(value), dtype)
    raise TypeError(
        f"Cannot turn a {type(value).__name__} into a torch tensor; pass a "
        "numpy array, a torch tensor or a Keras variable."
    )


def local_block(full, torch_layout):
    """This rank's block of a full value, as a contiguous plain tensor."""
    box = layouts.local_box(full.shape, torch_layout.mesh, torch_layout.placements)
    return full[layouts.box_slices(box)].contiguous()


def from_local_block(block, torch_layout, global_shape):
    return DTensor.from_local(
        block,
        torch_layout.mesh,
        torch_layout.placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=layouts.contiguous_stride(global_shape),
    )


def to_layout(value, torch_layout):
    """`value` as a DTensor of `torch_layout`.

    Collective when `value` is a DTensor of another layout: call on every rank.
    """
    layouts.check_rank(torch_layout, tuple(value.shape), "the tensor")
    if isinstance(value, DTensor):
        if value.device_mesh == torch_layout.mesh:
            if tuple(value.placements) == tuple(torch_layout.placements):
                return value
            return value.redistribute(torch_layout.mesh, torch_layout.placements)
        return to_layout(full_value(value), torch_layout)
    value = as_torch(value)
    return from_local_block(
        local_block(value, torch_layout), torch_layout, tuple(value.shape)
    )


def full_value(value):
    """The whole value of a tensor; DTensors are gathered (differentiable).

    Collective for DTensors: call on every rank.
    """
    if not isinstance(value, DTensor):
        return value
    if not all(isinstance(p, Replicate) for p in value.placements):
        replicated = [Replicate()] * value.device_mesh.ndim
        value = value.redistribute(value.device_mesh, replicated)
    local = value.to_local()
    if local.requires_grad:
        local = PlainGradient.apply(local)
    return local


class PlainGradient(torch.autograd.Function):
    """Identity on a plain tensor made from a DTensor (`to_local`), whose
    gradient may come back as a DTensor: a plain tensor that meets DTensors
    (implicit replication) gets DTensor gradients, which `to_local`'s
    backward refuses. The gradient is made whole (plain) first."""

    @staticmethod
    def forward(ctx, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return full_value(grad) if isinstance(grad, DTensor) else grad


def to_numpy(original, value):
    """Keras' `convert_to_numpy`: a DTensor gives its global value.

    Collective for DTensors: call on every rank.
    """
    if isinstance(value, DTensor):
        value = full_value(value.detach())
    return original(value)


def reduce_partial(value):
    """A DTensor with its partial sums reduced (other placements kept).

    Differentiable: the gradient flows back replicated on the reduced mesh
    axes. Collective for DTensors with a Partial placement: call on every rank.
    """
    if not isinstance(value, DTensor):
        return value
    if not any(isinstance(p, Partial) for p in value.placements):
        return value
    return _ReducePartial.apply(value)


class _ReducePartial(torch.autograd.Function):
    """Partial -> Replicate forward; the gradient comes back Replicate there.

    DTensor's own `redistribute` would send the gradient back to the source
    placement, which fails for the masked partial sums of a vocabulary-sharded
    embedding lookup (Partial(sum) -> MaskPartial is unsupported).
    """

    @staticmethod
    def forward(ctx, value):
        ctx.partial_axes = [isinstance(p, Partial) for p in value.placements]
        placements = [
            Replicate() if partial else p
            for p, partial in zip(value.placements, ctx.partial_axes)
        ]
        return value.redistribute(value.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        placements = [
            Replicate() if partial else p
            for p, partial in zip(grad.placements, ctx.partial_axes)
        ]
        if placements == list(grad.placements):
            return grad
        return grad.redistribute(grad.device_mesh, placements)

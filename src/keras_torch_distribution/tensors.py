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


def to_layout(value, torch_layout, what="the tensor"):
    """`value` as a DTensor of `torch_layout` (a shorter layout lays out the
    leading dims; `what` names the value in errors).

    Collective when `value` is a DTensor of another layout: call on every rank.
    """
    layouts.check_rank(torch_layout, tuple(value.shape), what)
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


def _writable_by(inputs, updates):
    """`inputs` in a container that `updates` can be written into.

    Keras' torch `slice_update` / `scatter_update` clone `inputs` and write
    `updates` into the clone in place. DTensor refuses in-place ops on a
    plain tensor (keras_hub's cached attention writes head-sharded
    key/value updates into a plain cache) and in-place index writes that
    would change a sharded tensor's placement (keras_hub's samplers write
    each new token into a batch-sharded prompt). When either is a DTensor,
    the write goes into a replicated DTensor: a plain `inputs` is the
    replicated value it stands for (as implicit replication reads it), a
    sharded one is gathered. Collective when `inputs` is a sharded DTensor:
    call on every rank.
    """
    if isinstance(inputs, DTensor):
        mesh = inputs.device_mesh
        if all(isinstance(p, Replicate) for p in inputs.placements):
            return inputs
        return inputs.redistribute(mesh, [Replicate()] * mesh.ndim)
    if not isinstance(updates, DTensor) or not isinstance(inputs, torch.Tensor):
        return inputs
    mesh = updates.device_mesh
    return DTensor.from_local(
        inputs.to(updates.device), mesh, [Replicate()] * mesh.ndim, run_check=False
    )


def slice_update(original, inputs, start_indices, updates):
    """Keras' torch `slice_update`, also for plain `inputs` and DTensor
    `updates` or start indices (an index computed from a DTensor, as
    keras_hub's samplers compute the cache position, is used as its full
    value)."""
    if isinstance(start_indices, (list, tuple)):
        start_indices = type(start_indices)(full_value(i) for i in start_indices)
    else:
        start_indices = full_value(start_indices)
    return original(_writable_by(inputs, updates), start_indices, updates)


def scatter_update(original, inputs, indices, updates, reduction=None):
    """Keras' torch `scatter_update`, also for plain `inputs` and DTensor
    `updates` or indices."""
    inputs = _writable_by(inputs, updates)
    if not isinstance(inputs, DTensor):
        indices = full_value(indices)
    return original(inputs, indices, updates, reduction=reduction)


def settle(value):
    """A layer's output as the next layer takes it: partial sums reduced,
    and a value replicated on every mesh axis as a plain tensor (the value
    implicit replication reads a plain tensor as). Fewer DTensor ops, and
    the plain values computed beside it (masks and their (1,)-shaped sums,
    as keras_hub's MoE load-balancing loss computes) meet plain tensors,
    not DTensors, so DTensor does not warn "Found a non-scalar tensor with
    numel=1". Differentiable (see `_Settle`). Collective for DTensors with
    a Partial placement: call on every rank.
    """
    if not isinstance(value, DTensor):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            _repair_gradients(value)
        return value
    partial = any(isinstance(p, Partial) for p in value.placements)
    replicated = all(isinstance(p, (Partial, Replicate)) for p in value.placements)
    if partial or replicated:
        return _Settle.apply(value)
    if value.requires_grad:
        _repair_gradients(value)
    return value


def _repair_gradients(value):
    """Give the gradients that reach `value` a sound local block (see
    `_Settle`)."""
    if not torch.compiler.is_compiling():
        value.register_hook(_locally_contiguous)


class _Settle(torch.autograd.Function):
    """Partial -> Replicate forward, and a replicated result as its plain
    local tensor; the gradient comes back Replicate on the reduced axes.

    DTensor's own `redistribute` would send the gradient back to the source
    placement, which fails for the masked partial sums of a vocabulary-sharded
    embedding lookup (Partial(sum) -> MaskPartial is unsupported). A plain
    result is a fresh tensor (the reduction's, or a copy: later in-place ops
    on it must not reach a DTensor that autograd saved, and torch's
    `to_local()` view forbids them).

    The backward also gives the gradient a local block laid out as the
    gradient's own strides say. torch 2.13's DTensor can produce gradients
    whose local block is transposed while the DTensor claims to be
    contiguous (a `cat` of gradients whose size-1 dims carry other strides,
    as in keras_hub's rotary embeddings under a heads-sharded layout); the
    next `view` in a layer (every EinsumDense reshapes) then fails with
    "view size is not compatible with input tensor's size and stride".
    Layer outputs pass through here (sharded ones get the same repair as a
    gradient hook), so gradients enter each layer sound.
    """

    @staticmethod
    def forward(ctx, value):
        mesh = value.device_mesh
        ctx.mesh = mesh
        ctx.partial_axes = [isinstance(p, Partial) for p in value.placements]
        placements = [
            Replicate() if partial else p
            for p, partial in zip(value.placements, ctx.partial_axes)
        ]
        reduced = value
        if any(ctx.partial_axes):
            reduced = value.redistribute(mesh, placements)
        if not all(isinstance(p, Replicate) for p in placements):
            return reduced
        local = reduced.to_local()
        return local if reduced is not value else local.clone()

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return DTensor.from_local(
                grad, ctx.mesh, [Replicate()] * ctx.mesh.ndim, run_check=False
            )
        placements = [
            Replicate() if partial else p
            for p, partial in zip(grad.placements, ctx.partial_axes)
        ]
        if placements != list(grad.placements):
            grad = grad.redistribute(grad.device_mesh, placements)
        return _locally_contiguous(grad)


def _locally_contiguous(value):
    """`value` with a contiguous local block when the DTensor says it is
    contiguous (see `_Settle`); plain tensors as they are."""
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    if not value.is_contiguous() or local.is_contiguous():
        return value
    return DTensor.from_local(
        local.contiguous(),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )

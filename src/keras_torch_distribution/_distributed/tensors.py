"""Moving values between plain tensors and DTensors of a layout.

Whole values of sharded variables live on the host, never on a device:
a full value given for a sharded layout (an initial value, `set_weights`,
`assign`) is sliced where it is (host memory for numpy and CPU tensors)
and only this rank's block goes to the device (`to_layout`); a sharded
value read whole (`np.asarray(variable)`, Keras files) is assembled in host
memory from every rank's block (`host_value`).
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._processes import runtime


def as_torch(value, dtype=None, device=None):
    """A torch tensor (or DTensor) on `device` (default: this process's
    Keras device)."""
    device = _keras.torch_device() if device is None else device
    if isinstance(value, DTensor):
        return value if dtype is None else value.to(dtype)
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value if dtype is None else value.to(dtype)
    if (
        isinstance(value, np.ndarray)
        or np.isscalar(value)
        or isinstance(value, (list, tuple))
    ):
        array = np.asarray(value)
        return torch.as_tensor(array, dtype=dtype, device=device)
    if hasattr(value, "__array__"):
        return as_torch(np.asarray(value), dtype, device)
    raise TypeError(
        f"Cannot turn a {type(value).__name__} into a torch tensor; pass a "
        "numpy array, a torch tensor or a Keras variable."
    )


def where_it_is(value, dtype=None):
    """`value` as a torch tensor without moving it to a device: numpy
    arrays, lists and numbers become CPU tensors, tensors stay on their
    device (a DTensor as it is)."""
    if isinstance(value, torch.Tensor):
        return value if dtype is None else value.to(dtype)
    return as_torch(value, dtype, device="cpu")


def local_block(full, torch_layout):
    """This rank's block of a full value, as a contiguous plain tensor on
    this process's Keras device, sliced where `full` is (host memory for
    a CPU tensor: only the block goes to the device)."""
    box = layouts.local_box(
        full.shape, torch_layout.mesh, torch_layout.placements
    )
    block = full[layouts.box_slices(box)]
    moved = block.to(_keras.torch_device())
    if moved is block:  # a copy, not a view that keeps `full` alive
        return block.clone(memory_format=torch.contiguous_format)
    return moved.contiguous()


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
            return value.redistribute(
                torch_layout.mesh, torch_layout.placements
            )
        return to_layout(full_value(value), torch_layout)
    value = where_it_is(value)  # sliced on the host: no device holds it whole
    if value.requires_grad:
        value = as_torch(value)
        # Differentiably, as the replicated value it is: the gradient of
        # this rank's block comes back gathered (every rank's rows), where
        # slicing a block would hand back this rank's rows only.
        mesh = torch_layout.mesh
        replicated = DTensor.from_local(
            value, mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        return replicated.redistribute(mesh, torch_layout.placements)
    return from_local_block(
        local_block(value, torch_layout), torch_layout, tuple(value.shape)
    )


def local_part(value):
    """This rank's part of `value`: a DTensor's local block, anything else
    as it is. Not a collective."""
    return value.to_local() if isinstance(value, DTensor) else value


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


def host_value(value):
    """The whole value of a DTensor as a CPU tensor, assembled in host
    memory: each rank's block goes to the CPU and travels in one all-gather
    on `runtime.cpu_group()` (the blocks padded to the largest, as bytes),
    so that no device ever holds the whole value (a DTensor redistribute to
    Replicate would put it whole on every GPU). Partial sums are reduced on
    the device first (a block's size). A DTensor on a mesh that does not
    hold every process is gathered as `full_value` gathers it.
    Collective: call on every rank."""
    mesh = value.device_mesh
    if any(isinstance(p, Partial) for p in value.placements):
        placements = [
            Replicate() if isinstance(p, Partial) else p
            for p in value.placements
        ]
        value = value.redistribute(mesh, placements)
    world = runtime.num_processes()
    if mesh.mesh.numel() != world or not all(
        isinstance(p, (Shard, Replicate)) for p in value.placements
    ):
        return full_value(value).cpu()
    local = value.to_local().detach()
    if world == 1:
        return local.cpu()
    shape = tuple(value.shape)
    boxes = [None] * world
    for coordinate, rank in _grid_cells(mesh.mesh):
        boxes[rank] = layouts.local_box(
            shape, mesh, value.placements, coordinate
        )
    element = local.element_size()
    sizes = [_box_numel(box) * element for box in boxes]
    largest = max(sizes)
    mine = torch.zeros(largest, dtype=torch.uint8)
    if local.numel():
        mine[: local.numel() * element] = (
            local.contiguous().cpu().reshape(-1).view(torch.uint8)
        )
    gathered = [torch.empty(largest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, mine, group=runtime.cpu_group())
    del mine
    whole = torch.empty(shape, dtype=value.dtype)
    for box, size, piece in zip(boxes, sizes, gathered):
        if size:
            block_shape = tuple(hi - lo for lo, hi in box)
            whole[layouts.box_slices(box)] = (
                piece[:size].view(value.dtype).view(block_shape)
            )
    return whole


def _grid_cells(rank_grid):
    """(mesh coordinate, global rank) of every cell of a mesh's rank grid."""
    flat = rank_grid.reshape(-1).tolist()
    shape = tuple(rank_grid.shape)
    for index, rank in enumerate(flat):
        coordinate = []
        for size in reversed(shape):
            coordinate.append(index % size)
            index //= size
        yield tuple(reversed(coordinate)), int(rank)


def _box_numel(box):
    count = 1
    for lo, hi in box:
        count *= hi - lo
    return count


def reduce_partial(value):
    """A layer's output as the next layer takes it: a DTensor with its
    partial sums reduced (other placements kept).

    Differentiable: the gradient flows back replicated on the reduced mesh
    axes, and gradients reaching any layer output get a local block laid
    out as the gradient says (see `_ReducePartial`). Collective for
    DTensors with a Partial placement: call on every rank.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) and any(
        isinstance(p, Partial) for p in value.placements
    ):
        return _ReducePartial.apply(value)
    if value.requires_grad and not torch.compiler.is_compiling():
        value.register_hook(_locally_contiguous)
    return value


class _ReducePartial(torch.autograd.Function):
    """Partial -> Replicate forward; the gradient comes back Replicate there.

    DTensor's own `redistribute` would send the gradient back to the source
    placement, which fails for the masked partial sums of a vocabulary-sharded
    embedding lookup (Partial(sum) -> MaskPartial is unsupported).

    The backward also gives the gradient a local block laid out as the
    gradient's own strides say. torch 2.13's DTensor can produce gradients
    whose local block is transposed while the DTensor claims to be
    contiguous (a `cat` of gradients whose size-1 dims carry other strides,
    as in keras_hub's rotary embeddings under a heads-sharded layout); the
    next `view` in a layer (every EinsumDense reshapes) then fails with
    "view size is not compatible with input tensor's size and stride".
    Every layer output passes through here or gets the same repair as a
    gradient hook, so gradients enter each layer sound.
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
        if placements != list(grad.placements):
            grad = grad.redistribute(grad.device_mesh, placements)
        return _locally_contiguous(grad)


def _locally_contiguous(value):
    """`value` with a contiguous local block when the DTensor says it is
    contiguous (see `_ReducePartial`); plain tensors as they are."""
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


def for_compute(value, compute):
    """`value`, a DTensor whose mesh holds the batch axis (replicated on
    it), as the DTensor of `compute` (`layouts.compute_layout` of its
    layout) that layers compute with: the same local block, on the mesh of
    the other axes. Its gradient comes back in `value`'s layout (each
    replica's own, averaged over the batch axis by the trainer); partial
    sums over the other axes are reduced first (`from_local`'s backward
    redistributes to the placements it was given). Not a collective in
    forward; every rank runs backward.

    `to_local` then `from_local`, DTensor's own differentiable moves
    (SimpleFSDP's, which torch.compile traces), not an autograd Function
    of the package's: with one, a compiled step (torch 2.13) handed the
    optimizer a Conv2D kernel gradient whose local block was whole
    (`test_batchnorm_cnn_on_2x2_mesh[jit]`)."""
    if value.device_mesh is compute.mesh:
        return value
    local = value.to_local(grad_placements=value.placements)
    return DTensor.from_local(
        local,
        compute.mesh,
        compute.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )

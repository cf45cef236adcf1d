"""Each rank's bytes, from shapes and layouts: pure arithmetic.

A variable's block on rank r is `layouts.local_box` at r's coordinate in
its mesh (DTensor's `Shard` semantics: ceil-sized pieces, the last ones
smaller or empty); a variable no layout shards is whole on every rank.
Rank 0's figures are checked against the blocks rank 0 holds
(`check_rank0`), so the arithmetic for the other ranks is the arithmetic
that held for this one.

- parameters: every model variable (trainable or not), in its stored dtype;
- gradients: each trainable variable's gradient as the simulated step left
  it (`.grad`: a gradient may be laid out otherwise than its variable, a
  replicated gradient of a sharded embedding); without a step, each
  trainable float variable's block (FSDP's gradients are reduce-scattered
  into the stored shards);
- optimizer state: every optimizer variable (slots are laid out as their
  variables);
- FSDP groups: the variables a group gathers along the batch axis (`fsdp.
  groups`: the outermost layers below the models), gathered whole on that
  axis, in the dtype they are read in (the layer's compute dtype under
  mixed precision); the largest group plus the next `prefetch` groups
  gathered ahead of it is the estimate of what FSDP holds on top of the
  state where no step measured it (`_fsdp_figure`).
"""

import math

import keras
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts

# (global shape, id of the mesh, placements, rank) -> elements: variables
# of one shape and layout (a model's blocks) are computed once per rank.
_blocks = {}


def forget():
    """Drop the cached blocks (a new plan: meshes of the last one are gone)."""
    _blocks.clear()


def coordinate(mesh, rank):
    """`rank`'s coordinate in a torch DeviceMesh, or None if it is not in
    the mesh."""
    where = (mesh.mesh == rank).nonzero()
    if len(where) == 0:
        return None
    return tuple(int(i) for i in where[0])


def _block(shape, mesh, placements, rank):
    key = (shape, id(mesh), tuple(placements), rank)
    if key not in _blocks:
        where = coordinate(mesh, rank)
        if where is None:
            _blocks[key] = 0
        else:
            box = layouts.local_box(shape, mesh, placements, where)
            _blocks[key] = math.prod(hi - lo for lo, hi in box)
    return _blocks[key]


def _itemsize(variable):
    value = _keras.raw_value(variable)
    if value is not None:
        return value.element_size()
    return torch.empty(
        (), dtype=_keras.to_torch_dtype(variable.dtype)
    ).element_size()


def block_numel(variable, rank, placements=None, mesh=None):
    """How many elements of `variable` rank `rank` holds (with its own
    layout, or `placements` on its mesh, or on `mesh`)."""
    shape = tuple(int(n) for n in variable.shape)
    layout = layouts.resolved_layout(variable)
    if mesh is None and layout is None:
        return math.prod(shape)
    mesh = mesh if mesh is not None else layout.mesh
    return _block(shape, mesh, placements or layout.placements, rank)


def variable_bytes(variable, rank):
    return block_numel(variable, rank) * _itemsize(variable)


def has_gradient(variable):
    dtype = _keras.to_torch_dtype(variable.dtype)
    return bool(variable.trainable) and (
        dtype.is_floating_point or dtype.is_complex
    )


def unique(variables):
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def params_bytes(model, rank):
    return sum(variable_bytes(v, rank) for v in unique(model.variables))


_NO_GRADIENT = object()


def gradient_layouts(model):
    """After a step: each trainable variable's gradient as autograd left it
    (`.grad`): id(variable) -> (mesh, placements, itemsize) for a DTensor,
    (None, None, itemsize) for a plain tensor; variables without one are
    absent. A gradient may be laid out otherwise than its variable (a
    replicated gradient of a sharded embedding), so that a step's own
    layouts, not the variables', give each rank's gradient bytes."""
    found = {}
    for v in unique(model.trainable_variables):
        value = _keras.raw_value(v)
        grad = getattr(value, "grad", None)
        if grad is None:
            continue
        placements = getattr(grad, "placements", None)
        mesh = getattr(grad, "device_mesh", None)
        if mesh is not None:
            # A gradient on the mesh layers compute on (without the batch
            # axis: `layouts.compute_layout`), whose rank 0 slice holds
            # ranks other than rank 0's: as the same layout on the whole
            # mesh, so that every rank's block is found.
            mesh, placements = layouts.torch_meshes.on_full_mesh(
                mesh, placements
            )
        found[id(v)] = (mesh, placements, grad.element_size())
    return found


def grads_bytes(model, rank, layouts_of_grads=None):
    """Each trainable float variable's gradient on `rank`: laid out as the
    step left it where `layouts_of_grads` (`gradient_layouts`) is given,
    else as its variable."""
    total = 0
    for v in unique(model.trainable_variables):
        if not has_gradient(v):
            continue
        if layouts_of_grads is None:
            total += variable_bytes(v, rank)
            continue
        mesh, placements, itemsize = layouts_of_grads.get(
            id(v), (None, None, _NO_GRADIENT)
        )
        if itemsize is _NO_GRADIENT:
            continue
        if mesh is None:
            total += math.prod(int(n) for n in v.shape) * itemsize
        else:
            total += block_numel(v, rank, placements, mesh) * itemsize
    return total


def optimizer_variables(model):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    return unique(optimizer.variables)


def optimizer_bytes(model, rank):
    return sum(variable_bytes(v, rank) for v in optimizer_variables(model))


def check_rank0(model, layouts_of_grads=None):
    """Rank 0's arithmetic against the blocks it holds (and the gradients
    its step left); a RuntimeError names what differs (a bug in the
    plan)."""
    if layouts_of_grads is not None:
        held = 0
        for v in unique(model.trainable_variables):
            grad = getattr(_keras.raw_value(v), "grad", None)
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                held += local.numel() * local.element_size()
        computed = grads_bytes(model, 0, layouts_of_grads)
        if held != computed:
            raise RuntimeError(
                f"ktd plan: rank 0's gradients hold {held} bytes but their "
                f"layouts give {computed}: the plan's arithmetic is wrong "
                "here; please report it."
            )
    for variable in unique(model.variables) + optimizer_variables(model):
        value = _keras.raw_value(variable)
        if value is None:
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        held = local.numel() * local.element_size()
        computed = variable_bytes(variable, 0)
        if held != computed:
            raise RuntimeError(
                f"ktd plan: variable {variable.path!r} holds {held} bytes on "
                f"rank 0 but its layout gives {computed}: the plan's "
                "arithmetic is wrong here; please report it."
            )


def fsdp_groups(model):
    """[(group name, [(variable, itemsize it is gathered in)])] in layer
    order: the variables each outermost layer below the models gathers on
    the batch axis (see `_fsdp.groups`)."""
    groups, seen = [], set()

    def visit(layer):
        if isinstance(layer, keras.Model):
            for sub in layer.layers:
                visit(sub)
            return
        members = []
        for v in layer.weights:
            if id(v) in seen or getattr(v, "_ktd_gather", None) is None:
                continue
            seen.add(id(v))
            itemsize = _itemsize(v)
            if getattr(v, "autocast", False) and has_gradient(v):
                compute = getattr(layer, "compute_dtype", None)
                if compute:
                    itemsize = min(
                        itemsize,
                        torch.empty(
                            (), dtype=_keras.to_torch_dtype(compute)
                        ).element_size(),
                    )
            members.append((v, itemsize))
        if members:
            groups.append((layer.name, members))

    visit(model)
    return groups


def gathered_bytes(members, rank):
    return sum(
        block_numel(v, rank, v._ktd_gather.gathered) * itemsize
        for v, itemsize in members
    )


def fsdp_peak(groups, rank, prefetch):
    """(largest group's name, its gathered bytes, the bytes of the
    `prefetch` groups gathered ahead of it) for the group whose gather plus
    prefetch is largest; None without FSDP groups."""
    if not groups:
        return None
    sizes = [gathered_bytes(members, rank) for _, members in groups]
    best = None
    for i, size in enumerate(sizes):
        ahead = sum(sizes[i + 1 : i + 1 + prefetch])
        if best is None or size + ahead > best[1] + best[2]:
            best = (groups[i][0], size, ahead)
    return best

"""Copies of a variable made equal across processes.

Processes seeded differently (`keras.utils.set_random_seed(1000 + rank)`,
a common way to vary augmentation) initialize the copies of a variable
differently: a plain variable is whole on every process, and a sharded one
has a copy of each block on every coordinate of the mesh axes that do not
shard it. Every copy is made equal to the first:

- a plain variable: broadcast from rank 0;
- a sharded variable: its block, along each mesh axis that does not shard
  it, from that axis' coordinate 0. Blocks sharded on every axis have no
  copies.

Copies are made equal as they are created, as on JAX, where a replicated
variable is one array: the variables a model's build creates (any
outermost Keras layer call: a functional model's layers as it is
constructed, a subclassed model's first call) are registered (`created`)
and, when that call returns, made equal in flat broadcasts per process
group (`collectives`), one bucketed broadcast per build, not one per
variable. The broadcast starts with the all-gather of the agreement check
(`agreement.compare`): a rank that builds another model than the others,
or a model they never build, meets them at their next build or fit /
evaluate / predict, and every rank raises an error naming what each one
was doing, instead of waiting forever in a broadcast.
Variables whose initializer is a constant (zeros, ones: optimizer slots,
metric states) are equal anyway and are marked so, without a broadcast.
What is left -- variables created outside any layer call (a
`keras.Variable` of your own, a SeedGenerator made in a layer's
constructor) or before the distribution was set -- is made equal before the
model's first step (`replica_start`).
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._distributed import collectives
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._processes import runtime


class PendingCopies:
    """Variables created during the outermost layer call in progress whose
    copies may differ, in creation order (the same on every rank)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.collecting = False
        self.variables = []


pending = PendingCopies()


def created(variable, constant=False):
    """Note a just-initialized variable: one filled with a `constant` is
    equal on every process already; another, created during a build, has
    its copies made equal when the build returns (`equal_when_built`)."""
    if _keras.current_distribution() is None or not runtime.is_multi_process():
        return
    if constant:
        variable._ktd_copies_equal = True
    elif pending.collecting:
        pending.variables.append(variable)


@contextlib.contextmanager
def equal_when_built():
    """Around an outermost layer call: the copies of the variables it
    creates are made equal when it returns. Collective when it created any:
    call on every rank."""
    if (
        pending.collecting
        or torch.compiler.is_compiling()
        or _keras.current_distribution() is None
        or not runtime.is_multi_process()
    ):
        yield
        return
    pending.collecting = True
    try:
        yield
    except BaseException:
        pending.clear()
        raise
    variables = pending.variables
    pending.clear()
    make_built_equal(variables)


def variable_items(variables):
    """Each variable's path, shape, dtype and layout, as (name, text) pairs."""
    items = []
    for variable in variables:
        layout = layouts.resolved_layout(variable)
        axes = tuple(layout.axes) if layout is not None else None
        items.append(
            (
                f"variable {variable.path}",
                f"{tuple(variable.shape)} {variable.dtype} {axes}",
            )
        )
    return items


def make_built_equal(variables):
    """Make the copies of the `variables` a build created equal, after the
    ranks agree that they built the same ones (`agreement.compare`); returns
    the number of blocks sent. Collective: call on every rank."""
    variables = [v for v in variables if not are_equal(v)]
    if not variables:
        return 0
    paths = ", ".join(repr(v.path) for v in variables[:3])
    more = ", ..." if len(variables) > 3 else ""
    count = f"{len(variables)} variable" + ("s" if len(variables) > 1 else "")
    agreement.compare(
        f"the build of {count} ({paths}{more})",
        variable_items(variables),
    )
    return make_equal(variables)


def are_equal(variable):
    """True once `variable`'s copies were made equal (or born equal)."""
    return getattr(variable, "_ktd_copies_equal", False)


def make_equal(variables):
    """Make every copy of `variables` equal to the first copy; returns the
    number of blocks sent. Collective: call on every rank."""
    groups = {}  # process group -> (source rank, [local tensors])
    for variable in variables:
        value = _keras.raw_value(variable)
        if value is None:
            continue
        variable._ktd_copies_equal = True
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            for axis, placement in enumerate(value.placements):
                if isinstance(placement, Replicate) and mesh.size(axis) > 1:
                    group = mesh.get_group(axis)
                    _add(
                        groups,
                        group,
                        dist.get_global_rank(group, 0),
                        value.to_local(),
                    )
        else:
            _add(groups, dist.group.WORLD, 0, value)
    count = 0
    with torch.no_grad():
        for group, (source, tensors) in groups.items():
            collectives.broadcast(tensors, source, group)
            count += len(tensors)
    return count


def _add(groups, group, source, tensor):
    if tensor.numel():
        groups.setdefault(group, (source, []))[1].append(tensor)

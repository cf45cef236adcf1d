"""Copies of a variable are equal from creation.

Processes seeded differently (`keras.utils.set_random_seed(1000 + rank)`,
a common way to vary augmentation) initialize the copies of a variable
differently: a plain variable is whole on every process, and a sharded one
has a copy of each block on every coordinate of the mesh axes that do not
shard it. On JAX a replicated variable is one array, so every copy is made
equal to the first:

- a plain variable: broadcast from rank 0;
- a sharded variable: its block, along each mesh axis that does not shard
  it, from that axis' coordinate 0. Blocks sharded on every axis have no
  copies.

Variables are registered as they are created (`created`), and the copies
are made equal in flat broadcasts per process group (`collectives`), when
the outermost Keras layer call that created them returns (a model's build)
and before a model's first step (`replica_start`), so creation costs one
bucketed broadcast per model, not one per variable. Variables whose
initializer is a constant (zeros, ones: optimizer slots, metric states)
are equal anyway and are left out.
"""

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_torch_distribution import _keras
from keras_torch_distribution import collectives
from keras_torch_distribution import runtime


class PendingCopies:
    """Variables created on several processes whose copies are not yet
    made equal, in creation order (the same on every rank)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.variables = []  # weak references


pending = PendingCopies()


def created(variable, constant=False):
    """Register a just-initialized variable whose copies may differ; one
    filled with a `constant` is equal everywhere already."""
    if _keras.current_distribution() is None or not runtime.is_multi_process():
        return
    value = _keras.raw_value(variable)
    if value is None or value.device.type == "meta":
        return
    if constant:
        variable._ktd_copies_equal = True
    else:
        pending.variables.append(weakref.ref(variable))


def are_equal(variable):
    """True once `variable`'s copies were made equal (or born equal)."""
    return getattr(variable, "_ktd_copies_equal", False)


def make_pending_equal():
    """Make the copies of every registered variable equal (see the module
    docstring). Collective when any is registered: call on every rank."""
    if not pending.variables:
        return 0
    variables = [v for v in (ref() for ref in pending.variables) if v is not None]
    pending.clear()
    return make_equal(variables)


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
                    _add(groups, group, dist.get_global_rank(group, 0), value.to_local())
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

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

Variables whose initializer is a constant (zeros, ones: optimizer slots,
metric states) are equal anyway and are marked so as they are created
(`created`), without a broadcast. The copies of a model's other variables
are made equal in flat broadcasts per process group (`collectives`) before
the model's first step (`replica_start`), not as the model is built: a
rank that builds another model than the others (a bug `agreement` names at
the start of fit) would otherwise wait forever in that broadcast.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_torch_distribution import _keras
from keras_torch_distribution import collectives
from keras_torch_distribution import runtime


def created(variable, constant=False):
    """Note a just-initialized variable: one filled with a `constant` is
    equal on every process already and needs no broadcast."""
    if constant and _keras.current_distribution() is not None and runtime.is_multi_process():
        variable._ktd_copies_equal = True


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
